"""A sentence for people that keeps its key and fields: its English is what API clients read; the page renders
it in its language by the key (app/ui/i18n.py `say`, app/ui/locales/messages.toml)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
