"""The page's language switch, in the browser: Gradio's locale, the `studio_lang` cookie, the players' lines.

Design notes: docs/design.md.
"""

from __future__ import annotations

import functools
import json
import re

from app.ui import ui_text
from app.ui.i18n import EXAMPLE_KEYS, LANG_COOKIE, labels, locale, mode_names, patterns

# the elements whose text the page's own players write (player.js, player.html), and gr.Examples' labels
PAGE_IDS = ("studio_player_line", "studio_busy", "studio_error", "player_pause", "stats", "examples")


def page_phrases() -> dict[str, str]:
    """English -> Chinese of what the page's players write, and gr.Examples' labels (Gradio does not translate
    them)."""
    en, zh = labels("en"), labels("zh")
    return {**locale("page")["phrases"], **{en[k]: zh[k] for k in EXAMPLE_KEYS}}


def _set_lang_js() -> str:
    return ui_text("lang_set.js").replace("__COOKIE__", LANG_COOKIE)


def lang_switch_js() -> str:
    """The switch's JS: the language set (Gradio's locale, the cookie, the page's lines); returns it."""
    return f"(lang) => {{ ({_set_lang_js()})(lang); return lang; }}"


def lang_load_js() -> str:
    """demo.load's JS: the page translator, a language chosen earlier (its cookie) applied again, the switch set."""
    regexes = [[p.pattern, re.sub(r"\\(\d)", r"$\1", zh)] for p, zh in patterns("messages")]  # groups: $1 in JS
    phrases = sorted(page_phrases().items(), key=lambda kv: -len(kv[0]))  # longest first
    modes = [labels("zh")["mode"], mode_names("zh")]  # "模式 zero_shot" -> "模式 零样本克隆" (i18n.named_modes)
    dump = functools.partial(json.dumps, ensure_ascii=False)
    return (ui_text("lang_load.js").replace("__SET_LANG__", _set_lang_js()).replace("__COOKIE__", LANG_COOKIE)
            .replace("__IDS__", dump(PAGE_IDS)).replace("__PHRASES__", dump(phrases))
            .replace("__UNITS__", dump(list(locale("page")["units"].items())))
            .replace("__MODES__", dump(modes)).replace("__PATTERNS__", dump(regexes)))
