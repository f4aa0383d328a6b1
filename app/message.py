"""A sentence for people that keeps its key and fields: its English is what API clients read; a person's page or
route gets it in their language by the key (`say`, app/messages.toml)."""

from __future__ import annotations

import functools
import tomllib
from pathlib import Path
from typing import Any

LANGS = ("en", "zh")


class Message(str):
    """`Message("text_too_long", "The text has {n} characters", n=9)` is the str "The text has 9 characters"
    (raise it, log it, send it as JSON), and keeps `key`, `template` and `fields` for a translation."""

    key: str
    template: str
    fields: dict[str, Any]

    def __new__(cls, key: str, template: str, **fields: Any) -> Message:
        self = super().__new__(cls, template.format(**fields))
        self.key, self.template, self.fields = key, template, fields
        return self

    def __getnewargs_ex__(self) -> tuple[tuple[str, str], dict[str, Any]]:  # pickling (the cluster's replicas)
        return (self.key, self.template), self.fields

    def replace(self, old: str, new: str, count: int = -1) -> Message:  # type: ignore[override]
        """The message with `old` replaced in its fields (e.g. a server path by its file name), key kept."""
        def sub(v: Any) -> Any:
            v = said(v) if isinstance(v, BaseException) else v
            return v.replace(old, new, count) if isinstance(v, str) else v
        return Message(self.key, self.template, **{k: sub(v) for k, v in self.fields.items()})


def said(e: BaseException) -> str:
    """What `e` says: the `Message` it was raised with (its key kept), else `str(e)`."""
    return e.args[0] if len(e.args) == 1 and isinstance(e.args[0], Message) else str(e)


def said_without(e: BaseException, path: object) -> str:
    """`said(e)` with the server path `path` (a str or Path; anything else: none) shown as its file name only:
    a server's paths are never echoed to clients."""
    msg = said(e)
    return msg.replace(str(path), Path(path).name) if isinstance(path, str | Path) and str(path) else msg


@functools.cache
def messages() -> dict[str, Any]:
    """app/messages.toml, read once: [messages] key -> {en, zh} templates, [titles] English -> Chinese."""
    return tomllib.loads(Path(__file__).with_name("messages.toml").read_text(encoding="utf-8"))


def lang_of(request: Any) -> str:
    """The language of `request` (a Starlette or Gradio request, or None): "zh" when its Accept-Language starts
    with Chinese, else "en" (what API clients without the header get)."""
    accept = (getattr(request, "headers", None) or {}).get("accept-language", "")
    return "zh" if accept.lower().lstrip().startswith("zh") else "en"


def say(message: object, lang: str) -> str:
    """A message in `lang`: a `Message`, or an exception raised with one, by its key's Chinese (messages.toml) for
    "zh", its fields said alike; else (English, an unknown key, any other text) as it is."""
    message = said(message) if isinstance(message, BaseException) else message
    zh = messages()["messages"].get(getattr(message, "key", None), {}).get("zh") if lang == "zh" else None
    if zh is None:
        return str(message)
    return zh.format(**{k: say(v, lang) if isinstance(v, Message | BaseException) else v
                        for k, v in message.fields.items()})
