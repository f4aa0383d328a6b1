"""The page's language switch: the labels (gr.I18n texts sent as updates), the `studio_lang` cookie, the
players' own lines. Design notes: docs/design.md."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable

import gradio as gr
from gradio.i18n import I18nData

from app.ui import ui_text
from app.ui.i18n import EXAMPLE_KEYS, LANG_COOKIE, LANGS, labels, locale

# the elements whose text the page's own players write (player.js, player.html), and gr.Examples' labels
PAGE_IDS = ("studio_player_line", "studio_busy", "player_pause", "examples")
TEXT_PROPS = ("label", "info", "placeholder", "value")  # the props a gr.I18n text may fill (a Button's: value)


def relabeler(demo: gr.Blocks, i18n: gr.I18n) -> tuple[list[gr.blocks.Block], Callable[[str], list[dict]]]:
    """The page's components that show `i18n`'s texts, and the function giving their `gr.update`s in a language.
    The server resolves the texts, so no import of Gradio's frontend locale is needed; Gradio's own words
    (upload areas, footer) stay in the browser's language."""
    tables = i18n.translations_dict
    keys = {k for table in tables.values() for k in table}
    as_str = {str(I18nData(k)): k for k in keys}  # a Button's or Markdown's value keeps the text's str form

    def key(v: object) -> str | None:
        return v.key if isinstance(v, I18nData) else as_str.get(v) if isinstance(v, str) else None

    found: list[tuple[gr.blocks.Block, dict[str, str], list[tuple] | None]] = []  # (block, prop -> key, choices)
    for block in demo.blocks.values():
        props = {p: k for p in TEXT_PROPS if (k := key(getattr(block, p, None)))}
        choices = getattr(block, "choices", None)
        named = [(key(c[0]), *c) for c in choices] if isinstance(choices, list) and any(
            isinstance(c, tuple) and key(c[0]) for c in choices) else None  # (key or None, label, value)
        if props or named:
            found.append((block, props, named))

    def relabel(lang: str) -> list[dict]:
        table = {**tables.get("en", {}), **tables.get(lang if lang in LANGS else "en", {})}  # missing: English
        return [gr.update(**{p: table[k] for p, k in props.items()},
                          **({"choices": [(table.get(k, c), v) for k, c, v in named]} if named else {}))
                for _, props, named in found]

    return [block for block, _, _ in found], relabel


def lang_switch_js() -> str:
    """The switch's JS: the language set (the cookie, the page's lines); returns it for `relabel`."""
    return ui_text("lang_set.js").replace("__COOKIE__", LANG_COOKIE)


def lang_load_js() -> str:
    """demo.load's JS: the page translator, a language chosen earlier (its cookie) applied again, the switch set."""
    # English -> Chinese of what the page's players write, and gr.Examples' labels (Gradio does not translate them)
    phrases = {**locale("page")["phrases"], **{labels("en")[k]: labels("zh")[k] for k in EXAMPLE_KEYS}}
    phrases = sorted(phrases.items(), key=lambda kv: -len(kv[0]))  # longest first
    dump = functools.partial(json.dumps, ensure_ascii=False)
    return (ui_text("lang_load.js").replace("__SET_LANG__", lang_switch_js()).replace("__COOKIE__", LANG_COOKIE)
            .replace("__IDS__", dump(PAGE_IDS)).replace("__PHRASES__", dump(phrases))
            .replace("__UNITS__", dump(list(locale("page")["units"].items()))))
