"""The Ray Serve scale-out (app/cluster/) on this machine: `python -m app.cluster` with the tiny model, real vLLM
CPU engines, real HTTP clients (the openai SDK, httpx) against Serve's HTTP proxy.

One cluster for the file (a start is 1-2 min of this 2-core box): it autoscales, `[cluster] min_replicas = 1,
max_replicas = 2, target_ongoing_requests = 1` with a 1 s upscale delay, and three long streams make Serve
start the second replica (Serve's autoscaling metrics pushed every second, its
RAY_SERVE_*_AUTOSCALING_METRIC_PUSH_INTERVAL_S, 10 s by default); a 600 s downscale delay keeps it. Then:
requests spread over both replicas; a voice saved through one is used through the other; one replica
killed (SIGKILL) mid-stream breaks that stream only, requests after it succeed, Ray starts a new
replica; no replica keeps an engine request. Skips (saying why) where Ray Serve is not installed
(requirements-ray.txt; scripts/test.sh installs it).
"""

from __future__ import annotations

import contextlib
import json
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

START_TIMEOUT_S = 900  # Ray and a replica (a model + a vLLM engine) starting on 2 shared cores
UPSCALE_TIMEOUT_S = 600  # the average ongoing count rises, Serve decides, the new replica loads its model
RESTART_TIMEOUT_S = 600  # Serve notices the dead replica and starts another one
LONG_TOKENS = 1500  # 60 s of audio per stream: still running when Serve decides to upscale
SCALING = {"cluster.min_replicas": "1", "cluster.max_replicas": "2", "cluster.target_ongoing_requests": "1",
           "cluster.upscale_delay_s": "1", "cluster.downscale_delay_s": "600"}
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


def need_ray_serve() -> None:
    """Skip without Ray Serve; scripts/test.sh installs it, so in CI a missing Ray fails (a broken setup)."""
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("Ray Serve is not installed (pip install -r requirements-ray.txt)")


def _upscale_logged(tmp: Path) -> bool:
    """Serve's controller logged its decision to go from 1 to 2 replicas (Ray's temp dir is RAY_TMPDIR/ray)."""
    logs = (tmp / "ray" / "ray").glob("session_*/logs/serve/controller_*.log")
    return any("from 1 to 2 replicas" in p.read_text(errors="replace") for p in logs)


def _scale_up(base: str, tmp: Path, proc: subprocess.Popen, log: Path) -> None:
    """Three long streams at once on the one replica until Serve starts the second, then until it is ready."""
    assert _save(base, "scale").status_code == 201
    stop = threading.Event()

    def long_stream() -> None:  # read until Serve has decided, then hang up
        body = {"model": "cosyvoice2", "voice": "scale", "input": "Keep talking for a while.",
                "response_format": "pcm", "fixed_tokens": LONG_TOKENS}
        try:
            with httpx.stream("POST", f"{base}/v1/audio/speech", json=body, timeout=600) as r:
                for _ in r.iter_bytes():
                    if stop.is_set():
                        return
        except httpx.HTTPError:
            pass  # a stream cut at teardown

    threads = [threading.Thread(target=long_stream, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    t0, deadline = time.monotonic(), time.monotonic() + UPSCALE_TIMEOUT_S
    try:
        while not _upscale_logged(tmp) and _health(base).get("replicas_ready") != 2:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(1.0)
    finally:
        # Serve decided (its target is now 2; downscale_delay_s keeps it there): the streams hang up, so the new
        # replica loads its model on cores free of three streams' compute
        stop.set()
    print(f"\nupscale decided {time.monotonic() - t0:.0f} s after 3 streams began")
    _wait_ready(base, 2, UPSCALE_TIMEOUT_S, proc, log)
    print(f"second replica ready {time.monotonic() - t0:.0f} s after 3 streams began")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[tuple[str, Path, subprocess.Popen]]:
    """(base_url, tmp, launcher process) of the file's cluster once autoscaled to 2 replicas; Ray's own files in a
    short temp dir."""
    need_ray_serve()
    tmp = Path(tempfile.mkdtemp(prefix="cluster-"))  # short: Ray's unix sockets live under RAY_TMPDIR
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if k not in ("COSYVOICE_API_KEY", "COSYVOICE_AUTH")},
           "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "RAY_TMPDIR": str(tmp / "ray"),
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
           "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1"}
    cmd = [sys.executable, "-m", "app.cluster", "--config", "configs/cpu.toml", "--model-dir", str(tiny_model_dir),
           "--host", "127.0.0.1", "--port", str(port), *_sets(tmp),
           *[arg for k, v in SCALING.items() for arg in ("--set", f"{k}={v}")]]
    log = tmp / "cluster.log"
    base = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            t0 = time.monotonic()
            _wait_ready(base, 1, START_TIMEOUT_S, proc, log)
            print(f"\n1 replica ready in {time.monotonic() - t0:.0f} s")
            _scale_up(base, tmp, proc, log)
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


