"""Live numbers for the panels, /health and /metrics: prometheus_client counters, recent requests, memory samples.
Design notes: docs/design.md."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from app.audio import OUTPUT_SAMPLE_RATE_HZ
from app.engine.requests import RequestStats, SynthesisRequest
from app.service.resources import ResourceProbe

OUTCOMES = ("ok", "cancelled", "error", "rejected")
LATENCY_KEYS = ("ttfa_ms", "rtf", "queue_wait_s", "lm_s", "flow_s", "vocoder_s", "wall_s", "tokens_per_s")
# RequestRecord.timings()' keys that are None when unknown
TIMING_KEYS = ("ttfa_ms", "rtf", "lm_s", "flow_s", "vocoder_s", "audio_s", "wall_s", "tokens_per_s")
# Time to first audio, seconds: 10 ms (GPU, batch 1, warm) to 30 s (a 2-core CPU behind a queue).
TTFA_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0,
                  30.0)
# Real-time factor = wall seconds / audio seconds: 0.01 (100x faster than real time) to 10; 1.0 is an edge.
RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
# Seconds one request spent in a stage (summed over its segments/hops): 5 ms to 2 min.
STAGE_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STAGES = ("lm", "flow", "vocoder", "queue")
SHARE_REASONS = ("rate_limit", "client_streams", "uploads")  # the server's limits.py, app/service/fair_share.py


@dataclass(frozen=True)
class RequestRecord:
    """One finished request as the panels and the page show it: who asked what, and the synthesizer's own
    `RequestStats` (the final chunk's, or those until an early end; None for one that had none)."""

    seq: int  # 1-based order among the requests this process finished
    t: float  # wall clock (time.time()) at the end
    outcome: str  # one of OUTCOMES
    queue_wait_s: float
    # the request ("" / None for one refused before it had any, e.g. rejected by the admission)
    request_id: str = ""
    seed: int | None = None
    mode: str = ""
    stream: bool = True
    speed: float = 1.0
    voice: str = ""  # the saved voice's name; "" for a reference clip
    notes: tuple[str, ...] = ()  # what the door changed or warns about (trimmed, cross-lingual fallback, ...)
    reference_s: float = 0.0  # getting the voice's features (0 for a cached or saved voice)
    n_samples: int = 0  # audio samples produced (24 kHz)
    stats: RequestStats | None = None
    stopped: bool = False  # cancelled by the page's Stop (a closed tab or a client's cancel is not)
    owner: str = ""  # who asked (`Owner.id`; "" where nobody is told apart): the panels show a caller theirs

    def timings(self) -> dict[str, Any]:
        """The stats as the page, the panels and /metrics read them, None where unknown: no stats; TTFA of a
        request that ended before its first audio; RTF without audio (it would be infinite)."""
        s = self.stats
        if s is None:
            return {**dict.fromkeys(TIMING_KEYS), "n_tokens": 0, "n_chunks": 0, "n_segments": 0}
        early = self.outcome != "ok" and not s.audio_s
        return {"ttfa_ms": None if early else s.ttfa_ms, "rtf": s.rtf if np.isfinite(s.rtf) else None,
                "lm_s": s.lm_s, "flow_s": s.flow_s, "vocoder_s": s.hift_s, "audio_s": s.audio_s,
                "wall_s": s.wall_s, "tokens_per_s": s.tokens_per_s, "n_tokens": s.n_tokens, "n_chunks": s.n_chunks,
                "n_segments": s.n_segments}

    def details(self) -> dict[str, Any]:
        """The details JSON of both players (strict JSON: no NaN). `first_audio_path_ms`: where the first audio's
        time went (ms since the request began, but `flow_call` and `vocoder`: the first chunk's own durations);
        None without stats."""
        def r(x: float | None, digits: int) -> float | None:
            return None if x is None else round(x, digits)

        t, s = self.timings(), self.stats
        path = None if s is None else {
            "lm_first_token": s.first_token_ms, "first_chunk_tokens_in": s.first_hop_ms,
            "flow_call": s.chunk_flow_ms[0] if s.chunk_flow_ms else None, "vocoder": s.first_hift_ms,
            "wave_ready": s.first_wave_ms, "first_audio": t["ttfa_ms"]}
        return {"seed": self.seed, "mode": self.mode, "stream": self.stream, "speed": self.speed,
                "voice": self.voice or None, "request_id": self.request_id, "sample_rate": OUTPUT_SAMPLE_RATE_HZ,
                "audio_samples": self.n_samples, "audio_s": r(t["audio_s"], 3), "ttfa_ms": r(t["ttfa_ms"], 1),
                "rtf": r(t["rtf"], 3), "tokens": t["n_tokens"], "tokens_per_s": r(t["tokens_per_s"], 1),
                "lm_s": r(t["lm_s"], 3), "flow_s": r(t["flow_s"], 3), "vocoder_s": r(t["vocoder_s"], 3),
                "queue_wait_s": round(self.queue_wait_s, 3), "reference_s": round(self.reference_s, 3),
                "chunks": t["n_chunks"], "segments": t["n_segments"], "notes": list(self.notes),
                "first_audio_path_ms": path and {k: r(v, 1) for k, v in path.items()}}

    def row(self) -> dict[str, Any]:
        """A plain dict: the record's own fields and its `timings()` (the panels' table and charts, /health)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "stats"} | self.timings()


class Metrics:
    """The process's counters and histograms (prometheus_client, in the service's own `registry`: the one source
    of /metrics, /health and the panels), recent requests and memory samples; thread-safe."""

    def __init__(self, *, max_requests: int = 200, max_samples: int = 600, min_sample_interval_s: float = 0.5):
        self._lock = threading.Lock()
        self._sample_lock = threading.Lock()
        self._requests: deque[RequestRecord] = deque(maxlen=max_requests)
        self._samples: deque[dict[str, Any]] = deque(maxlen=max_samples)
        self._min_interval_s = min_sample_interval_s
        self._last_sample_at = -float("inf")  # time.monotonic()
        self._probe = ResourceProbe()
        self._n_finished = 0
        self.registry = reg = CollectorRegistry()  # one per service: services in one process never collide
        self.requests = Counter("cosyvoice_requests", "Synthesis requests finished, by outcome (rejected = refused "
                                "at once because the server was busy).", ["outcome"], registry=reg)
        self.refused = Counter("cosyvoice_refused_inputs", "Inputs refused with a message before synthesis "
                               "started, by reason (invalid_value, voice_not_found, invalid_audio, ...).", ["reason"],
                               registry=reg)
        self.over_share = Counter("cosyvoice_refused_share", "Requests refused because their client had used its "
                                  "fair share, by reason (rate_limit: requests per minute; client_streams: syntheses "
                                  "at once; uploads: uploads to the page per minute).", ["reason"], registry=reg)
        self.audio_s = Counter("cosyvoice_audio_seconds", "Seconds of audio produced by requests that finished ok.",
                               registry=reg)
        self.lm_tokens = Counter("cosyvoice_lm_tokens", "Speech tokens the LM produced for finished requests.",
                                 registry=reg)
        self.active = Gauge("cosyvoice_active_streams", "Synthesis requests running now.", registry=reg)
        self.ttfa = Histogram("cosyvoice_ttfa_seconds", "Time from a request's start (after its queue wait) to its "
                              "first audio chunk, seconds.", buckets=TTFA_BUCKETS_S, registry=reg)
        self.rtf = Histogram("cosyvoice_rtf", "Real-time factor of finished requests: wall seconds / audio seconds "
                             "(below 1 = faster than real time).", buckets=RTF_BUCKETS, registry=reg)
        self.stage = Histogram("cosyvoice_stage_seconds", "Seconds one request spent per stage: lm (waiting on the "
                               "LM stream), flow, vocoder (HiFT), queue (waiting for a slot).", ["stage"],
                               buckets=STAGE_BUCKETS_S, registry=reg)
        for metric, names in ((self.requests, OUTCOMES), (self.over_share, SHARE_REASONS), (self.stage, STAGES)):
            for name in names:  # a series (0) from the first scrape on
                metric.labels(name)

    # --- requests ----------------------------------------------------------------------------------

    def request_started(self) -> None:
        self.active.inc()

    def request_finished(self, stats: RequestStats | None, queue_wait_s: float, outcome: str = "ok", *,
                         request: SynthesisRequest | None = None, **about: Any) -> None:
        """Count the request's end; `stats` are the final chunk's, or those until an early end (None if none).
        `request` and `about` (RequestRecord's n_samples, voice, notes, reference_s, stopped, owner) describe it
        for the page (`record`)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        about |= {k: getattr(request, k) for k in ("request_id", "seed", "mode", "stream", "speed") if request}
        self.add(RequestRecord(seq=0, t=time.time(), outcome=outcome, queue_wait_s=queue_wait_s, stats=stats, **about))

    def add(self, rec: RequestRecord) -> None:
        """Count a finished request's record (numbered here: `seq`) and keep it; also how the cluster's page keeps
        the records its replicas made (app/cluster/page.py)."""
        t = rec.timings()
        with self._lock:
            self._n_finished += 1
            self._requests.append(replace(rec, seq=self._n_finished))
            self.requests.labels(rec.outcome).inc()
            if rec.outcome != "rejected":  # a rejected request never started nor waited for a slot
                self.active.dec()
                self.stage.labels("queue").observe(rec.queue_wait_s)
            self.lm_tokens.inc(t["n_tokens"])
            if rec.outcome == "ok" and t["audio_s"]:
                self.audio_s.inc(t["audio_s"])
            if t["ttfa_ms"] is not None:
                self.ttfa.observe(t["ttfa_ms"] / 1e3)
            if t["rtf"] is not None:  # None: no audio (RTF would be infinite)
                self.rtf.observe(t["rtf"])
            for stage in ("lm", "flow", "vocoder"):
                if t[f"{stage}_s"] is not None:
                    self.stage.labels(stage).observe(t[f"{stage}_s"])

    @property
    def active_streams(self) -> int:
        return int(_values(self.active)[""])

    def recent(self, n: int | None = None) -> list[dict[str, Any]]:
        """The last `n` (default: all kept) finished requests, oldest first, as plain dicts."""
        with self._lock:
            recs = list(self._requests)
        return [r.row() for r in (recs[-n:] if n else recs)]

    def record(self, request_id: str) -> RequestRecord | None:
        """The finished request `request_id` while the ring buffer still holds it (None otherwise)."""
        if not request_id:
            return None
        with self._lock:
            return next((r for r in reversed(self._requests) if r.request_id == request_id), None)

    def percentiles(self, key: str, qs: tuple[float, ...] = (50, 95)) -> dict[str, float | None]:
        """{"p50": ..., "p95": ...} of `key` over the kept requests that have it (None if none)."""
        if key not in LATENCY_KEYS:
            raise ValueError(f"key must be one of {LATENCY_KEYS}, got {key!r}")
        values = [r[key] for r in self.recent() if r[key] is not None]
        return {f"p{q:g}": (float(np.percentile(values, q)) if values else None) for q in qs}

    def input_refused(self, reason: str) -> None:
        """An input was refused with a message (empty text, unknown voice, bad audio, ...); `reason` is its code."""
        self.refused.labels(reason).inc()

    def share_refused(self, reason: str) -> None:
        """A request was refused because its client used its fair share ("rate_limit", "client_streams")."""
        self.over_share.labels(reason).inc()

    def counters(self) -> dict[str, Any]:
        """The counters as /health and the panels show them (counts as ints; `started` = running + ended)."""
        with self._lock:  # one consistent reading of a request's end
            outcomes, active = _values(self.requests), int(_values(self.active)[""])
            return {"started": active + int(sum(n for o, n in outcomes.items() if o != "rejected")),
                    "active_streams": active, "outcomes": {o: int(outcomes[o]) for o in OUTCOMES},
                    "refused_inputs": {k: int(n) for k, n in _values(self.refused).items()},
                    "refused_share": {k: int(n) for k, n in _values(self.over_share).items() if n},
                    "audio_s_total": _values(self.audio_s)[""], "tokens_total": int(_values(self.lm_tokens)[""])}

    # --- memory ------------------------------------------------------------------------------------

    def memory_snapshot(self, backend: Any = None) -> dict[str, Any]:
        """A fresh sample (or the last one if younger than `min_sample_interval_s`), kept in the history.

        Keys: t (wall clock), gpu (bool), note, device {index, name, used_mib, total_mib} | None,
        processes [{pid, role, gpu_mib | None, rss_mib, cpu_percent}], torch {allocated_mib,
        reserved_mib, max_allocated_mib} | None, kv_cache_usage (0..1) | None, engine_running,
        engine_waiting (vLLM's scheduler gauges) | None, kv_cache_tokens (capacity) | None,
        cpu {n_cpus, percent, rss_mib, ram_used_mib, ram_total_mib} (this process + descendants).
        """
        with self._sample_lock:  # one sampler at a time; request counters never wait for a sample
            with self._lock:
                if self._samples and time.monotonic() - self._last_sample_at < self._min_interval_s:
                    return self._samples[-1]
            sample = self._probe.sample(backend)
            with self._lock:
                self._samples.append(sample)
                self._last_sample_at = time.monotonic()
            return sample

    def memory_history(self, n: int | None = None) -> list[dict[str, Any]]:
        with self._lock:
            samples = list(self._samples)
        return samples[-n:] if n else samples


def _values(metric: Counter | Gauge) -> dict[str, float]:
    """{its one label's value ("" without labels): value} of a counter's or gauge's series."""
    return {next(iter(s.labels.values()), ""): s.value for s in metric.collect()[0].samples
            if not s.name.endswith("_created")}
