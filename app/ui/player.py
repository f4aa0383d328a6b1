"""The low-latency player's Python side: its page element and the JS glue.

The browser part is `player.js` with `player_worker.js` (fetch + int16 -> float32) and
`player_worklet.js` (an AudioWorklet playing the samples back to back), fed by `POST /studio/speech`
(app/server/studio_stream.py): it plays raw PCM as it arrives, instead of Gradio's HLS/AAC path
(0.4-1.1 s slower to first sound). When the body has ended, the page builds the final WAV from the
PCM it played and fetches the stats line and details from `GET /studio/requests/{id}`; it shows
them in `player_html()`'s result area, in place of the standard player's final WAV, stats and details
(the body's `data-studio-result` attribute, set per Generate click, says which of the two shows: player.css).
The page's other player events are JS files beside it (wired in layout.py): player_gate.js (Generate: the
low-latency player runs in the browser and the Gradio `synthesize` event is skipped; the standard player
passes on to it), player_stop.js, player_failure.js (the standard player's error) and `IDLE_JS` (its end).
"""

from __future__ import annotations

import json

from app.ui import ui_text

# next to Generate: the busy line and the latest error of either player (player.js: setBusy, showError)
STATUS_HTML = ('<div id="studio_status"><span id="studio_busy">⏳ Generating…</span>'
               '<div id="studio_error" role="alert"></div></div>')
# the standard player's `synthesize` ended (either way): the page is no longer busy
IDLE_JS = "() => { if (window.studioPlayer) window.studioPlayer.setBusy(false); return []; }"


def player_html() -> str:
    """player.html as one line (no whitespace between its elements); player.js fills #player_final (<audio>
    + download link), #player_stats and #player_details_json, and drives #player_controls: pause/resume,
    volume, played / received seconds."""
    return "".join(line.strip() for line in ui_text("player.html").splitlines())


def player_js() -> str:
    """The page-load JS that defines `window.studioPlayer`: player.js with player_page.js inlined as code, and
    the Worker and AudioWorklet sources and player.css as string literals (read when the page is built)."""
    return (ui_text("player.js").replace("__PAGE_SRC__", ui_text("player_page.js"))
            .replace("__WORKER_SRC__", json.dumps(ui_text("player_worker.js")))
            .replace("__WORKLET_SRC__", json.dumps(ui_text("player_worklet.js")))
            .replace("__RESULT_CSS__", json.dumps(ui_text("player.css"))))