@pytest.mark.slow
def test_concurrent_streams_start_a_second_replica(cluster):
    """The cluster began with 1 replica; three long streams at once (the fixture's `_scale_up`) made Serve's
    autoscaler start a second: its controller logged the 1 -> 2 decision and two distinct replicas are ready."""
    base, tmp, _proc = cluster
    assert _upscale_logged(tmp)
    h = _health(base)
    assert h["replicas_ready"] == 2 and len({r["id"] for r in h["replicas"]}) == 2


def test_a_fixed_replica_count_is_min_and_max():
    """`--replicas N` gives Serve N replicas, fixed, whatever --set says (the file's cluster autoscales 1..2)."""
    from app.cli import config_from_cli
    from app.cluster.__main__ import parse_args
    from app.cluster.deploy import replica_options

    auto = replica_options(config_from_cli(parse_args(["--replicas", "2", "--set", "cluster.max_replicas=5"])))
    scaling = auto["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["initial_replicas"], scaling["max_replicas"]) == (2, 2, 2)


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
    from app.server.prometheus import PrometheusExporter
    from app.service.metrics import Metrics

    texts = {}
    for replica, n_ok in (("a", 2), ("b", 3)):
        metrics = Metrics()
        for _ in range(n_ok):
            metrics.request_started()
            metrics.request_finished(None, 0.0)
        texts[replica] = PrometheusExporter(metrics, include_default_registry=False).render().decode()
    text = merge_metrics(texts, {"a": "ready", "b": "not_ready"})
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    ok = {s.labels["replica"]: s.value for s in fams["cosyvoice_requests"].samples if s.labels["outcome"] == "ok"}
    assert ok == {"a": 2, "b": 3}
    assert [s.value for s in fams["cosyvoice_cluster_requests"].samples if s.labels["outcome"] == "ok"] == [5]
    assert {s.labels["state"]: s.value for s in fams["cosyvoice_cluster_replicas"].samples} == {
        "ready": 1, "not_ready": 1, "unreachable": 0}
    assert not [name for name in fams if name.startswith("cosyvoice_cluster_") and name.endswith("_created")]
    if shutil.which("promtool"):  # scripts/test.sh installs Debian's prometheus (tests/test_prometheus.py)
        check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr


def test_the_proxy_keeps_the_apps_request_id_only():
    """Serve's proxy appends its X-Request-ID after the app's; app/cluster/proxy.py keeps the app's (no Ray)."""
    import asyncio

    from app.cluster.proxy import OneRequestId

    sent: list[dict] = []

    async def app(scope, receive, send):
        headers = [(b"x-request-id", b"ours"), (b"content-type", b"audio/pcm"), (b"x-request-id", b"serve")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def send(message):
        sent.append(message)

    asyncio.run(OneRequestId(app)({"type": "http"}, None, send))
    assert sent[0]["headers"] == [(b"x-request-id", b"ours"), (b"content-type", b"audio/pcm")]


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


def _ok_by_replica(base: str) -> dict[str, float]:
    """{replica id: its requests finished ok}, from the cluster's /metrics."""
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=60).text)}
    return {s.labels["replica"]: s.value for s in fams["cosyvoice_requests"].samples
            if s.name == "cosyvoice_requests_total" and s.labels["outcome"] == "ok"}


@pytest.fixture(scope="module")
def page(cluster):
    """A gradio_client of the studio page the ingress serves."""
    from gradio_client import Client

    return Client(cluster[0] + "/", verbose=False)


def _page_synth(page, **kw):
    from gradio_client import handle_file

    args = dict(text=TEXT, prompt_audio=handle_file(str(EXAMPLE_WAV)), prompt_text=EXAMPLE_TRANSCRIPT,
                mode="zero_shot", instruct_text="", voice="", seed=1, speed=1.0, stream=True)
    return page.submit(**{**args, **kw}, api_name="/synthesize")


def test_the_page_synthesizes_on_the_replicas_with_its_stats(cluster, page):
    """The page's `synthesize` (2 at once) runs on the replicas: audio, the stats line and details as under
    `python app.py`, each request counted by the replica that made it, and the requests spread."""
    base = cluster[0]
    before, n_sent, grew = _ok_by_replica(base), 0, set()
    for _ in range(3):  # rounds of 2 at once: Serve sends each to the less busy replica
        jobs = [_page_synth(page, seed=i) for i in range(2)]
        for job in jobs:
            _live, wav, line, details = job.result(timeout=300)
            assert Path(wav).stat().st_size > 44 and details["audio_samples"] > 0, details
            assert "TTFA" in line and "RTF" in line and f"seed {details['seed']}" in line, line
            assert len(details["request_id"]) == 32 and details["mode"] == "zero_shot"
        n_sent += len(jobs)
        after = _ok_by_replica(base)
        grew = {r for r, n in after.items() if n > before.get(r, 0)}
        if len(grew) == 2:
            break
    assert sum(after.values()) - sum(before.values()) == n_sent  # every page request ran on a replica
    assert len(grew) == 2, f"every page request went to one replica: {before} -> {after}"
    _no_engine_requests_left(base)


