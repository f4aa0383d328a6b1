"""The Ray Serve scale-out (app/cluster/) on this machine: `python -m app.cluster --replicas 2` with the tiny
model, two real vLLM CPU engines, real HTTP clients (the openai SDK, httpx) against Serve's HTTP proxy.

Requests spread over both replicas; a voice saved through one is used through the other; one replica
killed (SIGKILL) mid-stream breaks that stream only, requests after it succeed, Ray starts a new
replica; no replica keeps an engine request. Skips (saying why) where Ray Serve is not installed
(requirements-ray.txt; scripts/setup_cpu.sh installs it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from studio import EXAMPLE_TRANSCRIPT, EXAMPLE_WAV, REPO, free_port, stop_server

START_TIMEOUT_S = 900  # two replicas (each a model + a vLLM engine) starting on 2 shared cores
RESTART_TIMEOUT_S = 600  # Serve notices the dead replica and starts another one
TEXT = "Hello from the cluster."
SAMPLE_BYTES = 2  # s16le


def _sets(tmp: Path) -> list[str]:
    n_cpu = os.cpu_count() or 1
    sets = {"vllm.cpu_omp_threads_bind": f'"0-{n_cpu - 1}"', "vllm.cpu_num_reserved_cpus": "0",
            "vllm.cpu_kvcache_space_gib": "1", "vllm.max_num_seqs": "8", "vllm.dtype": '"float32"',
            "vllm.export_cache_dir": f'"{tmp / "export"}"', "server.voices_dir": f'"{tmp / "voices"}"',
            "cluster.num_cpus": "0.5", "cluster.replica_timeout_s": "30", "cluster.request_retries": "3"}
    return [arg for k, v in sets.items() for arg in ("--set", f"{k}={v}")]


def _health(base: str) -> dict:
    return httpx.get(f"{base}/health", timeout=60).json()


def _wait_ready(base: str, n: int, timeout_s: float, proc: subprocess.Popen, log: Path) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"the cluster exited:\n{log.read_text()[-4000:]}"
        with contextlib.suppress(httpx.HTTPError, ValueError):
            h = _health(base)
            if h.get("replicas_ready") == n and len(h["replicas"]) == n:
                return h
        assert time.monotonic() < deadline, f"{n} replicas not ready in time:\n{log.read_text()[-4000:]}"
        time.sleep(1.0)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[tuple[str, Path, subprocess.Popen]]:
    """(base_url, tmp, launcher process) of a 2-replica cluster; Ray's own files in a short temp dir."""
    try:
        import ray.serve  # noqa: F401
    except ImportError:  # scripts/setup_cpu.sh installs it: in CI a missing Ray is a broken setup, not a skip
        if os.environ.get("CI"):
            raise
        pytest.skip("Ray Serve is not installed (pip install -r requirements-ray.txt)")
    tmp = Path(tempfile.mkdtemp(prefix="cluster-"))  # short: Ray's unix sockets live under RAY_TMPDIR
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if k not in ("COSYVOICE_API_KEY", "COSYVOICE_AUTH")},
           "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "RAY_TMPDIR": str(tmp / "ray"),
           "RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [sys.executable, "-m", "app.cluster", "--replicas", "2", "--config", "configs/cpu.toml", "--model-dir",
           str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(port), *_sets(tmp)]
    log = tmp / "cluster.log"
    base = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_ready(base, 2, START_TIMEOUT_S, proc, log)
            yield base, tmp, proc
        finally:
            stop_server(proc)  # SIGTERM: serve.shutdown() closes the replicas' engines, then Ray stops
            shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def oai(cluster):
    from openai import OpenAI

    return OpenAI(base_url=cluster[0] + "/v1", api_key="unused", max_retries=0, timeout=300)


def _save(base: str, name: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/voices", files={"audio": ("ref.wav", EXAMPLE_WAV.read_bytes(), "audio/wav")},
                      data={"transcript": EXAMPLE_TRANSCRIPT, "name": name}, timeout=300)


def _speak(oai, voice: str, text: str = TEXT) -> tuple[str, int]:
    """(replica that answered, audio bytes) of one streamed pcm request."""
    with oai.audio.speech.with_streaming_response.create(model="cosyvoice2", voice=voice, input=text,
                                                         response_format="pcm", extra_body={"seed": 1}) as r:
        n = sum(len(piece) for piece in r.iter_bytes())
        return r.headers["x-replica"], n


