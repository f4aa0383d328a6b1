"""Live numbers for the panels, /health and /metrics: request counters, recent requests, memory samples.

Design notes: docs/design.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from app.audio import OUTPUT_SAMPLE_RATE_HZ
from app.engine.requests import RequestStats, SynthesisRequest
from app.engine.resources import ResourceProbe

log = logging.getLogger(__name__)

OUTCOMES = ("ok", "cancelled", "error", "rejected")
LATENCY_KEYS = ("ttfa_ms", "rtf", "queue_wait_s", "lm_s", "flow_s", "vocoder_s", "wall_s", "tokens_per_s")
# RequestRecord.timings()' keys that are None when unknown
TIMING_KEYS = ("ttfa_ms", "rtf", "lm_s", "flow_s", "vocoder_s", "audio_s", "wall_s", "tokens_per_s")


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

    def line(self) -> str:
        """The stats line under both players: latency, speed and where the time went. Plain text (API clients
        and the page show it as it is; the page translates it)."""
        t = self.timings()
        rtf = t["rtf"] if t["rtf"] is not None else float("inf")  # None: no audio
        t = {k: v or 0 for k, v in t.items()}
        return (f"TTFA {t['ttfa_ms']:.0f} ms · RTF {rtf:.2f} · {t['tokens_per_s']:.1f} tokens/s · "
                f"audio {t['audio_s']:.2f} s · LM {t['lm_s']:.2f} s · flow {t['flow_s']:.2f} s · "
                f"vocoder {t['vocoder_s']:.2f} s · queue {self.queue_wait_s:.2f} s · "
                f"reference {self.reference_s:.2f} s · mode {self.mode} · seed {self.seed}")

    def details(self) -> dict[str, Any]:
        """The details JSON of both players (strict JSON: no NaN)."""
        def r(x: float | None, digits: int) -> float | None:
            return None if x is None else round(x, digits)

        t = self.timings()
        return {"seed": self.seed, "mode": self.mode, "stream": self.stream, "speed": self.speed,
                "voice": self.voice or None, "request_id": self.request_id, "sample_rate": OUTPUT_SAMPLE_RATE_HZ,
                "audio_samples": self.n_samples, "audio_s": r(t["audio_s"], 3), "ttfa_ms": r(t["ttfa_ms"], 1),
                "rtf": r(t["rtf"], 3), "tokens": t["n_tokens"], "tokens_per_s": r(t["tokens_per_s"], 1),
                "lm_s": r(t["lm_s"], 3), "flow_s": r(t["flow_s"], 3), "vocoder_s": r(t["vocoder_s"], 3),
                "queue_wait_s": round(self.queue_wait_s, 3), "reference_s": round(self.reference_s, 3),
                "chunks": t["n_chunks"], "segments": t["n_segments"], "notes": list(self.notes),
                "first_audio_path_ms": self._first_audio_path(t["ttfa_ms"])}

    def _first_audio_path(self, ttfa_ms: float | None) -> dict[str, float | None] | None:
        """Where the first audio's time went (ms since the request began, but `flow_call` and `vocoder`:
        the first chunk's own durations); None without stats."""
        s = self.stats
        if s is None:
            return None
        path = {"lm_first_token": s.first_token_ms, "first_chunk_tokens_in": s.first_hop_ms,
                "flow_call": s.chunk_flow_ms[0] if s.chunk_flow_ms else None, "vocoder": s.first_hift_ms,
                "wave_ready": s.first_wave_ms, "first_audio": ttfa_ms}
        return {k: None if v is None else round(v, 1) for k, v in path.items()}

    def row(self) -> dict[str, Any]:
        """A plain dict: the record's own fields and its `timings()` (the panels' table and charts, /health)."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "stats"}
        return {**own, **self.timings()}


class Metrics:
    """Counters and ring buffers of one process; thread-safe (panel ticks run in worker threads)."""

    def __init__(self, *, max_requests: int = 200, max_samples: int = 600, min_sample_interval_s: float = 0.5):
        self._lock = threading.Lock()
        self._sample_lock = threading.Lock()
        self._requests: deque[RequestRecord] = deque(maxlen=max_requests)
        self._samples: deque[dict[str, Any]] = deque(maxlen=max_samples)
        self._min_interval_s = min_sample_interval_s
        self._last_sample_at = -float("inf")  # time.monotonic()
        self._probe = ResourceProbe()
        self._active = 0
        self._n_finished = 0
        self.n_started = 0
        self.outcomes: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()  # inputs refused before a request started, by reason (InputError.code)
        self.over_share: Counter[str] = Counter()  # requests refused for their client's fair share, by reason
        self.audio_s_total = 0.0  # audio produced by requests that finished ok
        self.tokens_total = 0  # speech tokens produced by the LM
        self._listeners: list[Callable[[RequestRecord], None]] = []

    # --- requests ----------------------------------------------------------------------------------

    def add_listener(self, fn: Callable[[RequestRecord], None]) -> None:
        """Call `fn(record)` for every request finished from now on (outside the lock, on the finishing
        thread or event loop: keep it quick and non-blocking)."""
        with self._lock:
            self._listeners.append(fn)

    def request_started(self) -> None:
        with self._lock:
            self.n_started += 1
            self._active += 1

    def request_finished(self, stats: RequestStats | None, queue_wait_s: float, outcome: str = "ok", *,
                         request: SynthesisRequest | None = None, n_samples: int = 0, voice: str = "",
                         notes: tuple[str, ...] = (), reference_s: float = 0.0, stopped: bool = False,
                         owner: str = "") -> None:
        """Count the request's end; `stats` are the final chunk's, or those until an early end (None if none).
        `request` and the rest describe it for the page (`record`)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        about: dict[str, Any] = {} if request is None else dict(
            request_id=request.request_id, seed=request.seed, mode=request.mode, stream=request.stream,
            speed=request.speed)
        self.add(RequestRecord(seq=0, t=time.time(), outcome=outcome, queue_wait_s=queue_wait_s, n_samples=n_samples,
                               voice=voice, notes=tuple(notes), reference_s=reference_s, stats=stats, stopped=stopped,
                               owner=owner, **about))

    def add(self, rec: RequestRecord) -> None:
        """Count a finished request's record (numbered here: `seq`) and hand it to the listeners; also how the
        cluster's page keeps the records its replicas made (app/cluster/page.py)."""
        with self._lock:
            self._n_finished += 1
            rec = replace(rec, seq=self._n_finished)
            if rec.outcome != "rejected":  # a rejected request never started
                self._active = max(0, self._active - 1)
            self.outcomes[rec.outcome] += 1
            self._requests.append(rec)
            if rec.stats is not None:
                self.tokens_total += rec.stats.n_tokens
                if rec.outcome == "ok":
                    self.audio_s_total += rec.stats.audio_s
            listeners = list(self._listeners)
        for fn in listeners:
            try:
                fn(rec)
            except Exception:  # an exporter's bug must not replace the request's own outcome or exception
                log.exception("metrics listener %r failed", fn)

    @property
    def active_streams(self) -> int:
        return self._active

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
        with self._lock:
            self.refused[reason] += 1

    def share_refused(self, reason: str) -> None:
        """A request was refused because its client used its fair share ("rate_limit", "client_streams")."""
        with self._lock:
            self.over_share[reason] += 1

    def counters(self) -> dict[str, Any]:
        with self._lock:
            return {"started": self.n_started, "active_streams": self._active,
                    "outcomes": {k: self.outcomes.get(k, 0) for k in OUTCOMES},
                    "refused_inputs": dict(self.refused),
                    "refused_share": dict(self.over_share), "audio_s_total": self.audio_s_total,
                    "tokens_total": self.tokens_total}

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