def test_a_voice_saved_through_the_page_is_used_through_v1(cluster, page, oai):
    from gradio_client import handle_file

    msg, name = page.predict(name="page-voice", prompt_audio=handle_file(str(EXAMPLE_WAV)),
                             prompt_text=EXAMPLE_TRANSCRIPT, overwrite=True, api_name="/save_voice")
    assert name == "page-voice" and "Saved voice" in msg, msg
    listed = page.predict(api_name="/list_voices")  # a list of voice dicts
    assert "page-voice" in {v["name"] for v in listed}
    for _ in range(2):  # through /v1, whichever replica takes it
        _replica, n = _speak(oai, "page-voice")
        assert n > 0 and n % SAMPLE_BYTES == 0
    _live, _wav, line, details = _page_synth(page, voice="page-voice", prompt_audio=None, prompt_text="").result(
        timeout=300)  # and through the page by name
    assert details["voice"] == "page-voice" and "TTFA" in line


def test_a_replicas_refusal_reaches_the_page_as_its_message(cluster, page, tmp_path):
    """A reference that is not audio is refused on the replica (its features); the page gets the replica's
    message, not Ray's wrapper with the replica's traceback."""
    from gradio_client import handle_file
    from gradio_client.exceptions import AppError

    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"this is not audio" * 64)
    with pytest.raises(AppError) as e:
        _page_synth(page, prompt_audio=handle_file(str(bad)), seed=3).result(timeout=300)
    message = str(e.value)  # the clip went to the replica as its bytes, so it is "the upload"
    assert message.startswith("the upload: not a readable audio file"), message
    assert "Traceback" not in message and "Ray" not in message, message


def test_the_low_latency_players_routes_on_the_cluster(cluster):
    """POST /studio/speech streams PCM made on a replica (its record, the page's stats line: the browser test);
    the take's timings route says once that the cluster's page makes no word timings."""
    base = cluster[0]
    body = {"text": TEXT, "prompt_audio": str(EXAMPLE_WAV), "prompt_text": EXAMPLE_TRANSCRIPT, "seed": 2}
    with httpx.stream("POST", f"{base}/studio/speech", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        n = sum(len(piece) for piece in r.iter_bytes())
        request_id = r.headers["x-request-id"]
    assert n > 0 and n % SAMPLE_BYTES == 0 and len(request_id) == 32
    got = httpx.get(f"{base}/studio/requests/{request_id}/timings", timeout=60)
    note, done = (json.loads(line) for line in got.text.splitlines())
    assert got.status_code == 200 and note["words"] == [] and "on a cluster" in note["note"], got.text
    assert done == {"type": "done", "srt": "", "vtt": "WEBVTT\n\n"}, got.text


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


@pytest.mark.slow
def test_the_page_in_a_browser_plays_a_take_made_on_a_replica(cluster):
    """Headless Chromium on the cluster's page (as tests/test_browser.py: without its stack skipped, in CI failed): the
    status and the panels name the replicas; Generate with the low-latency player (its upload -> POST
    /studio/speech -> its take event, which reads the record the replica sent back) shows the take's stats line."""
    import importlib.util

    from test_browser import CHROMIUM, CHROMIUM_ARGS, _need

    _need(Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing")
    _need(importlib.util.find_spec("playwright") is not None, "the playwright package is missing")
    from playwright import sync_api

    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(cluster[0] + "/")
            page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('ready')",
                                   timeout=60_000)
            page.wait_for_function("() => document.querySelector('#panel_headline')?.innerText"
                                   ".includes('ready on 2 of 2 replicas')", timeout=60_000)
            page.locator("#prompt_audio input[type=file]").set_input_files(str(EXAMPLE_WAV))
            page.wait_for_selector("#prompt_audio audio, #prompt_audio [data-testid='waveform-prompt_audio']",
                                   state="attached", timeout=30_000)
            page.locator("#prompt_text textarea").fill(EXAMPLE_TRANSCRIPT)
            page.locator("#text textarea").fill(TEXT)
            page.locator("#go").click()  # the default player: the page's low-latency one
            page.wait_for_function("() => document.querySelector('#stats')?.innerText.includes('TTFA')",
                                   timeout=300_000)
        finally:
            browser.close()
