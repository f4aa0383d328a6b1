"""The low-latency player's Python side: its page element and the JS glue.

The browser part is `player.js` with `player_worker.js` (fetch + int16 -> float32) and
`player_worklet.js` (an AudioWorklet playing the samples back to back), fed by `POST /studio/speech`
(app/server/studio_stream.py): it plays raw PCM as it arrives, instead of Gradio's HLS/AAC path
(0.4-1.1 s slower to first sound). When the body has ended, the page builds the final WAV from the
PCM it played and fetches the stats line and details from `GET /studio/requests/{id}`; it shows
them in `PLAYER_HTML`'s result area, in place of the standard player's final WAV, stats and details
(the body's `data-studio-result` attribute, set per Generate click, says which of the two shows: `RESULT_CSS`).
Here: `PLAYER_HTML` (the timing line and the result area), `player_js()` (defines `window.studioPlayer`
on page load), `GATE_JS` (the Generate button: the low-latency player runs in the browser and the Gradio
`synthesize` event is skipped; the standard player passes on to it) and `STOP_JS`.
"""

from __future__ import annotations

import json
from pathlib import Path

UI_DIR = Path(__file__).parent

# the standard player's result components (elem_ids in layout.py): hidden while the player's result shows
STANDARD_RESULT_IDS = ("final_out", "stats", "details_box")
RESULT_CSS = (", ".join(f'body[data-studio-result="webaudio"] #{i}' for i in STANDARD_RESULT_IDS)
              + ' { display: none !important; }\n'
              'body:not([data-studio-result="webaudio"]) #player_result { display: none; }\n'
              '#player_result { padding: 4px 8px; }\n#player_result audio { width: 100%; }\n'
              '#player_result .studio-label { font-size: 0.85em; opacity: 0.75; margin-bottom: 2px; }\n'
              '#player_result pre { white-space: pre-wrap; font-size: 0.85em; }')
# player.js fills #player_final (<audio> + download link), #player_stats and #player_details_json
PLAYER_HTML = ('<div class="studio-player" style="padding: 2px 8px; font-variant-numeric: tabular-nums">'
               '<span id="studio_player_line">Low-latency player: ready (click → first byte → first sound '
               'appears here)</span></div>'
               '<div id="player_result"><div class="studio-label" id="player_final_label">Final WAV</div>'
               '<div id="player_final"></div><div id="player_stats" class="prose"></div>'
               '<details id="player_details"><summary id="player_details_label">Request details</summary>'
               '<pre id="player_details_json"></pre></details></div>')

# The Generate button's first event (js only). Gradio passes the input values in order (gr.Audio with
# type="filepath": its FileData {path, url, orig_name, ...} or null). A gate that throws ends the chain,
# so `.success(synthesize)` does not run: the low-latency player handles the request in the browser.
# Either way it says whose result the page shows (the standard outputs or the player's result area).
GATE_JS = """
(text, prompt_audio, prompt_text, mode, instruct_text, voice, seed, stream, player) => {
  const p = window.studioPlayer;
  if (p) p.stop();
  if (player !== 'webaudio' || !stream || !p) {
    document.body.dataset.studioResult = 'gradio';
    return [];
  }
  p.play({text: text || '', prompt_audio: prompt_audio ? (prompt_audio.path || null) : null,
          prompt_text: prompt_text || '', mode, instruct_text: instruct_text || '', voice: voice || '',
          seed: (seed === null || seed === '') ? null : Number(seed)});
  throw new Error('handled by the low-latency player');
}
"""
STOP_JS = "() => { if (window.studioPlayer) window.studioPlayer.stop(); return []; }"


def player_js() -> str:
    """The page-load JS that defines `window.studioPlayer`: player.js with the Worker and AudioWorklet
    sources and `RESULT_CSS` inlined as string literals (read when the page is built)."""
    def read(name: str) -> str:
        return (UI_DIR / name).read_text(encoding="utf-8")

    return (read("player.js").replace("__WORKER_SRC__", json.dumps(read("player_worker.js")))
            .replace("__WORKLET_SRC__", json.dumps(read("player_worklet.js")))
            .replace("__RESULT_CSS__", json.dumps(RESULT_CSS)))
