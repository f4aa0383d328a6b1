"""The page's words in English and Chinese: labels (`gr.I18n`, which follows the browser's language) and the
server's lines by their key (`t`; `say` and `lang_of` live beside `Message` in app/message.py).
Design notes: docs/design.md."""

from __future__ import annotations

import functools
import tomllib
from typing import Any

import gradio as gr

from app.message import LANGS, lang_of, messages, say
from app.ui import ui_text

# lang_of and say are the page's too (from app/message.py)
__all__ = ["EXAMPLE_KEYS", "LANGS", "error", "example_label", "labels", "lang_of", "locale", "make_i18n", "say", "t",
           "title_in"]
EXAMPLE_KEYS = ("ex_en", "ex_zh", "ex_numbers", "ex_cross", "ex_instruct")


@functools.cache
def locale(name: str) -> dict[str, Any]:
    """app/ui/locales/<name>.toml (labels, panels, page), read once."""
    return tomllib.loads(ui_text(f"locales/{name}.toml"))


def labels(lang: str) -> dict[str, str]:
    """The page's labels (gr.I18n keys) in `lang` ("en" or "zh")."""
    return locale("labels")[lang]


def example_label(key: str) -> str:
    """An example's label in both languages, "English, zero-shot · 英文，零样本": Gradio translates no
    `gr.Examples` label (a gr.I18n text there shows as its key)."""
    return f"{labels('en')[key]} · {labels('zh')[key]}"


def make_i18n(extra: dict[str, dict[str, str]] | None = None) -> gr.I18n:
    """The studio's `gr.I18n`, with `extra` translations (e.g. the panels' labels) merged in."""
    return gr.I18n(**{lang: {**labels(lang), **(extra or {}).get(lang, {})} for lang in LANGS})


def title_in(title: str, lang: str) -> str:
    """A pop-up's title ("Busy", "Not ready", ...) in `lang`."""
    return messages()["titles"].get(title, title) if lang == "zh" else title


def t(lang: str, key: str, **fields: Any) -> str:
    """The message `key` in `lang`, its fields filled in."""
    return messages()["messages"][key]["zh" if lang == "zh" else "en"].format(**fields)


def error(message: object, lang: str, title: str = "Error") -> gr.Error:
    """A gr.Error with the message and its title in `lang`, no traceback in the log."""
    return gr.Error(say(message, lang), title=title_in(title, lang), print_exception=False)
