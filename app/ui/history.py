"""The history of takes on the page: a section below the outputs, kept in the visitor's browser.
Design notes: docs/design.md."""

from __future__ import annotations

import json

import gradio as gr

from app.ui import hidden_element, ui_text
from app.ui.i18n import LANGS, labels

# history.js draws the list, the status line and the Clear button's text
HISTORY_HTML = ('<div id="history"><div id="history_status" class="prose"></div><div id="history_list"></div>'
                '<button id="history_clear" type="button" disabled>Clear history</button></div>')
# a take, after its event succeeded: its final WAV (FileData), details and stats line
RECORD_JS = ("(final, details, stats) => { if (window.studioHistory) window.studioHistory.fromTake(final, details, "
             "stats); return []; }")
MODES = ("mode_zero_shot", "mode_cross_lingual", "mode_instruct")
# "Use these settings": history.js sets the hidden #history_use element's value (a take's settings, JSON; `at`
# makes every click a change) and its change event returns them into the inputs (a streamed take's speed is 1)
USE_JS = "window.studioUse = (s) => { props.value = JSON.stringify({...s, at: Date.now()}); };"
SETTINGS_JS = ("(v, seed) => { const s = JSON.parse(v || '{}'); return [s.text || '', !!s.dialogue, s.mode, "
               "s.instruct || '', s.seed ?? seed, !!s.stream, s.stream ? 1 : (s.speed || 1)]; }")


def history_box(i18n: gr.I18n) -> gr.HTML:
    """The "History" accordion (history.js fills it); returns the hidden element "Use these settings" goes through."""
    use = hidden_element("history_use", USE_JS)
    with gr.Accordion(i18n("history"), open=True, elem_id="history_box"):
        gr.HTML(HISTORY_HTML, elem_id="history_html", js_on_load=None)
    return use


def history_labels() -> dict[str, dict[str, str]]:
    """history.js's words per language: the `history_*` labels without the prefix, and the modes' names."""
    return {lang: {**{k.removeprefix("history_"): v for k, v in labels(lang).items() if k.startswith("history_")},
                   **{k: labels(lang)[k] for k in MODES}} for lang in LANGS}


def history_js() -> str:
    """The page-load JS that defines `window.studioHistory` (history.js with its words and words.js inlined)."""
    return (ui_text("history.js").replace("__LABELS__", json.dumps(history_labels(), ensure_ascii=False))
            .replace("__WORDS_VIEW_SRC__", ui_text("words.js")))