def _no_engine_requests_left(base: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        h = _health(base)
        if all(r.get("lm_unfinished") == 0 and r.get("active_streams") == 0 for r in h["replicas"]):
            return h
        assert time.monotonic() < deadline, h
        time.sleep(0.5)


def test_requests_spread_and_a_voice_saved_through_one_replica_works_through_the_other(cluster, oai):
    base = cluster[0]
    r = _save(base, "shared")
    assert r.status_code == 201, r.text
    saver = r.headers["x-replica"]
    seen: dict[str, int] = {}
    errors: list[BaseException] = []

    def one() -> None:
        try:
            replica, n = _speak(oai, "shared")
            seen[replica] = seen.get(replica, 0) + 1
            assert n > 0 and n % SAMPLE_BYTES == 0
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    for _ in range(4):  # rounds of 2 at once: Serve sends each to the less busy replica
        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not errors, errors
        if len(seen) == 2:
            break
    assert len(seen) == 2, f"every request went to one replica: {seen}"
    assert set(seen) - {saver}, "no request reached the replica that did not save the voice"
    listed = {v["id"] for v in httpx.get(f"{base}/v1/voices", timeout=60).json()["data"]}
    assert "shared" in listed
    h = _no_engine_requests_left(base)
    assert {r["id"] for r in h["replicas"]} == set(seen)
    assert h["requests"]["outcomes"]["ok"] >= 2 and h["lm_unfinished"] == 0


def test_merged_metrics_label_each_replica_and_sum_them():
    """The ingress's /metrics text from two replicas' expositions (no Ray): valid, labelled, summed."""
    from app.cluster.metrics import merge_metrics
    from app.engine.metrics import Metrics
    from app.server.prometheus import PrometheusExporter

    texts = {}
    for replica, n_ok in (("a", 2), ("b", 3)):
        metrics = Metrics()
        metrics.outcomes["ok"] = n_ok
        texts[replica] = PrometheusExporter(metrics).render().decode()
    text = merge_metrics(texts, {"a": "ready", "b": "not_ready"})
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    ok = {s.labels["replica"]: s.value for s in fams["cosyvoice_requests"].samples if s.labels["outcome"] == "ok"}
    assert ok == {"a": 2, "b": 3}
    assert [s.value for s in fams["cosyvoice_cluster_requests"].samples if s.labels["outcome"] == "ok"] == [5]
    assert {s.labels["state"]: s.value for s in fams["cosyvoice_cluster_replicas"].samples} == {
        "ready": 1, "not_ready": 1, "unreachable": 0}
    assert not [name for name in fams if name.startswith("cosyvoice_cluster_") and name.endswith("_created")]
    if shutil.which("promtool"):  # setup_cpu.sh installs Debian's prometheus (tests/test_prometheus.py)
        check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr


def test_metrics_per_replica_and_summed(cluster, oai):
    base = cluster[0]
    _speak(oai, _ensure_voice(base))
    r = httpx.get(f"{base}/metrics", timeout=60)
    assert r.status_code == 200
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    ids = {r["id"] for r in _health(base)["replicas"]}
    ok = {s.labels["replica"]: s.value for s in fams["cosyvoice_requests"].samples
          if s.name == "cosyvoice_requests_total" and s.labels["outcome"] == "ok"}
    assert set(ok) == ids  # one series per replica
    total = [s.value for s in fams["cosyvoice_cluster_requests"].samples
             if s.name == "cosyvoice_cluster_requests_total" and s.labels["outcome"] == "ok"]
    assert total == [sum(ok.values())] and total[0] >= 1
    unfinished = [s for s in fams["cosyvoice_engine_unfinished_requests"].samples]
    assert {s.labels["replica"] for s in unfinished} == ids and all(s.value == 0 for s in unfinished)
    states = {s.labels["state"]: s.value for s in fams["cosyvoice_cluster_replicas"].samples}
    assert states == {"ready": 2, "not_ready": 0, "unreachable": 0}
    assert "cosyvoice_cluster_ttfa_seconds" in fams  # histograms summed too


def _ensure_voice(base: str) -> str:
    if httpx.get(f"{base}/v1/voices/shared", timeout=60).status_code != 200:
        assert _save(base, "shared").status_code == 201
    return "shared"


def test_a_killed_replica_breaks_its_stream_only_and_the_service_goes_on(cluster, oai):
    base, _tmp, proc = cluster
    voice = _ensure_voice(base)
    by_id = {r["id"]: r for r in _health(base)["replicas"]}
    long = {"model": "cosyvoice2", "voice": voice, "input": "Keep talking for a while.", "response_format": "pcm",
            "fixed_tokens": 1500}  # 60 s of audio: still streaming when its replica is killed
    with httpx.stream("POST", f"{base}/v1/audio/speech", json=long, timeout=300) as r:
        assert r.status_code == 200
        victim = by_id[r.headers["x-replica"]]
        pieces = r.iter_bytes()
        got = len(next(pieces))  # audio is flowing
        os.kill(victim["pid"], signal.SIGKILL)  # the replica's process (started by this test's launcher)
        with pytest.raises(httpx.HTTPError):  # the cut stream fails; it never ends as a short success
            for piece in pieces:
                got += len(piece)
    assert got < 1500 * 960 * SAMPLE_BYTES  # less than the whole answer arrived (960 samples per token)
    for _ in range(3):  # at once: the survivor takes the requests (a dead replica's are retried elsewhere)
        replica, n = _speak(oai, voice)
        assert replica != victim["id"] and n > 0
    h = _wait_ready(base, 2, RESTART_TIMEOUT_S, proc, cluster[1] / "cluster.log")  # Serve started a new one
    assert victim["id"] not in {x["id"] for x in h["replicas"]}
    replica, n = _speak(oai, voice)
    assert n > 0
    h = _no_engine_requests_left(base)
    assert h["lm_unfinished"] == 0 and h["active_streams"] == 0
