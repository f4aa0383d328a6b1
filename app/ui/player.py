"""The low-latency player's Python side: the page element, the JS glue, and what the server keeps per request.

The browser part is `player.js` with `player_worker.js` (fetch + int16 -> float32) and
`player_worklet.js` (an AudioWorklet playing the samples back to back), fed by `POST /studio/speech`
(app/server/studio_stream.py): it plays raw PCM as it arrives, instead of Gradio's HLS/AAC path
(0.4-1.1 s slower to first sound).
Here: `PLAYER_HTML` (the timing line under the outputs), `player_js()` (defines `window.studioPlayer`
on page load), `GATE_JS` (the Generate button: the low-latency player runs in the browser and the Gradio
`synthesize` event is skipped; the standard player passes on to it), and `PlayerStore`: per request id
the final audio and stats (so the page can show the final WAV after a low-latency stream) and the
client's timings (click -> first byte -> first sound) for the latency panel. Bounded in count, age and
audio size; one per service (`player_store(service)`).
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr
import numpy as np

from app.audio import OUTPUT_SAMPLE_RATE_HZ, wav_bytes
from app.engine.requests import RequestStats
from app.ui.handlers import stats_line

UI_DIR = Path(__file__).parent
MAX_RESULTS = 32  # final results kept (a page fetches its own right after the stream ends)
RESULT_TTL_S = 600.0
MAX_STORED_SAMPLES = 10 * 60 * OUTPUT_SAMPLE_RATE_HZ  # all kept audio together: 10 min of int16 (~29 MB)
MAX_CLIENT_MS = 600_000.0  # a client timing above 10 min is not a measurement
REQUEST_ID_RE = re.compile(r"[0-9a-f]{32}")  # SynthesisRequest.request_id (uuid4 hex)

PLAYER_HTML = ('<div class="studio-player" style="padding: 2px 8px; font-variant-numeric: tabular-nums">'
               '<span id="studio_player_line">Low-latency player: ready (click → first byte → first sound '
               'appears here)</span></div>')

# The Generate button's first event (js only). Gradio passes the input values in order (gr.Audio with
# type="filepath": its FileData {path, url, orig_name, ...} or null). A gate that throws ends the chain,
# so `.success(synthesize)` does not run: the low-latency player handles the request in the browser.
GATE_JS = """
(text, prompt_audio, prompt_text, mode, instruct_text, voice, seed, stream, player) => {
  const p = window.studioPlayer;
  if (p) p.stop();
  if (player !== 'webaudio' || !stream || !p) return [];
  p.play({text: text || '', prompt_audio: prompt_audio ? (prompt_audio.path || null) : null,
          prompt_text: prompt_text || '', mode, instruct_text: instruct_text || '', voice: voice || '',
          seed: (seed === null || seed === '') ? null : Number(seed)});
  throw new Error('handled by the low-latency player');
}
"""
STOP_JS = "() => { if (window.studioPlayer) window.studioPlayer.stop(); return []; }"
# the hidden "player done" button's event: the request id comes from the player, not from the textbox
RESULT_JS = "(rid) => [(window.studioPlayer && window.studioPlayer.last && window.studioPlayer.last.requestId) || '']"


def player_js() -> str:
    """The page-load JS that defines `window.studioPlayer`: player.js with the Worker and AudioWorklet
    sources inlined as string literals (read when the page is built)."""
    def read(name: str) -> str:
        return (UI_DIR / name).read_text(encoding="utf-8")

    return (read("player.js").replace("__WORKER_SRC__", json.dumps(read("player_worker.js")))
            .replace("__WORKLET_SRC__", json.dumps(read("player_worklet.js"))))


def valid_request_id(rid: object) -> bool:
    return isinstance(rid, str) and REQUEST_ID_RE.fullmatch(rid) is not None


@dataclass(frozen=True)
class PlayerResult:
    """One finished low-latency request as the page shows it afterwards."""

    request_id: str
    pcm: np.ndarray  # [N] int16, exactly the PCM the response body carried
    stats: RequestStats
    seed: int
    mode: str
    voice: str
    queue_s: float  # waiting for an HTTP slot
    reference_s: float  # reference features (cached after the first use of a clip)
    ttfa_ms: float  # as X-TTFA-Ms: slot taken -> first audio chunk
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ClientTiming:
    """What the page measured, in ms after the click (performance.now() differences)."""

    first_byte_ms: float
    first_sound_ms: float


class PlayerStore:
    """Bounded, thread-safe: final results by request id, and the client timings reported for them."""

    def __init__(self, max_results: int = MAX_RESULTS, ttl_s: float = RESULT_TTL_S,
                 max_samples: int = MAX_STORED_SAMPLES) -> None:
        self._lock = threading.Lock()
        self._results: OrderedDict[str, tuple[float, PlayerResult]] = OrderedDict()  # rid -> (monotonic, result)
        self._timings: OrderedDict[str, tuple[float, ClientTiming]] = OrderedDict()  # rid -> (wall clock, timing)
        self.max_results, self.ttl_s, self.max_samples = max_results, ttl_s, max_samples

    def put_result(self, result: PlayerResult) -> None:
        with self._lock:
            self._results[result.request_id] = (time.monotonic(), result)
            self._evict()

    def result(self, request_id: str) -> PlayerResult | None:
        with self._lock:
            self._evict()
            entry = self._results.get(request_id)
            return entry[1] if entry else None

    def put_timing(self, request_id: str, timing: ClientTiming) -> bool:
        """Keep the page's timing of a request this server answered; False for unknown ids."""
        with self._lock:
            self._evict()
            if request_id not in self._results:
                return False
            self._timings[request_id] = (time.time(), timing)
            self._timings.move_to_end(request_id)
            while len(self._timings) > self.max_results:
                self._timings.popitem(last=False)
            return True

    def timing(self, request_id: str) -> ClientTiming | None:
        with self._lock:
            entry = self._timings.get(request_id)
            return entry[1] if entry else None

    def recent_timings(self, n: int) -> list[dict[str, Any]]:
        """The last `n` reported timings with the server's numbers, newest first."""
        with self._lock:
            rows = []
            for rid, (t, timing) in reversed(self._timings.items()):
                entry = self._results.get(rid)
                if entry is None:
                    continue
                r = entry[1]
                rows.append({"request_id": rid, "t": t, "server_ttfa_ms": r.ttfa_ms, "queue_ms": r.queue_s * 1e3,
                             "reference_ms": r.reference_s * 1e3, "first_byte_ms": timing.first_byte_ms,
                             "first_sound_ms": timing.first_sound_ms, "audio_s": r.stats.audio_s})
                if len(rows) == n:
                    break
            return rows

    def _evict(self) -> None:
        now = time.monotonic()
        total = sum(r.pcm.size for _, r in self._results.values())
        while self._results:
            t, oldest = next(iter(self._results.values()))
            if len(self._results) <= self.max_results and now - t <= self.ttl_s and total <= self.max_samples:
                break
            self._results.popitem(last=False)
            total -= oldest.pcm.size
        for rid in [rid for rid in self._timings if rid not in self._results]:
            del self._timings[rid]


