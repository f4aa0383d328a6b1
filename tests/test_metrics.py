"""Metrics: request ring buffer and percentiles, memory samples without a GPU, vLLM's KV-cache gauge.

The last test starts the real (CPU) vLLM engine on the tiny model once and reads the KV-cache
gauge and the engine process while a fixed-length request runs.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from app.engine.requests import RequestStats
from app.service import resources as metrics_mod
from app.service.metrics import OUTCOMES, Metrics
from app.service.resources import NO_GPU_NOTE, vllm_gauges


def stats(i: int, **kw) -> RequestStats:
    base = dict(ttfa_ms=100.0 + i, wall_s=2.0, audio_s=4.0, n_tokens=100, n_segments=1, n_chunks=3, lm_s=1.0,
                flow_s=0.5, hift_s=0.25)
    return RequestStats(**{**base, **kw})


def test_requests_ring_buffer_counters_and_percentiles():
    m = Metrics(max_requests=5)
    for i in range(8):
        m.request_started()
        assert m.active_streams == 1
        m.request_finished(stats(i), queue_wait_s=0.01 * i)
    m.request_started()
    m.request_finished(None, 0.2, "cancelled")  # ended before its final chunk: no timings
    m.request_finished(None, 0.0, "rejected")  # never started: active streams stay at 0
    assert m.active_streams == 0
    recent = m.recent()
    assert len(recent) == 5  # bounded
    assert [r["seq"] for r in recent] == [6, 7, 8, 9, 10]
    assert recent[-1]["outcome"] == "rejected" and recent[-1]["ttfa_ms"] is None and recent[-2]["lm_s"] is None
    assert recent[0]["rtf"] == 0.5 and recent[0]["vocoder_s"] == 0.25 and recent[0]["tokens_per_s"] == 50.0
    assert [r["seq"] for r in m.recent(2)] == [9, 10]
    c = m.counters()
    assert c["started"] == 9 and c["outcomes"] == {"ok": 8, "cancelled": 1, "error": 0, "rejected": 1}
    assert c["audio_s_total"] == 32.0 and c["tokens_total"] == 800
    # percentiles over the kept requests that have the value (ttfa 105, 106, 107)
    p = m.percentiles("ttfa_ms")
    assert p == {"p50": 106.0, "p95": pytest.approx(np.percentile([105, 106, 107], 95))}
    assert m.percentiles("queue_wait_s", qs=(0, 100)) == {"p0": 0.0, "p100": 0.2}
    assert Metrics().percentiles("rtf") == {"p50": None, "p95": None}
    with pytest.raises(ValueError, match="key must be one of"):
        m.percentiles("user_text")
    with pytest.raises(ValueError, match="outcome must be one of"):
        m.request_finished(None, 0.0, "weird")
    assert set(OUTCOMES) == set(c["outcomes"])


def test_infinite_rtf_is_kept_out():
    m = Metrics()
    m.request_started()
    m.request_finished(stats(0, audio_s=0.0), 0.0)  # no audio: rtf would be inf
    assert m.recent()[0]["rtf"] is None and m.percentiles("rtf")["p50"] is None


def test_cpu_snapshot_shape_history_bounded_and_shared():
    m = Metrics(max_samples=3, min_sample_interval_s=0.0)
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    try:
        first = m.memory_snapshot()
        time.sleep(0.6)
        snap = m.memory_snapshot()
    finally:
        busy.kill()
        busy.wait()
    if snap["gpu"]:
        pytest.skip("this machine has a GPU; the CPU fallback shape is checked on CPU machines")
    assert snap["note"] == NO_GPU_NOTE and snap["device"] is None and snap["torch"] is None
    assert snap["kv_cache_usage"] is None and snap["kv_cache_tokens"] is None  # no backend given
    assert set(snap["cpu"]) == {"n_cpus", "percent", "rss_mib", "ram_used_mib", "ram_total_mib"}
    procs = {p["pid"]: p for p in snap["processes"]}
    assert snap["processes"][0]["pid"] == os.getpid() and procs[os.getpid()]["role"] == "app"
    child = procs[busy.pid]
    assert child["role"] == "other" and child["gpu_mib"] is None and child["rss_mib"] > 0
    # a spinning child over 0.6 s (first sample: no previous times) got some CPU however loaded the box is
    assert child["cpu_percent"] > 0
    assert 0 < snap["cpu"]["rss_mib"] < snap["cpu"]["ram_total_mib"]
    assert snap["cpu"]["percent"] >= child["cpu_percent"]
    assert first["processes"][0]["cpu_percent"] == 0.0
    for _ in range(4):
        m.memory_snapshot()
    assert len(m.memory_history()) == 3 and len(m.memory_history(2)) == 2  # bounded
    shared = Metrics(min_sample_interval_s=60.0)
    assert shared.memory_snapshot() is shared.memory_snapshot()  # two panel ticks at once: one sample
    assert len(shared.memory_history()) == 1


def test_process_tree_sees_this_process_and_its_children():
    """RSS and CPU time of the app process and of a child (the vLLM engine is one), by role."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        tree = metrics_mod._process_tree(os.getpid())
        assert os.getpid() in tree and child.pid in tree
        _, rss, cpu_s = tree[os.getpid()]
        assert rss > 10 * 2**20 and cpu_s > 0  # this interpreter with torch loaded
        assert tree[child.pid][1] > 0
    finally:
        child.kill()
        child.wait()
    assert metrics_mod._process_tree(2**22 + 12345) == {}  # no such process: nothing, no error
    used, total = metrics_mod._system_ram()
    assert 0 < used < total
    assert metrics_mod._role(1, 2, "VLLM::EngineCore") == "vLLM engine" and metrics_mod._role(2, 2, "x") == "app"


