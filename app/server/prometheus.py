"""GET /metrics: Prometheus text exposition of the studio plus vLLM's own `vllm:*` metrics.

Design notes: docs/design.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from app.engine.metrics import OUTCOMES, Metrics, RequestRecord
from app.engine.resources import MIB
from app.server.identity import caller_of

if TYPE_CHECKING:
    from app.engine.service import StudioService

PREFIX = "cosyvoice_"
# Time to first audio, seconds: 10 ms (GPU, batch 1, warm) to 30 s (a 2-core CPU behind a queue).
TTFA_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0,
                  30.0)
# Real-time factor = wall seconds / audio seconds: 0.01 (100x faster than real time) to 10; 1.0 is an edge.
RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
# Seconds one request spent in a stage (summed over its segments/hops): 5 ms to 2 min.
STAGE_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STAGES = ("lm", "flow", "vocoder", "queue")
SHARE_REASONS = ("rate_limit", "client_streams", "uploads")  # app/server/limits.py, app/engine/fair_share.py


class PrometheusExporter:
    """The /metrics text for one `Metrics` (and its `StudioService`, when given); a prometheus_client collector."""

    def __init__(self, metrics: Metrics, service: StudioService | None = None, *,
                 include_default_registry: bool = True) -> None:
        self.metrics = metrics
        self.service = service
        self.include_default_registry = include_default_registry
        self.registry = CollectorRegistry()
        self.ttfa = Histogram("cosyvoice_ttfa_seconds", "Time from a request's start (after its queue wait) to "
                              "its first audio chunk, seconds.", buckets=TTFA_BUCKETS_S, registry=self.registry)
        self.rtf = Histogram("cosyvoice_rtf", "Real-time factor of finished requests: wall seconds / audio "
                             "seconds (below 1 = faster than real time).", buckets=RTF_BUCKETS, registry=self.registry)
        self.stage = Histogram("cosyvoice_stage_seconds", "Seconds one request spent per stage: lm (waiting on "
                               "the LM stream), flow, vocoder (HiFT), queue (waiting for a slot).",
                               labelnames=["stage"], buckets=STAGE_BUCKETS_S, registry=self.registry)
        for stage in STAGES:  # every stage has a series (count 0) from the first scrape on
            self.stage.labels(stage=stage)
        metrics.add_listener(self.observe)

    def observe(self, rec: RequestRecord) -> None:
        """Feed the histograms with one finished request (a `Metrics` listener)."""
        if rec.outcome != "rejected":  # a rejected request never waited for a slot
            self.stage.labels(stage="queue").observe(rec.queue_wait_s)
        t = rec.timings()
        if t["ttfa_ms"] is not None:
            self.ttfa.observe(t["ttfa_ms"] / 1e3)
        if t["rtf"] is not None:  # None: no audio (RTF would be infinite)
            self.rtf.observe(t["rtf"])
        for stage, seconds in (("lm", t["lm_s"]), ("flow", t["flow_s"]), ("vocoder", t["vocoder_s"])):
            if seconds is not None:
                self.stage.labels(stage=stage).observe(seconds)

    def collect(self) -> Iterator[Metric]:
        yield from self.registry.collect()
        yield from self._live()
        if self.include_default_registry:  # vLLM's vllm:* plus prometheus_client's process_* / python_*
            for family in prometheus_client.REGISTRY.collect():
                if not family.name.startswith(PREFIX):
                    yield family

    def render(self, public_name: str | None = None) -> bytes:
        """The exposition text (prometheus_client.CONTENT_TYPE_LATEST); with `public_name`, as `public_text`
        shows it to a caller who is not an admin."""
        text = prometheus_client.generate_latest(self)
        return text if public_name is None else public_text(text.decode(), public_name)

    def _live(self) -> Iterator[Metric]:
        """Values read at scrape time: counters of `Metrics`, gauges of the service and of one memory snapshot."""
        c = self.metrics.counters()
        yield _family(CounterMetricFamily, "cosyvoice_requests", "Synthesis requests finished, by outcome (rejected "
                      "= refused at once because the server was busy).", ["outcome"],
                      [([outcome], c["outcomes"][outcome]) for outcome in OUTCOMES])
        yield _family(CounterMetricFamily, "cosyvoice_refused_inputs", "Inputs refused with a message before "
                      "synthesis started, by reason (invalid_value, voice_not_found, invalid_audio, ...).", ["reason"],
                      [([reason], n) for reason, n in sorted(c["refused_inputs"].items())])
        yield _family(CounterMetricFamily, "cosyvoice_refused_share", "Requests refused because their client had "
                      "used its fair share, by reason (rate_limit: requests per minute; client_streams: syntheses "
                      "at once; uploads: uploads to the page per minute).", ["reason"],
                      [([r], c["refused_share"].get(r, 0)) for r in SHARE_REASONS])
        yield CounterMetricFamily("cosyvoice_audio_seconds", "Seconds of audio produced by requests that "
                                  "finished ok.", value=c["audio_s_total"])
        yield CounterMetricFamily("cosyvoice_lm_tokens", "Speech tokens the LM produced for finished requests.",
                                  value=c["tokens_total"])
        yield GaugeMetricFamily("cosyvoice_active_streams", "Synthesis requests running now.",
                                value=c["active_streams"])
        svc = self.service
        snap = self.metrics.memory_snapshot(svc.backend if svc is not None else None)
        yield from _snapshot_families(snap, http_waiting=svc.admission.waiting if svc is not None else None)
        if svc is not None:
            yield from _service_families(svc)


def public_text(text: str, model_name: str) -> bytes:
    """Exposition `text` as a stranger may see it: no `*_info` family (Python's version, vLLM's engine arguments)
    and vLLM's `model_name` label (the exported folder's absolute path) as the model's public name. Line by line
    (a parse and re-render would change counters' headers); also for the cluster's merged replicas' text."""
    label = 'model_name="{}"'.format(model_name.replace("\\", "\\\\").replace('"', '\\"'))
    kept = []
    for line in text.splitlines():
        words = line.split()
        name = words[2] if line.startswith("#") and len(words) > 2 else line.split("{", 1)[0].split(" ", 1)[0]
        if not name.endswith("_info"):
            kept.append(MODEL_NAME_RE.sub(lambda _: label, line))
    return ("\n".join(kept) + "\n").encode()


MODEL_NAME_RE = re.compile(r'model_name="(?:[^"\\]|\\.)*"')


def _family(kind: type[Metric], name: str, doc: str, labels: list[str],
            samples: list[tuple[list[str], float]]) -> Metric:
    family = kind(name, doc, labels=labels)
    for values, value in samples:
        family.add_metric(values, value)
    return family


def _gauge(name: str, doc: str, labels: list[str], samples: list[tuple[list[str], float | None]]) -> Iterator[Metric]:
    """A gauge family of the samples whose value is not None, or nothing when none is (absent beats NaN)."""
    if samples := [(values, value) for values, value in samples if value is not None]:
        yield _family(GaugeMetricFamily, name, doc, labels, samples)


def _snapshot_families(snap: dict, http_waiting: int | None) -> Iterator[Metric]:
    """Queue depths, GPU and process memory, KV cache, from one `Metrics.memory_snapshot()`."""
    yield from _gauge("cosyvoice_queue_depth", "Requests waiting: queue=http for an HTTP-API slot, "
                      "queue=engine in vLLM's scheduler.", ["queue"],
                      [(["http"], http_waiting), (["engine"], snap.get("engine_waiting"))])
    dev = snap.get("device")
    dev_labels = [str(dev["index"]), str(dev["name"])] if dev else []
    yield from _gauge("cosyvoice_gpu_memory_used_bytes", "Memory used on the GPU by all processes (NVML), bytes.",
                      ["device", "name"], [(dev_labels, dev["used_mib"] * MIB)] if dev else [])
    yield from _gauge("cosyvoice_gpu_memory_total_bytes", "Memory of the GPU, bytes.", ["device", "name"],
                      [(dev_labels, dev["total_mib"] * MIB)] if dev else [])
    per_role: dict[tuple[str, str], float] = {}
    for p in snap.get("processes", []):
        role = p["role"].lower().replace(" ", "_")  # app | vllm_engine | other
        for kind, mib in (("rss", p["rss_mib"]), ("gpu", p["gpu_mib"])):
            if mib is not None:
                per_role[role, kind] = per_role.get((role, kind), 0.0) + mib * MIB
    yield from _gauge("cosyvoice_process_memory_bytes", "Memory of this process (role=app) and its children "
                      "(vllm_engine, other): kind=rss (resident RAM) or gpu (NVML), bytes.", ["role", "kind"],
                      [([role, kind], v) for (role, kind), v in sorted(per_role.items())])
    yield from _gauge("cosyvoice_kv_cache_usage_ratio", "Share of vLLM's KV cache in use, 0..1.", [],
                      [([], snap.get("kv_cache_usage"))])
    yield from _gauge("cosyvoice_kv_cache_capacity_tokens", "Tokens vLLM's KV cache holds (blocks x block size).",
                      [], [([], snap.get("kv_cache_tokens"))])


def _service_families(svc: StudioService) -> Iterator[Metric]:
    """Readiness, engine requests and what runs (an info gauge = 1)."""
    h = svc.backend.health() if svc.backend is not None else None
    ready = svc.ready and not (h and h.fault)  # a dead (restarting) engine is not ready
    yield GaugeMetricFamily("cosyvoice_ready", "1 when the model and engine are ready to synthesise, else 0.",
                            value=1 if ready else 0)
    yield _family(CounterMetricFamily, "cosyvoice_faults", "Faults survived: GPU out of memory (request refused), "
                  "vLLM engine deaths and restarts.", ["kind"],
                  [(["out_of_memory"], svc.n_out_of_memory), (["engine_death"], h.deaths if h else 0),
                   (["engine_restart"], h.restarts if h else 0)])
    yield from _gauge("cosyvoice_engine_unfinished_requests", "LM requests the backend still tracks.", [],
                      [([], h.unfinished if h else None)])
    yield CounterMetricFamily("cosyvoice_flow_state_resolves", "Token->wave segments that found no room in the "
                              "incremental flow's state pool and re-solved from then on.",
                              value=svc.synth.resolved_streams if svc.synth is not None else 0)
    facts = svc.facts()
    backend = svc.backend.name if svc.backend is not None else "none"
    yield _family(GaugeMetricFamily, "cosyvoice_info", "What runs (always 1): LM backend, device, LM dtype, "
                  "quantization.", ["backend", "device", "dtype", "quantization"],
                  [([backend, str(facts["device"]), str(facts.get("dtype", svc.cfg.model.llm_dtype)),
                    str(facts.get("quantization", "none"))], 1)])


def add_metrics_route(app: FastAPI, service: StudioService) -> None:
    """Add `GET /metrics` (Prometheus text) for `service` to `app`."""
    exporter = PrometheusExporter(service.metrics, service)

    @app.get("/metrics", tags=["ops"], response_class=Response)
    def metrics(request: Request) -> Response:  # a worker thread: the memory snapshot may block (NVML, /proc)
        """Prometheus text exposition: requests, latency histograms, memory, KV cache, vLLM's vllm:* metrics
        (for everyone but admins without paths, engine arguments or versions)."""
        admin = caller_of(request.scope).admin
        public_name = None if admin else service.model_name()
        return Response(exporter.render(public_name), media_type=prometheus_client.CONTENT_TYPE_LATEST)
