"""The low-latency player's Python side: its page element and the JS glue (player_take.js: the take element's).
Design notes: docs/design.md."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import gradio as gr

from app.message import lang_of
from app.service.service import StudioService
from app.ui import ui_text
from app.ui.i18n import locale
from app.ui.takes import stopped_take, take_line

# next to Generate: the busy line and the latest error (player.js: setBusy, showError; its words, in the browser's
# language, replace these)
STATUS_HTML = ('<div id="studio_status"><span id="studio_busy">⏳ Generating…</span>'
               '<div id="studio_error" role="alert"></div></div>')
FINAL_JS = "() => [window.studioTake ? window.studioTake.final : null]"  # the final WAV (or none) into #final_out
# the seed the server used (the X-Seed header), into the seed box at the start of a take: player.js hands it to
# the hidden #player_seed element (`at` makes every take a change), whose change event returns it as an output
SEED_JS = "window.studioSeed = (seed) => { props.value = JSON.stringify({seed: Number(seed), at: Date.now()}); };"
SEED_BOX_JS = "(v) => { const s = JSON.parse(v || '{}').seed; return [Number.isInteger(s) ? s : undefined]; }"
# the text box's value into the player as it changes (typed or set), for text that streams in (player_feed.js)
TYPED_JS = "(text) => { if (window.studioPlayer) window.studioPlayer.typed = text; return []; }"
MAX_TAKE_VALUE = 4096  # characters of the take element's JSON: an id and a few numbers
REQUEST_ID_RE = re.compile(r"[0-9a-f]{32}")  # SynthesisRequest.request_id (uuid4 hex)


class PlayerTake:
    """The low-latency player's take into the page's stats line and details (its final WAV stays in the page)."""

    def __init__(self, service: StudioService) -> None:
        self.service = service

    def show(self, value: str, request: gr.Request = None) -> tuple[str, Any]:
        """`value` (JSON from player.js): {request_id, stopped, samples, seed, client: {first_byte_ms,
        first_sound_ms}}; "" clears the outputs (a new Generate). Returns (stats line in the page's language,
        details); the final WAV stays in the page (FINAL_JS)."""
        if not value:
            return "", None
        try:
            take = json.loads(value) if len(value) <= MAX_TAKE_VALUE else None
        except ValueError:
            take = None
        request_id = take.get("request_id") if isinstance(take, dict) else None
        if not isinstance(request_id, str) or REQUEST_ID_RE.fullmatch(request_id) is None:
            raise gr.Error("not a take of this page's player", print_exception=False)
        if take.get("stopped"):
            raw_seed = take.get("seed")  # the X-Seed header, as the page read it
            seed = int(raw_seed) if isinstance(raw_seed, str) and raw_seed.lstrip("-").isdigit() else None
            details = {**stopped_take(request_id, seed, int(_number(take.get("samples")))), "player": "webaudio"}
            return take_line(details, lang_of(request)), details
        rec = self.service.metrics.record(request_id)
        if rec is None or rec.outcome != "ok":
            raise gr.Error("unknown take, one that did not finish, or one too old to be kept", print_exception=False)
        measured = take["client"] if isinstance(take.get("client"), dict) else {}
        client = {k: _number(measured.get(k), None) for k in ("first_byte_ms", "first_sound_ms")}
        details = {**rec.details(), "player": "webaudio", "client": client}
        return take_line(details, lang_of(request), rec.notes), details


def _number(x: Any, default: Any = 0.0) -> Any:
    """`x` as a finite float (a number the page measured), else `default`."""
    return round(float(x), 1) if isinstance(x, int | float) and math.isfinite(x) and x >= 0 else default


def player_js() -> str:
    """The page-load JS that defines `window.studioPlayer`: player.js with player_page.js, player_feed.js, words.js
    and player_words.js inlined as code, the Worker and AudioWorklet sources and player.css as string literals,
    and its words per language (locales/page.toml) as an object (read when the page is built)."""
    return (ui_text("player.js").replace("__PAGE_SRC__", ui_text("player_page.js"))
            .replace("__FEED_SRC__", ui_text("player_feed.js"))
            .replace("__WORDS_VIEW_SRC__", ui_text("words.js"))
            .replace("__TAKE_WORDS_SRC__", ui_text("player_words.js"))
            .replace("__WORKER_SRC__", json.dumps(ui_text("player_worker.js")))
            .replace("__WORKLET_SRC__", json.dumps(ui_text("player_worklet.js")))
            .replace("__RESULT_CSS__", json.dumps(ui_text("player.css")))
            .replace("__WORDS__", json.dumps(locale("page"), ensure_ascii=False)))
