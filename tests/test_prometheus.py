"""GET /metrics: the exporter over synthetic requests (parsed with prometheus_client's own parser),
then end to end: `python app.py` (tiny model, real vLLM CPU engine), one synthesis through the /v1
API, and the scrape before and after it; the Grafana dashboard (deploy/grafana) asks only for
series that scrape has.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.engine.requests import RequestStats
from app.server.prometheus import PrometheusExporter
from app.service.metrics import RTF_BUCKETS, STAGE_BUCKETS_S, TTFA_BUCKETS_S, Metrics

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = json.loads((REPO / "assets" / "examples.json").read_text(encoding="utf-8"))
EN_WAV, EN_TRANSCRIPT = REPO / "assets" / "prompt_en.wav", EXAMPLES["voices"][0]["transcript"]
DASHBOARD = REPO / "deploy" / "grafana" / "cosyvoice-studio.json"
# exposed only where NVML sees a GPU (absent beats NaN); test_gpu_and_service_gauges shows them with a fake NVML
GPU_ONLY = {"cosyvoice_gpu_memory_used_bytes", "cosyvoice_gpu_memory_total_bytes"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
TEXT = "Hello there."
GIB = 1024**3


def stats(ttfa_ms: float, **kw) -> RequestStats:
    base = dict(ttfa_ms=ttfa_ms, wall_s=2.0, audio_s=4.0, n_tokens=100, n_segments=1, n_chunks=3, lm_s=1.0,
                flow_s=0.5, hift_s=0.25)
    return RequestStats(**{**base, **kw})


def parse(text: str) -> tuple[dict[str, str], dict[tuple[str, frozenset], float]]:
    """({family: type}, {(sample name, labels): value}); fails on a family seen twice."""
    types, samples = {}, {}
    for family in text_string_to_metric_families(text):
        assert family.name not in types, f"family {family.name} twice"
        types[family.name] = family.type
        for s in family.samples:
            samples[s.name, frozenset(s.labels.items())] = s.value
    return types, samples


def value(samples: dict, name: str, /, **labels: str) -> float:
    return samples[name, frozenset(labels.items())]


def buckets(samples: dict, name: str, /, **labels: str) -> dict[float, float]:
    """{upper bound: cumulative count} of one histogram series."""
    out = {}
    for (sample, labs), v in samples.items():
        d = dict(labs)
        if sample == f"{name}_bucket" and all(d.get(k) == x for k, x in labels.items()):
            out[float(d["le"])] = v
    return out


# --- the exporter on its own -------------------------------------------------------------------------


def test_exporter_counts_and_buckets_from_synthetic_requests():
    m = Metrics(min_sample_interval_s=0.0)
    exporter = PrometheusExporter(m, include_default_registry=False)
    _, empty = parse(exporter.render().decode())
    assert value(empty, "cosyvoice_ttfa_seconds_count") == 0 and value(empty, "cosyvoice_requests_total",
                                                                         outcome="rejected") == 0
    assert value(empty, "cosyvoice_stage_seconds_count", stage="vocoder") == 0  # every stage from the start
    # ttfa 5 ms, 120 ms, 40 s (past the last bucket); the last has no audio, so no RTF
    for ttfa_ms, kw in ((5.0, {}), (120.0, {"wall_s": 8.0}), (40_000.0, {"audio_s": 0.0})):
        m.request_started()
        m.request_finished(stats(ttfa_ms, **kw), queue_wait_s=0.3)
    m.request_started()
    m.request_finished(None, 0.02, "cancelled")  # before its first chunk: queue wait only
    m.request_finished(None, 0.0, "rejected")  # never ran: no queue sample
    m.request_started()  # still running
    types, s = parse(exporter.render().decode())

    assert types["cosyvoice_requests"] == "counter" and types["cosyvoice_ttfa_seconds"] == "histogram"
    assert types["cosyvoice_active_streams"] == "gauge" and types["cosyvoice_stage_seconds"] == "histogram"
    assert {o: value(s, "cosyvoice_requests_total", outcome=o) for o in ("ok", "cancelled", "error", "rejected")} \
        == {"ok": 3, "cancelled": 1, "error": 0, "rejected": 1}
    assert value(s, "cosyvoice_active_streams") == 1
    assert value(s, "cosyvoice_audio_seconds_total") == 8.0  # the ok requests' audio
    assert value(s, "cosyvoice_lm_tokens_total") == 300
    ttfa = buckets(s, "cosyvoice_ttfa_seconds")
    assert sorted(ttfa) == [*TTFA_BUCKETS_S, math.inf]
    assert (ttfa[0.01], ttfa[0.1], ttfa[0.15], ttfa[30.0], ttfa[math.inf]) == (1, 1, 2, 2, 3)
    assert value(s, "cosyvoice_ttfa_seconds_count") == 3
    assert value(s, "cosyvoice_ttfa_seconds_sum") == pytest.approx(40.125)
    rtf = buckets(s, "cosyvoice_rtf")  # 0.5 and 2.0
    assert sorted(rtf) == [*RTF_BUCKETS, math.inf] and (rtf[0.3], rtf[0.5], rtf[1.5], rtf[2.0]) == (0, 1, 1, 2)
    assert value(s, "cosyvoice_rtf_count") == 2
    queue = buckets(s, "cosyvoice_stage_seconds", stage="queue")  # 0.3 x3, 0.02
    assert sorted(queue) == [*STAGE_BUCKETS_S, math.inf] and (queue[0.025], queue[0.5]) == (1, 4)
    for stage, seconds in (("lm", 3.0), ("flow", 1.5), ("vocoder", 0.75)):
        assert value(s, "cosyvoice_stage_seconds_count", stage=stage) == 3
        assert value(s, "cosyvoice_stage_seconds_sum", stage=stage) == pytest.approx(seconds)
    # no service: no service gauges; memory of this process from the snapshot; nothing NaN
    assert "cosyvoice_ready" not in types and "cosyvoice_info" not in types
    assert "cosyvoice_kv_cache_usage_ratio" not in types  # no vLLM backend
    assert value(s, "cosyvoice_process_memory_bytes", role="app", kind="rss") > 10 * 1024**2
    assert not any(math.isnan(v) for v in s.values())
    if not m.memory_snapshot()["gpu"]:
        assert "cosyvoice_gpu_memory_used_bytes" not in types  # omitted, not NaN


def test_health_panels_and_metrics_read_one_source():
    """`counters()` (/health, the panels) reads the registry /metrics renders; each `Metrics` (one per service)
    has its own, so two in one process neither collide nor share a count."""
    m, other = Metrics(), Metrics()
    for outcome, s in (("ok", stats(10.0)), ("error", None), ("ok", stats(20.0, audio_s=1.5))):
        m.request_started()
        m.request_finished(s, 0.0, outcome)
    m.request_finished(None, 0.0, "rejected")
    m.request_started()  # still running
    m.input_refused("invalid_value")
    m.share_refused("rate_limit")
    other.request_started()
    other.request_finished(stats(10.0), 0.0)
    c = m.counters()
    assert c == {"started": 4, "active_streams": 1, "outcomes": {"ok": 2, "cancelled": 0, "error": 1, "rejected": 1},
                 "refused_inputs": {"invalid_value": 1}, "refused_share": {"rate_limit": 1}, "audio_s_total": 5.5,
                 "tokens_total": 200}
    _, s = parse(PrometheusExporter(m, include_default_registry=False).render().decode())
    assert {o: value(s, "cosyvoice_requests_total", outcome=o) for o in c["outcomes"]} == c["outcomes"]
    assert value(s, "cosyvoice_active_streams") == c["active_streams"] == m.active_streams
    assert value(s, "cosyvoice_refused_inputs_total", reason="invalid_value") == 1
    assert value(s, "cosyvoice_refused_share_total", reason="rate_limit") == 1
    assert value(s, "cosyvoice_refused_share_total", reason="uploads") == 0
    assert value(s, "cosyvoice_audio_seconds_total") == c["audio_s_total"]
    assert value(s, "cosyvoice_lm_tokens_total") == c["tokens_total"]
    assert other.counters()["outcomes"]["ok"] == 1 and other.active_streams == 0


def test_default_registry_appended_without_collisions():
    """vLLM's metrics live in prometheus_client's default REGISTRY; ours never clash with it."""
    import prometheus_client as prom

    clash = prom.Gauge("cosyvoice_active_streams", "someone else's", registry=prom.REGISTRY)
    vllm_like = prom.Gauge("vllm:test_kv_cache_usage_perc", "KV", labelnames=["model_name", "engine"],
                           registry=prom.REGISTRY)
    try:
        clash.set(42)
        vllm_like.labels(model_name="m", engine="0").set(0.25)
        types, s = parse(PrometheusExporter(Metrics()).render().decode())
    finally:
        prom.REGISTRY.unregister(clash)
        prom.REGISTRY.unregister(vllm_like)
    assert value(s, "cosyvoice_active_streams") == 0  # ours, not the default registry's
    assert value(s, "vllm:test_kv_cache_usage_perc", model_name="m", engine="0") == 0.25
    assert "process_resident_memory_bytes" in types or sys.platform != "linux"


def test_gpu_and_service_gauges(monkeypatch, tmp_path):
    """GPU gauges from a fake NVML (in bytes, by device); the service's readiness and info before start."""
    from app.config import load_config
    from app.service.service import StudioService

    child = subprocess.Popen(["VLLM::EngineCore", "-c", "import time; time.sleep(30)"], executable=sys.executable)
    try:
        time.sleep(0.2)
        procs = [SimpleNamespace(pid=os.getpid(), usedGpuMemory=GIB),
                 SimpleNamespace(pid=child.pid, usedGpuMemory=10 * GIB)]
        fake = SimpleNamespace(
            NVMLError=RuntimeError, nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: f"h{i}",
            nvmlDeviceGetHandleByUUID=lambda u: u, nvmlDeviceGetName=lambda h: b"NVIDIA H200",
            nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=20 * GIB, total=140 * GIB),
            nvmlDeviceGetComputeRunningProcesses=lambda h: procs)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
        service = StudioService(load_config(None, {"server.voices_dir": str(tmp_path / "v"),
                                                   "model.dir": str(tmp_path / "missing")}))
        types, s = parse(PrometheusExporter(service.metrics, service, include_default_registry=False)
                         .render().decode())
    finally:
        child.kill()
        child.wait()
    dev = {"device": "1", "name": "NVIDIA H200"}
    assert value(s, "cosyvoice_gpu_memory_used_bytes", **dev) == 20 * GIB
    assert value(s, "cosyvoice_gpu_memory_total_bytes", **dev) == 140 * GIB
    assert value(s, "cosyvoice_process_memory_bytes", role="app", kind="gpu") == GIB
    assert value(s, "cosyvoice_process_memory_bytes", role="vllm_engine", kind="gpu") == 10 * GIB
    assert value(s, "cosyvoice_process_memory_bytes", role="vllm_engine", kind="rss") > 0
    assert value(s, "cosyvoice_ready") == 0 and value(s, "cosyvoice_queue_depth", queue="http") == 0
    assert "cosyvoice_engine_unfinished_requests" not in types  # no backend yet
    info = [dict(labs) for (name, labs) in s if name == "cosyvoice_info"]
    assert info == [{"backend": "none", "device": service.cfg.model.device, "dtype": service.cfg.model.llm_dtype,
                     "quantization": "none"}]


