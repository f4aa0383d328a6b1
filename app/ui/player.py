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
`synthesize` event is skipped; the standard player passes on to it), `STOP_JS`, `STATUS_HTML` (busy line
and errors next to Generate), `IDLE_JS` and `FAILURE_JS` (the standard player's end and error).
"""

from __future__ import annotations

import json
from pathlib import Path

UI_DIR = Path(__file__).parent

# the standard player's components (elem_ids in layout.py): hidden while the low-latency player's result
# shows (its own live controls stand in for the "Live audio" box)
STANDARD_RESULT_IDS = ("stream_out", "final_out", "stats", "details_box")
RESULT_CSS = (", ".join(f'body[data-studio-result="webaudio"] #{i}' for i in STANDARD_RESULT_IDS)
              + ' { display: none !important; }\n'
              'body:not([data-studio-result="webaudio"]) #player_result { display: none; }\n'
              '#player_result { padding: 4px 8px; }\n#player_result audio { width: 100%; }\n'
              '#player_result .studio-label { font-size: 0.85em; opacity: 0.75; margin-bottom: 2px; }\n'
              '#player_result pre { white-space: pre-wrap; font-size: 0.85em; }\n'
              # the low-latency player's controls (pause, volume, progress), shown while it plays
              'body:not([data-studio-result="webaudio"]) #player_controls { display: none; }\n'
              '#player_controls { display: flex; gap: 8px; align-items: center; padding: 4px 8px; }\n'
              '#player_controls progress { flex: 1; }\n'
              # busy state and errors next to Generate (both players); the pop-up of the low-latency player
              'body[data-studio-busy="1"] #go { opacity: 0.7; cursor: progress; }\n'
              '#studio_busy { display: none; }\nbody[data-studio-busy="1"] #studio_busy { display: inline; }\n'
              '#studio_error { color: var(--error-text-color, #b91c1c); font-weight: 600; }\n'
              '#studio_error:empty { display: none; }\n'
              '#studio_toast { position: fixed; top: 16px; right: 16px; z-index: 1000; max-width: 420px; '
              'padding: 10px 14px; border-radius: 8px; border: 1px solid #f87171; background: #fef2f2; '
              'color: #991b1b; box-shadow: 0 4px 12px rgba(0,0,0,.15); }\n#studio_toast[hidden] { display: none; }')
# player.js fills #player_final (<audio> + download link), #player_stats and #player_details_json, and
# drives #player_controls: pause/resume, volume, played / received seconds
PLAYER_HTML = ('<div class="studio-player" style="padding: 2px 8px; font-variant-numeric: tabular-nums">'
               '<span id="studio_player_line">Low-latency player: ready (click → first byte → first sound '
               'appears here)</span></div>'
               '<div id="player_controls"><button id="player_pause" type="button" disabled>⏸ Pause</button>'
               '<label>🔊 <input id="player_volume" type="range" min="0" max="1" step="0.05" value="1"></label>'
               '<progress id="player_progress" max="1" value="0"></progress>'
               '<span id="player_time">0.00 / 0.00 s</span></div>'
               '<div id="player_result"><div class="studio-label" id="player_final_label">Final WAV</div>'
               '<div id="player_final"></div><div id="player_stats" class="prose"></div>'
               '<details id="player_details"><summary id="player_details_label">Request details</summary>'
               '<pre id="player_details_json"></pre></details></div>')

# next to Generate: the busy line and the latest error of either player (player.js: setBusy, showError)
STATUS_HTML = ('<div id="studio_status"><span id="studio_busy">⏳ Generating…</span>'
               '<div id="studio_error" role="alert"></div></div>')

# The Generate button's first event (js only). Gradio passes the input values in order (gr.Audio with
# type="filepath": its FileData {path, url, orig_name, ...} or null). A gate that throws ends the chain,
# so `.success(synthesize)` does not run: the low-latency player handles the request in the browser.
# Either way it says whose result the page shows (the standard outputs or the player's result area).
GATE_JS = """
(text, prompt_audio, prompt_text, mode, instruct_text, voice, seed, stream, player) => {
  const p = window.studioPlayer;
  if (p) { p.stop(); p.begin(); }  // the previous take's error line goes, the page is busy
  delete document.body.dataset.studioStopped;
  for (const a of document.querySelectorAll('#stream_out audio')) a.muted = false;  // muted by Stop
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
# Stop: the low-latency player stops; the standard player's <audio> pauses now, muted, and may not start
# again until the next Generate (hls.js resumes on a late segment otherwise: player.js pauses it again);
# the page is no longer busy
STOP_JS = """() => {
  document.body.dataset.studioStopped = '1';
  for (const a of document.querySelectorAll('#stream_out audio')) { a.muted = true; a.pause(); }
  if (window.studioPlayer) { window.studioPlayer.stop(true); window.studioPlayer.setBusy(false); }
  return [];
}"""
# the standard player's `synthesize` ended (either way): the page is no longer busy
IDLE_JS = "() => { if (window.studioPlayer) window.studioPlayer.setBusy(false); return []; }"
# the standard player's `synthesize` failed: Gradio shows its pop-up; its message also goes next to Generate
FAILURE_JS = r"""() => {
  const p = window.studioPlayer;
  if (p) p.setBusy(false);
  setTimeout(() => {
    const toasts = [...document.querySelectorAll('.toast-body')].filter((t) => /error/i.test(t.className));
    const last = toasts.length ? toasts[toasts.length - 1] : null;
    const body = last ? last.querySelector('.toast-message-text, .toast-text') : null;
    const text = body ? body.innerText.trim() : (last ? last.innerText.replace(/^\s*Error\s*×?\s*/, '').trim()
                                                      : 'The request failed.');
    if (p) p.showError(text, false);
  }, 300);  // once the pop-up is drawn
  return [];
}"""


def player_js() -> str:
    """The page-load JS that defines `window.studioPlayer`: player.js with player_page.js inlined as code, and
    the Worker and AudioWorklet sources and `RESULT_CSS` as string literals (read when the page is built)."""
    def read(name: str) -> str:
        return (UI_DIR / name).read_text(encoding="utf-8")

    return (read("player.js").replace("__PAGE_SRC__", read("player_page.js"))
            .replace("__WORKER_SRC__", json.dumps(read("player_worker.js")))
            .replace("__WORKLET_SRC__", json.dumps(read("player_worklet.js")))
            .replace("__RESULT_CSS__", json.dumps(RESULT_CSS)))
