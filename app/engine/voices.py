"""Voices: the features of recent reference clips in memory, and saved voices on disk.

Design notes: docs/design.md.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import re
import tempfile
import threading
import time
import unicodedata
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from app.audio import TOKEN_RATE_HZ
from app.model.frontend import VoiceFeatures

NAME_RE = re.compile(r"\w[\w-]{0,63}")  # letters of any script, digits, _ and -; no dots, slashes, spaces
NAME_RULE = "1-64 letters, digits, '_' or '-' (no spaces, dots or slashes), starting with a letter or digit"


class VoiceError(ValueError):
    """A voice name is invalid, unknown, taken, or its files are unusable; the message says which (for people),
    `code` says it for the doors that pick a status or a reaction (never the message's words)."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        # invalid_name | invalid_transcript | not_found | exists | other_model | damaged
        # (VoiceFileError, app/engine/voice_file.py, adds its own)
        self.code = code

    def __reduce__(self):  # unpickling calls type(self)(*args): code is keyword-only, so pass it along
        return functools.partial(type(self), code=self.code), self.args


@dataclass(frozen=True)
class VoiceInfo:
    """What the store knows about a saved voice without loading its arrays."""

    name: str
    prompt_text: str
    prompt_seconds: float  # length of the reference, from its speech tokens (25 Hz)
    created: float  # unix time
    model_fingerprint: str
    owner: str = ""  # who saved it (app/engine/owners.py); "" = saved before voices had owners

    def to_dict(self) -> dict:
        return asdict(self)


def check_name(name: str) -> str:
    """The NFC-normalised name if it is a valid voice name, else `VoiceError` naming the rule."""
    if not isinstance(name, str):
        raise VoiceError(f"a voice name must be text, got {type(name).__name__}", code="invalid_name")
    norm = unicodedata.normalize("NFC", name.strip())
    if not NAME_RE.fullmatch(norm) or norm.startswith(("_", "-")):
        raise VoiceError(f"invalid voice name {name!r}: use {NAME_RULE}", code="invalid_name")
    return norm


class VoiceFeatureCache:
    """LRU of `VoiceFeatures` by (clip bytes, transcript); the frontend runs in a worker thread."""

    def __init__(self, size: int = 32) -> None:
        self.size = size
        self._items: OrderedDict[str, VoiceFeatures] = OrderedDict()

    async def get(self, src: str | Path | bytes, prompt_text: str,
                  compute: Callable[[str | Path | bytes, str], VoiceFeatures]) -> VoiceFeatures:
        """The features of `src` (a path or its bytes), from `compute(src, prompt_text)` on a miss."""
        data = src if isinstance(src, bytes) else await asyncio.to_thread(Path(src).read_bytes)
        key = hashlib.sha256(data + b"\0" + prompt_text.encode("utf-8")).hexdigest()
        voice = self._items.get(key)
        if voice is None:  # the path (not the bytes) keeps the file's suffix for format errors
            voice = await asyncio.to_thread(compute, src, prompt_text)
            self._items[key] = voice
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        self._items.move_to_end(key)
        return voice


class VoiceStore:
    """Saved voices in one folder. Thread-safe; every method may be called from worker threads."""

    def __init__(self, root: str | Path, model_fingerprint: str = "", *, owner: str = "",
                 max_transcript_chars: int | None = None, lock: threading.Lock | None = None) -> None:
        self.root = Path(root).expanduser().resolve()
        self.model_fingerprint = model_fingerprint  # "" = accept voices of any model
        self.owner = owner  # written into each voice saved here
        self.max_transcript_chars = max_transcript_chars  # [limits]; None: features came through prepare()'s check
        self._lock = lock or threading.Lock()

    def _paths(self, name: str) -> tuple[Path, Path]:
        name = check_name(name)
        npz, meta = self.root / f"{name}.npz", self.root / f"{name}.json"
        # belt and braces: NAME_RE already rules out separators and dots
        if npz.parent != self.root or meta.parent != self.root:
            raise VoiceError(f"invalid voice name {name!r}: use {NAME_RULE}", code="invalid_name")
        return npz, meta

    # --- reading -------------------------------------------------------------------------------

    def list(self) -> list[VoiceInfo]:
        """Saved voices of this model, newest first (voices of other models are left out)."""
        if not self.root.is_dir():
            return []
        out = []
        for meta in self.root.glob("*.json"):
            info = self._read_info(meta)
            if info is None or not (self.root / f"{info.name}.npz").is_file():
                continue
            if self.model_fingerprint and info.model_fingerprint != self.model_fingerprint:
                continue
            out.append(info)
        return sorted(out, key=lambda v: (-v.created, v.name))

    def names(self) -> list[str]:
        return [v.name for v in self.list()]

    def _read_info(self, meta: Path) -> VoiceInfo | None:
        try:
            d = json.loads(meta.read_text(encoding="utf-8"))
            info = VoiceInfo(name=check_name(d["name"]), prompt_text=str(d["prompt_text"]),
                             prompt_seconds=float(d["prompt_seconds"]), created=float(d["created"]),
                             model_fingerprint=str(d.get("model_fingerprint", "")), owner=str(d.get("owner", "")))
        except (OSError, ValueError, KeyError, TypeError):
            return None  # a foreign or damaged file in the folder: not a voice
        return info if meta.stem == info.name else None

    def info(self, name: str) -> VoiceInfo:
        _, meta = self._paths(name)
        info = self._read_info(meta) if meta.is_file() else None
        if info is None:
            raise VoiceError(f"no saved voice named {check_name(name)!r}", code="not_found")
        return info

    def load(self, name: str) -> VoiceFeatures:
        """The saved features of `name`; `VoiceError` if unknown, damaged or from another model."""
        npz, _ = self._paths(name)
        info = self.info(name)
        if self.model_fingerprint and info.model_fingerprint != self.model_fingerprint:
            raise VoiceError(f"voice {info.name!r} was saved with another model; save it again from its recording",
                             code="other_model")
        try:
            with np.load(npz, allow_pickle=False) as z:
                return VoiceFeatures.from_arrays({k: z[k] for k in z.files})
        except (OSError, ValueError, KeyError, AssertionError) as e:
            raise VoiceError(f"voice {info.name!r} is damaged ({e}); delete it and save it again",
                             code="damaged") from e

    # --- writing -------------------------------------------------------------------------------

    def save(self, name: str, voice: VoiceFeatures, *, overwrite: bool = False,
             created: float | None = None) -> VoiceInfo:
        """Store `voice` under `name` (atomically); `VoiceError` if the name is invalid or taken. `created`:
        the unix time to record (an imported voice keeps its own), else now."""
        name = check_name(name)
        limit = self.max_transcript_chars
        if limit is not None and len(voice.prompt_text) > limit:
            raise VoiceError(f"the transcript is longer than {limit} characters ([limits] max_transcript_chars)",
                             code="invalid_transcript")
        npz, meta = self._paths(name)
        info = VoiceInfo(name=name, prompt_text=voice.prompt_text,
                         prompt_seconds=round(voice.n_prompt_tokens / TOKEN_RATE_HZ, 2),
                         created=time.time() if created is None else created,
                         model_fingerprint=self.model_fingerprint, owner=self.owner)
        with self._lock:
            if meta.exists() and not overwrite:
                raise VoiceError(f"a voice named {name!r} exists already; delete it first or choose another name",
                                 code="exists")
            self.root.mkdir(parents=True, exist_ok=True)
            self._atomic_write(npz, lambda f: np.savez(f, **voice.to_arrays()))
            self._atomic_write(meta, lambda f: f.write(json.dumps(info.to_dict(), ensure_ascii=False).encode()))
        return info

    def delete(self, name: str) -> None:
        """Remove `name`; `VoiceError` if there is no such voice."""
        npz, meta = self._paths(name)
        with self._lock:
            if not meta.exists() and not npz.exists():
                raise VoiceError(f"no saved voice named {check_name(name)!r}", code="not_found")
            meta.unlink(missing_ok=True)  # unlisted first, then the arrays
            npz.unlink(missing_ok=True)

    def _atomic_write(self, path: Path, write) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=path.suffix)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