def test_vllm_gauges_from_a_registry():
    """The gauges as vLLM's PrometheusStatLogger registers them (labels model_name, engine)."""
    prom = pytest.importorskip("prometheus_client")
    reg = prom.CollectorRegistry()
    kv = prom.Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    labelnames=["model_name", "engine"], registry=reg)
    running = prom.Gauge("vllm:num_requests_running", "running", labelnames=["model_name", "engine"], registry=reg)
    assert vllm_gauges(reg) == {}  # labelled gauges have no sample before the first record
    kv.labels(model_name="m", engine="0").set(0.25)
    kv.labels(model_name="m", engine="1").set(0.75)
    running.labels(model_name="m", engine="0").set(3)
    assert vllm_gauges(reg) == {"kv_cache_usage": 0.5, "engine_running": 3.0}
    old = prom.CollectorRegistry()  # the name before vLLM 0.10
    prom.Gauge("vllm:gpu_cache_usage_perc", "old", registry=old).set(0.1)
    assert vllm_gauges(old) == {"kv_cache_usage": pytest.approx(0.1)}
    assert metrics_mod.kv_cache_tokens(None) is None


def test_gpu_snapshot_with_a_fake_nvml(monkeypatch):
    """The NVML branch on a CPU machine: device totals, pids named by role, MiB; the panel's series."""
    from types import SimpleNamespace

    gib = 1024**3
    # a child titled as vLLM titles its engine process (argv[0], as setproctitle leaves it)
    engine = subprocess.Popen(["VLLM::EngineCore", "-c", "import time; time.sleep(30)"], executable=sys.executable)
    try:
        time.sleep(0.2)
        procs = [SimpleNamespace(pid=os.getpid(), usedGpuMemory=gib), SimpleNamespace(pid=engine.pid,
                 usedGpuMemory=10 * gib), SimpleNamespace(pid=4_000_000, usedGpuMemory=None)]
        fake = SimpleNamespace(
            NVMLError=RuntimeError, nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: f"h{i}",
            nvmlDeviceGetHandleByUUID=lambda u: u, nvmlDeviceGetName=lambda h: b"NVIDIA H200",
            nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=20 * gib, total=140 * gib),
            nvmlDeviceGetComputeRunningProcesses=lambda h: procs)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
        # the real tree walk, limited to this process and its fake engine: servers and browsers that earlier
        # tests of the session started are children of this process too, and would add an "other" series
        tree = metrics_mod._process_tree
        monkeypatch.setattr(metrics_mod, "_process_tree", lambda root: {
            pid: info for pid, info in tree(root).items() if pid in (os.getpid(), engine.pid)})
        snap = Metrics().memory_snapshot()
    finally:
        engine.kill()
        engine.wait()
    assert snap["gpu"] and snap["note"] == ""
    assert snap["device"] == {"index": 3, "name": "NVIDIA H200", "used_mib": 20 * 1024, "total_mib": 140 * 1024}
    by_pid = {p["pid"]: p for p in snap["processes"]}
    assert by_pid[os.getpid()]["role"] == "app" and by_pid[os.getpid()]["gpu_mib"] == 1024
    assert by_pid[engine.pid]["role"] == "vLLM engine" and by_pid[engine.pid]["gpu_mib"] == 10 * 1024
    assert by_pid[4_000_000] == {"pid": 4_000_000, "role": "other", "gpu_mib": 0.0, "rss_mib": None,
                                 "cpu_percent": None}  # another container's process: no RSS here
    from app.ui.panels import memory_frames

    mem, load = memory_frames([snap], now=snap["t"] + 2)
    series = dict(zip(mem["series"], mem["MiB"], strict=True))
    assert series == {"device used": 20 * 1024, "device total": 140 * 1024, "app (NVML)": 1024,
                      "vLLM engine (NVML)": 10 * 1024}
    assert (mem["seconds"] == -2).all()
    assert set(load["series"]) == {"app CPU", "vLLM engine CPU"}  # no KV gauge without a vLLM backend