# --- the real server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(studio_cpu):
    """The shared `python app.py` on cpu.toml (conftest.py's studio_cpu)."""
    return studio_cpu[0]


def scrape(base: str) -> tuple[str, dict[str, str], dict]:
    r = httpx.get(f"{base}/metrics", timeout=30, follow_redirects=False)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.headers
    types, samples = parse(r.text)
    return r.text, types, samples


def test_metrics_move_after_one_synthesis(server):
    _, types0, before = scrape(server)
    with EN_WAV.open("rb") as f:
        r = httpx.post(f"{server}/v1/voices", files={"audio": ("prompt_en.wav", f, "audio/wav")},
                       data={"transcript": EN_TRANSCRIPT}, timeout=120)
    assert r.status_code in (200, 201), r.text  # 201 Created
    voice_id = r.json()["id"]
    r = httpx.post(f"{server}/v1/audio/speech", json={"model": "cosyvoice2", "input": TEXT, "voice": voice_id,
                                                      "response_format": "pcm"}, timeout=300)
    assert r.status_code == 200 and len(r.content) > 0, r.text
    text, types, after = scrape(server)

    def delta(name: str, /, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("cosyvoice_requests_total", outcome="ok") == 1
    assert delta("cosyvoice_ttfa_seconds_count") == 1 and delta("cosyvoice_rtf_count") == 1
    assert delta("cosyvoice_stage_seconds_count", stage="lm") == 1
    assert delta("cosyvoice_stage_seconds_count", stage="queue") == 1
    assert delta("cosyvoice_audio_seconds_total") == pytest.approx(len(r.content) / 2 / 24_000, rel=1e-3)
    assert delta("cosyvoice_lm_tokens_total") > 0
    assert value(after, "cosyvoice_active_streams") == 0
    assert value(after, "cosyvoice_ready") == 1
    assert value(after, "cosyvoice_engine_unfinished_requests") == 0
    assert value(after, "cosyvoice_queue_depth", queue="http") == 0
    assert value(after, "cosyvoice_queue_depth", queue="engine") == 0
    assert 0 <= value(after, "cosyvoice_kv_cache_usage_ratio") <= 1
    assert value(after, "cosyvoice_kv_cache_capacity_tokens") > 0
    assert value(after, "cosyvoice_process_memory_bytes", role="vllm_engine", kind="rss") > 0
    info = [dict(labs) for (name, labs) in after if name == "cosyvoice_info"]
    assert len(info) == 1 and info[0]["backend"] == "vllm" and info[0]["dtype"] == "float32", info
    vllm_families = {n for n in types if n.startswith("vllm:")}
    assert {"vllm:kv_cache_usage_perc", "vllm:num_requests_waiting"} <= vllm_families, sorted(vllm_families)
    assert "vllm:kv_cache_usage_perc" in types0  # vLLM's metrics are there from the start
    # numbers and fixed labels only: neither the text, the transcript nor the voice's name leak
    for secret in (TEXT, "Hello there", EN_TRANSCRIPT, "quick brown fox", voice_id):
        assert secret not in text, secret
    print("\n" + "\n".join(line for line in text.splitlines() if line.startswith("cosyvoice_") and "_bucket" not in
                           line and "_created" not in line))


# --- the Grafana dashboard -----------------------------------------------------------------------


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and the variables' label_values()."""
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (label values, matchers, ranges, groupings, functions and
    Grafana's $variables left out); label_values(metric, label) names its metric."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"label_values\(\s*([^,{)]+)[^)]*\)", r"\1", e)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    e = re.sub(r"\$\{?\w+\}?", "", e)
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", e):
        if not e[m.end():].lstrip().startswith("(") and m.group() not in PROMQL_WORDS:
            names.add(m.group())
    return names


def test_refused_inputs_are_counted_by_reason(server):
    """Inputs refused with a message (here: empty text, an unknown voice) count in /metrics by reason."""
    _, _, before = scrape(server)
    for body in ({"input": "  ", "voice": "nobody"}, {"input": "Hello there.", "voice": "nobody-at-all"}):
        r = httpx.post(f"{server}/v1/audio/speech", json={"model": "cosyvoice2", **body}, timeout=60)
        assert r.status_code == 400, r.text
    _, types, after = scrape(server)
    assert types["cosyvoice_refused_inputs"] == "counter"

    def count(reason: str, samples: dict) -> float:
        return samples.get(("cosyvoice_refused_inputs_total", frozenset({("reason", reason)})), 0.0)

    assert count("invalid_value", after) - count("invalid_value", before) == 1  # the empty text
    assert count("voice_not_found", after) - count("voice_not_found", before) == 1


def test_promql_metric_names():
    q = 'histogram_quantile(0.95, sum by (le, stage) (rate(cosyvoice_stage_seconds_bucket{job=~"$job", le="1.0"}[5m])))'
    assert promql_metric_names(q) == {"cosyvoice_stage_seconds_bucket"}
    assert promql_metric_names("1 - sum(rate(a_total[$__rate_interval])) / on(x) b * 1e3") == {"a_total", "b"}
    assert promql_metric_names('label_values(cosyvoice_ready{job=~"$job"}, instance)') == {"cosyvoice_ready"}


def test_dashboard_names_only_series_metrics_exposes(server):
    """Every query of deploy/grafana/cosyvoice-studio.json names only sample names the real /metrics has
    (after a synthesis; vLLM's vllm:* included), and the dashboard covers what it is for."""
    text, _, _ = scrape(server)
    exposed = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    used = set().union(*(promql_metric_names(q) for q in dashboard_queries()))
    missing = used - exposed
    assert missing <= GPU_ONLY, f"the dashboard asks for series /metrics does not have: {sorted(missing - GPU_ONLY)}"
    assert {"cosyvoice_ttfa_seconds_bucket", "cosyvoice_rtf_bucket", "cosyvoice_stage_seconds_bucket",
            "cosyvoice_stage_seconds_sum", "cosyvoice_requests_total", "cosyvoice_active_streams",
            "cosyvoice_queue_depth", "cosyvoice_process_memory_bytes", "cosyvoice_kv_cache_usage_ratio",
            "cosyvoice_gpu_memory_used_bytes", "vllm:kv_cache_usage_perc", "vllm:num_requests_waiting",
            "vllm:time_to_first_token_seconds_bucket"} <= used
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in board["panels"])
    for p in board["panels"]:
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}" and t["refId"], (p["title"], t)
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "job", "instance"}
    print(f"\ndashboard: {len(board['panels'])} panels, {len(dashboard_queries())} queries, {len(used)} series names")


def test_dashboard_promql_parses(tmp_path):
    """Prometheus' own parser (promtool, from Debian's prometheus package; PROMTOOL names another) accepts
    every query once Grafana's variables are filled in, and the scrape example (deploy/prometheus.yml)."""
    promtool = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if not promtool:
        pytest.skip("promtool not found (Debian's prometheus package, or PROMTOOL=/path/to/promtool)")
    rules = [{"record": f"dashboard:query_{i}", "expr": q.replace("$__rate_interval", "1m").replace("$job", ".*")
              .replace("$instance", ".*")} for i, q in enumerate(dashboard_queries()) if "label_values" not in q]
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))  # JSON is YAML
    for args in (["check", "rules", str(path)], ["check", "config", str(REPO / "deploy" / "prometheus.yml")]):
        r = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
