"""The page's words in English and Chinese: labels (`gr.I18n`), and messages said by their key (`say`).
Design notes: docs/design.md."""

from __future__ import annotations

import functools
import tomllib
from typing import Any

import gradio as gr

from app.message import Message, said
from app.ui import ui_text

LANG_COOKIE = "studio_lang"
LANGS = ("en", "zh")
EXAMPLE_KEYS = ("ex_en", "ex_zh", "ex_numbers", "ex_cross", "ex_instruct")


@functools.cache
def locale(name: str) -> dict[str, Any]:
    """app/ui/locales/<name>.toml (labels, messages, panels, page), read once."""
    return tomllib.loads(ui_text(f"locales/{name}.toml"))


def labels(lang: str) -> dict[str, str]:
    """The page's labels (gr.I18n keys) in `lang` ("en" or "zh")."""
    return locale("labels")[lang]


def make_i18n(extra: dict[str, dict[str, str]] | None = None) -> gr.I18n:
    """The studio's `gr.I18n`, with `extra` translations (e.g. the panels' labels) merged in."""
    return gr.I18n(**{lang: {**labels(lang), **(extra or {}).get(lang, {})} for lang in LANGS})


def title_in(title: str, lang: str) -> str:
    """A pop-up's title ("Busy", "Not ready", ...) in `lang`."""
    return locale("messages")["titles"].get(title, title) if lang == "zh" else title


def lang_of(request: Any) -> str:
    """The page's language for `request` (a gr.Request or None): the switch's cookie, else Accept-Language."""
    cookies = getattr(request, "cookies", None) or {}
    if cookies.get(LANG_COOKIE) in LANGS:
        return cookies[LANG_COOKIE]
    accept = (getattr(request, "headers", None) or {}).get("accept-language", "")
    return "zh" if accept.lower().lstrip().startswith("zh") else "en"


def t(lang: str, key: str, **fields: Any) -> str:
    """The message `key` in `lang`, its fields filled in."""
    return locale("messages")["messages"][key]["zh" if lang == "zh" else "en"].format(**fields)


def say(message: object, lang: str) -> str:
    """A message in `lang`: a `Message` (app/message.py), or an exception raised with one, by its key's Chinese
    (messages.toml) for "zh", its fields said alike; else (English, an unknown key, any other text) as it is."""
    message = said(message) if isinstance(message, BaseException) else message
    zh = locale("messages")["messages"].get(getattr(message, "key", None), {}).get("zh") if lang == "zh" else None
    if zh is None:
        return str(message)
    return zh.format(**{k: say(v, lang) if isinstance(v, Message | BaseException) else v
                        for k, v in message.fields.items()})


def error(message: object, lang: str, title: str = "Error") -> gr.Error:
    """A gr.Error with the message and its title in `lang`, no traceback in the log."""
    return gr.Error(say(message, lang), title=title_in(title, lang), print_exception=False)