# --- the real engine -----------------------------------------------------------------------------


@pytest.mark.slow
def test_kv_cache_and_engine_process_with_the_real_engine(tiny_model_dir, tmp_path):
    pytest.importorskip("vllm")
    from app.config import load_config
    from app.engine.lm_backend import LMRequest
    from app.engine.vllm_backend import VLLMBackend

    n_cpu = os.cpu_count() or 1
    cfg = load_config(overrides={"vllm.dtype": "float32", "vllm.enforce_eager": True, "vllm.max_num_seqs": 4,
                                 "vllm.export_cache_dir": str(tmp_path), "vllm.cpu_kvcache_space_gib": 1,
                                 "vllm.cpu_omp_threads_bind": f"0-{n_cpu - 1}", "vllm.cpu_num_reserved_cpus": 0})
    m = Metrics(min_sample_interval_s=0.0)

    async def run() -> tuple[dict, dict, dict, int]:
        backend = await VLLMBackend.start(cfg, tiny_model_dir)
        try:
            g = torch.Generator().manual_seed(0)
            prompt = tuple(torch.randint(0, 6561, (300,), generator=g).tolist())
            req = LMRequest(request_id="kv", prompt_ids=prompt, min_tokens=0,
                            max_tokens=400, seed=1, sampling=cfg.sampling, ignore_eos=True)
            during, n = None, 0
            async for ids in backend.stream(req):
                n += len(ids)
                if during is None and n >= 50:
                    during = m.memory_snapshot(backend)
            after = m.memory_snapshot(backend)
            return during, after, backend.facts(), backend.n_unfinished()
        finally:
            await backend.aclose()

    during, after, facts, n_unfinished = asyncio.run(run())
    assert during is not None and n_unfinished == 0
    print(f"\nKV during {during['kv_cache_usage']}, after {after['kv_cache_usage']}; running {during['engine_running']}"
          f"; capacity {during['kv_cache_tokens']} tokens; block {facts['block_size']}")
    assert 0 < during["kv_cache_usage"] <= 1 and during["engine_running"] == 1
    # a 300-row prompt + >= 50 tokens fills at least that many positions of the cache
    assert during["kv_cache_usage"] * during["kv_cache_tokens"] >= 350 - facts["block_size"]
    assert during["kv_cache_tokens"] % facts["block_size"] == 0
    assert after["engine_running"] == 0
    roles = {p["role"] for p in during["processes"]}
    engine = [p for p in during["processes"] if p["role"] == "vLLM engine"]
    assert roles >= {"app", "vLLM engine"} and engine[0]["rss_mib"] > 50, during["processes"]
