"""GET /metrics: Prometheus text exposition of the studio plus vLLM's own `vllm:*` metrics (docs/design.md)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from app.server.identity import caller_of
from app.service.metrics import Metrics
from app.service.resources import MIB
from app.service.service import StudioService

PREFIX = "cosyvoice_"
MODEL_NAME_RE = re.compile(r'model_name="(?:[^"\\]|\\.)*"')


class PrometheusExporter:
    """The /metrics text: the registry of one `Metrics`, the scrape-time gauges of it and of its `StudioService`
    (when given), then prometheus_client's default registry; a prometheus_client collector."""

    def __init__(self, metrics: Metrics, service: StudioService | None = None, *,
                 include_default_registry: bool = True) -> None:
        self.metrics, self.service = metrics, service
        self.include_default_registry = include_default_registry

    def collect(self) -> Iterator[Metric]:
        yield from self.metrics.registry.collect()
        svc = self.service
        snap = self.metrics.memory_snapshot(svc.backend if svc is not None else None)
        yield from _snapshot_families(snap, http_waiting=svc.admission.waiting if svc is not None else None)
        if svc is not None:
            yield from _service_families(svc)
        if self.include_default_registry:  # vLLM's vllm:* plus prometheus_client's process_* / python_*
            for family in prometheus_client.REGISTRY.collect():
                if not family.name.startswith(PREFIX):
                    yield family

    def render(self, public_name: str | None = None) -> bytes:
        """The exposition text (prometheus_client.CONTENT_TYPE_LATEST); with `public_name`, as `public_text`
        shows it to a caller who is not an admin."""
        text = prometheus_client.generate_latest(self)
        return text if public_name is None else public_text(text.decode(), public_name)


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


def _family(name: str, doc: str, labels: list[str], samples: list[tuple[list[str], float | None]],
            kind: type[Metric] = GaugeMetricFamily) -> Iterator[Metric]:
    """A family of the samples whose value is not None, or nothing when none is (absent beats NaN)."""
    if samples := [(values, value) for values, value in samples if value is not None]:
        family = kind(name, doc, labels=labels)
        for values, value in samples:
            family.add_metric(values, value)
        yield family


def _snapshot_families(snap: dict, http_waiting: int | None) -> Iterator[Metric]:
    """Queue depths, GPU and process memory, KV cache, from one `Metrics.memory_snapshot()`."""
    yield from _family("cosyvoice_queue_depth", "Requests waiting: queue=http for an HTTP-API slot, "
                       "queue=engine in vLLM's scheduler.", ["queue"],
                       [(["http"], http_waiting), (["engine"], snap.get("engine_waiting"))])
    if dev := snap.get("device"):
        labels = [str(dev["index"]), str(dev["name"])]
        yield from _family("cosyvoice_gpu_memory_used_bytes", "Memory used on the GPU by all processes (NVML), "
                           "bytes.", ["device", "name"], [(labels, dev["used_mib"] * MIB)])
        yield from _family("cosyvoice_gpu_memory_total_bytes", "Memory of the GPU, bytes.", ["device", "name"],
                           [(labels, dev["total_mib"] * MIB)])
    per_role: dict[tuple[str, str], float] = {}
    for p in snap.get("processes", []):
        role = p["role"].lower().replace(" ", "_")  # app | vllm_engine | other
        for kind, mib in (("rss", p["rss_mib"]), ("gpu", p["gpu_mib"])):
            if mib is not None:
                per_role[role, kind] = per_role.get((role, kind), 0.0) + mib * MIB
    yield from _family("cosyvoice_process_memory_bytes", "Memory of this process (role=app) and its children "
                       "(vllm_engine, other): kind=rss (resident RAM) or gpu (NVML), bytes.", ["role", "kind"],
                       [([role, kind], v) for (role, kind), v in sorted(per_role.items())])
    yield from _family("cosyvoice_kv_cache_usage_ratio", "Share of vLLM's KV cache in use, 0..1.", [],
                       [([], snap.get("kv_cache_usage"))])
    yield from _family("cosyvoice_kv_cache_capacity_tokens", "Tokens vLLM's KV cache holds (blocks x block size).",
                       [], [([], snap.get("kv_cache_tokens"))])


def _service_families(svc: StudioService) -> Iterator[Metric]:
    """Readiness, engine requests and what runs (an info gauge = 1)."""
    h = svc.backend.health() if svc.backend is not None else None
    ready = svc.ready and not (h and h.fault)  # a dead (restarting) engine is not ready
    yield GaugeMetricFamily("cosyvoice_ready", "1 when the model and engine are ready to synthesise, else 0.",
                            value=1 if ready else 0)
    yield from _family("cosyvoice_faults", "Faults survived: GPU out of memory (request refused), vLLM engine "
                       "deaths and restarts.", ["kind"],
                       [(["out_of_memory"], svc.n_out_of_memory), (["engine_death"], h.deaths if h else 0),
                        (["engine_restart"], h.restarts if h else 0)], CounterMetricFamily)
    yield from _family("cosyvoice_engine_unfinished_requests", "LM requests the backend still tracks.", [],
                       [([], h.unfinished if h else None)])
    yield CounterMetricFamily("cosyvoice_flow_state_resolves", "Token->wave segments that found no room in the "
                              "incremental flow's state pool and re-solved from then on.",
                              value=svc.synth.resolved_streams if svc.synth is not None else 0)
    facts = svc.facts()
    backend = svc.backend.name if svc.backend is not None else "none"
    yield from _family("cosyvoice_info", "What runs (always 1): LM backend, device, LM dtype, quantization.",
                       ["backend", "device", "dtype", "quantization"],
                       [([backend, str(facts["device"]), str(facts.get("dtype", svc.cfg.model.llm_dtype)),
                          str(facts.get("quantization", "none"))], 1)])


def add_metrics_route(app: FastAPI, service: StudioService) -> None:
    """Add `GET /metrics` (Prometheus text) for `service` to `app`."""
    exporter = PrometheusExporter(service.metrics, service)

    @app.get("/metrics", tags=["ops"], response_class=Response)
    def metrics(request: Request) -> Response:  # a worker thread: the memory snapshot may block (NVML, /proc)
        """Prometheus text exposition: requests, latency histograms, memory, KV cache, vLLM's vllm:* metrics
        (for everyone but admins without paths, engine arguments or versions)."""
        public_name = None if caller_of(request.scope).admin else service.model_name()
        return Response(exporter.render(public_name), media_type=prometheus_client.CONTENT_TYPE_LATEST)
