"""The page's words in English and Chinese: labels (`gr.I18n`), and the messages handlers return.

Design notes: docs/design.md.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import tomllib
import typing
from collections.abc import Callable, Iterator
from typing import Any

import gradio as gr

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


@functools.cache
def patterns(kind: str) -> list[tuple[re.Pattern[str], str]]:
    """(English regex, Chinese) of messages.toml's [patterns] `kind` ("messages" or "status"), in order."""
    return [(re.compile(en, re.S), zh) for en, zh in locale("messages")["patterns"][kind]]


def make_i18n(extra: dict[str, dict[str, str]] | None = None) -> gr.I18n:
    """The studio's `gr.I18n`, with `extra` translations (e.g. the panels' labels) merged in."""
    en, zh = dict(labels("en")), dict(labels("zh"))
    for lang, table in (extra or {}).items():
        {"en": en, "zh": zh}.get(lang, {}).update(table)
    return gr.I18n(en=en, zh=zh)


def status_text(status: str, lang: str) -> str:
    """The service's status in `lang` (unchanged for English or a status no pattern knows)."""
    return _match(status, patterns("status")) if lang == "zh" else status


def title_in(title: str, lang: str) -> str:
    """A pop-up's title ("Busy", "Not ready", ...) in `lang`."""
    return locale("messages")["titles"].get(title, title) if lang == "zh" else title


def lang_of(request: Any) -> str:
    """The page's language for `request` (a gr.Request or None): the switch's cookie, else Accept-Language."""
    if request is None:
        return "en"
    cookies = getattr(request, "cookies", None) or {}
    if cookies.get(LANG_COOKIE) in LANGS:
        return cookies[LANG_COOKIE]
    accept = (getattr(request, "headers", None) or {}).get("accept-language", "")
    return "zh" if accept.lower().lstrip().startswith("zh") else "en"


def t(lang: str, key: str, **fields: Any) -> str:
    """The message `key` in `lang`, its fields filled in."""
    return locale("messages")["messages"][key]["zh" if lang == "zh" else "en"].format(**fields)


def translate(message: str, lang: str) -> str:
    """An English message from the engine in `lang` (unchanged for English or a message no pattern knows)."""
    return named_modes(_match(message, patterns("messages"))) if lang == "zh" else message


def mode_names(lang: str) -> dict[str, str]:
    """Mode id -> its name in `lang`, as the page's Mode radio shows it ("zero_shot" -> "Zero-shot clone")."""
    return {k.removeprefix("mode_"): v for k, v in labels(lang).items() if k.startswith("mode_")}


def named_modes(text: str) -> str:
    """A translated line's mode id as the mode's Chinese name: "模式 zero_shot" -> "模式 零样本克隆" (the stats line
    and a stopped take's line; lang_load.js does the same in the browser)."""
    word, names = labels("zh")["mode"], mode_names("zh")
    return re.sub(rf"{word} (\w+)", lambda m: f"{word} {names.get(m[1], m[1])}", text)


def _match(text: str, table: list[tuple[re.Pattern[str], str]]) -> str:
    for pattern, zh in table:  # the first whole match wins
        if m := pattern.fullmatch(text.strip()):
            return m.expand(zh)
    return text


def error(message: str, lang: str, **kw: Any) -> gr.Error:
    """A gr.Error with the message in `lang` (the title too, unless given)."""
    kw.setdefault("title", t(lang, "error"))
    return gr.Error(translate(message, lang), print_exception=False, **kw)


@contextlib.contextmanager
def _relabeled(lang: str) -> Iterator[None]:  # a gr.Error raised inside, in `lang`
    try:
        yield
    except gr.Error as e:
        raise gr.Error(translate(e.message, lang), title=title_in(e.title, lang), print_exception=False) from e


def localized(fn: Callable) -> Callable:
    """Handler `fn` (sync, async or an async generator) whose gr.Error and returned messages are in the page's
    language: Gradio passes the wrapper a gr.Request (appended to `fn`'s parameters unless it has one)."""
    sig = inspect.signature(fn)
    own = "request" in sig.parameters
    params = list(sig.parameters.values())
    if not own:
        params.append(inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                        annotation=gr.Request))

    def split(args: tuple, kwargs: dict) -> tuple[tuple, dict, str]:
        bound = inspect.Signature(params).bind(*args, **kwargs)
        request = bound.arguments.get("request")
        if not own:
            bound.arguments.pop("request", None)
        return bound.args, bound.kwargs, lang_of(request)

    def out(value: Any, lang: str) -> Any:
        if isinstance(value, str):
            return translate(value, lang)
        return tuple(out(v, lang) for v in value) if isinstance(value, tuple) else value

    if inspect.isasyncgenfunction(fn):
        async def wrapper(*args: Any, **kwargs: Any):
            args, kwargs, lang = split(args, kwargs)
            with _relabeled(lang):
                async for item in fn(*args, **kwargs):
                    yield item
    elif inspect.iscoroutinefunction(fn):
        async def wrapper(*args: Any, **kwargs: Any):
            args, kwargs, lang = split(args, kwargs)
            with _relabeled(lang):
                return out(await fn(*args, **kwargs), lang)
    else:
        def wrapper(*args: Any, **kwargs: Any):
            args, kwargs, lang = split(args, kwargs)
            with _relabeled(lang):
                return out(fn(*args, **kwargs), lang)
    functools.update_wrapper(wrapper, fn)
    del wrapper.__wrapped__  # Gradio reads the signature below, not fn's
    wrapper.__signature__ = sig.replace(parameters=params)
    try:  # resolved here: the wrapper's module cannot resolve fn's string annotations
        hints = typing.get_type_hints(fn)
    except (NameError, TypeError):
        hints = {}
    wrapper.__annotations__ = {**hints, "request": gr.Request}
    return wrapper