_STORES: weakref.WeakKeyDictionary[Any, PlayerStore] = weakref.WeakKeyDictionary()
_STORES_LOCK = threading.Lock()


def player_store(service: Any) -> PlayerStore:
    """The service's one `PlayerStore` (shared by the /studio routes, the page's events and the panels)."""
    with _STORES_LOCK:
        store = _STORES.get(service)
        if store is None:
            store = _STORES[service] = PlayerStore()
        return store


def check_timing(first_byte_ms: object, first_sound_ms: object) -> ClientTiming:
    """A client-reported timing: finite numbers in 0..MAX_CLIENT_MS (ValueError otherwise)."""
    values = []
    for name, v in (("first_byte_ms", first_byte_ms), ("first_sound_ms", first_sound_ms)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or not 0 <= v <= MAX_CLIENT_MS:
            raise ValueError(f"{name} must be a number of milliseconds in 0..{MAX_CLIENT_MS:.0f}")
        values.append(float(v))
    return ClientTiming(*values)


def result_outputs(store: PlayerStore, request_id: str | None):
    """(final WAV, stats line, details) of a finished low-latency request, for the page's outputs."""
    r = store.result(request_id) if valid_request_id(request_id) else None
    if r is None:
        return gr.skip(), "The low-latency result is no longer kept (or the request did not finish).", gr.skip()
    line = stats_line(r.stats, seed=r.seed, mode=r.mode, queue_s=r.queue_s, frontend_s=r.reference_s)
    line += " · player **low-latency**"
    timing = store.timing(r.request_id)
    if timing is not None:
        line += (f" · click → first byte {timing.first_byte_ms:.0f} ms → first sound "
                 f"{timing.first_sound_ms:.0f} ms")
    if r.notes:
        line += "\n\n" + "\n".join(f"- {n}" for n in r.notes)
    s = r.stats
    details = {"seed": r.seed, "mode": r.mode, "stream": True, "speed": 1.0, "voice": r.voice or None,
               "player": "webaudio", "request_id": r.request_id, "sample_rate": OUTPUT_SAMPLE_RATE_HZ,
               "audio_samples": int(r.pcm.size), "audio_s": round(s.audio_s, 3), "ttfa_ms": round(r.ttfa_ms, 1),
               "rtf": round(s.rtf, 3), "tokens": s.n_tokens, "tokens_per_s": round(s.tokens_per_s, 1),
               "lm_s": round(s.lm_s, 3), "flow_s": round(s.flow_s, 3), "vocoder_s": round(s.hift_s, 3),
               "queue_wait_s": round(r.queue_s, 3), "reference_s": round(r.reference_s, 3),
               "chunks": s.n_chunks, "segments": s.n_segments, "notes": list(r.notes)}
    if timing is not None:
        details["client"] = {"first_byte_ms": round(timing.first_byte_ms, 1),
                             "first_sound_ms": round(timing.first_sound_ms, 1)}
    return wav_bytes(r.pcm, OUTPUT_SAMPLE_RATE_HZ), line, details
