"""Voices: the features of recent reference clips in memory, and saved voices on disk. Design notes: docs/design.md."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
import unicodedata
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Generic, TypeVar

import numpy as np
import safetensors.numpy
from safetensors import SafetensorError, safe_open

from app.audio import TOKEN_RATE_HZ
from app.message import Message
from app.model.frontend import VoiceFeatures

log = logging.getLogger(__name__)
NAME_RE = re.compile(r"\w[\w-]{0,63}")  # letters of any script, digits, _ and -; no dots, slashes, spaces
NAME_RULE = "1-64 letters, digits, '_' or '-' (no spaces, dots or slashes), starting with a letter or digit"
# one format for a stored voice and an exported one: safetensors, the arrays as tensors, the rest as
# str -> str metadata
FORMAT_NAME, FORMAT_VERSION, SUFFIX = "cosyvoice2-voice", 2, ".safetensors"
ARRAY_DTYPES = {"prompt_text_ids": np.dtype("<i4"), "speech_tokens": np.dtype("<i4"),
                "speech_mel": np.dtype("<f4"), "embedding": np.dtype("<f4")}


class VoiceError(ValueError):
    """A voice name is invalid, unknown, taken, or its files are unusable; the message says which (for people),
    `code` says it for the doors that pick a status or a reaction (never the message's words)."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        # invalid_name | invalid_transcript | not_found | exists | other_model | damaged
        # (VoiceFileError, app/service/voice_file.py, adds its own)
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
    owner: str = ""  # who saved it (app/service/owners.py); "" = saved before voices had owners

    def to_dict(self) -> dict:
        return asdict(self)


def voice_bytes(info: VoiceInfo, voice: VoiceFeatures, *, with_owner: bool = True) -> bytes:
    """`voice` as safetensors bytes, `info` in its metadata; the same voice gives the same bytes."""
    arrays = {k: np.ascontiguousarray(getattr(voice, k).cpu().numpy(), dtype=d) for k, d in ARRAY_DTYPES.items()}
    meta = {"format": FORMAT_NAME, "version": str(FORMAT_VERSION), "name": info.name, "prompt_text": voice.prompt_text,
            "prompt_seconds": repr(float(info.prompt_seconds)), "created": repr(float(info.created)),
            "model_fingerprint": info.model_fingerprint, **({"owner": info.owner} if with_owner else {})}
    raw = safetensors.numpy.save(arrays, metadata=meta)
    # the library writes its metadata map in a random order: sort it, so that one voice is one byte string
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    h = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return len(h).to_bytes(8, "little") + h + raw[8 + n:]


def check_name(name: str) -> str:
    """The NFC-normalised name if it is a valid voice name, else `VoiceError` naming the rule."""
    if not isinstance(name, str):
        raise VoiceError(f"a voice name must be text, got {type(name).__name__}", code="invalid_name")
    norm = unicodedata.normalize("NFC", name.strip())
    if not NAME_RE.fullmatch(norm) or norm.startswith(("_", "-")):
        raise VoiceError(Message("invalid_name", "invalid voice name {name!r}: use {rule}", name=name, rule=NAME_RULE),
                         code="invalid_name")
    return norm


T = TypeVar("T")  # what a ClipCache keeps


class ClipCache(Generic[T]):
    """LRU of what a clip gave (its features, its transcript) by (clip bytes, text); computed in a worker thread."""

    def __init__(self, size: int = 32) -> None:
        self.size = size
        self._items: OrderedDict[str, T] = OrderedDict()

    async def get(self, src: str | Path | bytes, text: str, compute: Callable[[str | Path | bytes, str], T]) -> T:
        """What `compute(src, text)` gives for `src` (a path or its bytes), computed on a miss only."""
        data = src if isinstance(src, bytes) else await asyncio.to_thread(Path(src).read_bytes)
        key = hashlib.sha256(data + b"\0" + text.encode("utf-8")).hexdigest()
        got = self._items.get(key)
        if got is None:  # the path (not the bytes) keeps the file's suffix for format errors
            got = await asyncio.to_thread(compute, src, text)
            self._items[key] = got
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        self._items.move_to_end(key)
        return got


class VoiceStore:
    """Saved voices in one folder. Thread-safe; every method may be called from worker threads."""

    def __init__(self, root: str | Path, model_fingerprint: str = "", *, owner: str = "",
                 max_transcript_chars: int | None = None, lock: threading.Lock | None = None) -> None:
        self.root = Path(root).expanduser().resolve()
        self.model_fingerprint = model_fingerprint  # "" = accept voices of any model
        self.owner = owner  # written into each voice saved here
        self.max_transcript_chars = max_transcript_chars  # [limits]; None: features came through prepare()'s check
        self._lock = lock or threading.Lock()

    def _path(self, name: str) -> Path:
        """`<name>.safetensors` in root (NAME_RE rules out separators and dots)."""
        return self.root / f"{check_name(name)}{SUFFIX}"

    # --- reading -------------------------------------------------------------------------------

    def list(self) -> list[VoiceInfo]:
        """Saved voices of this model, newest first (voices of other models are left out; none without a folder)."""
        fp = self.model_fingerprint
        infos = [i for p in self.root.glob(f"*{SUFFIX}") if (i := self._read_info(p))]
        return sorted((i for i in infos if not fp or i.model_fingerprint == fp), key=lambda v: (-v.created, v.name))

    def names(self) -> list[str]:
        return [v.name for v in self.list()]

    def _read_info(self, path: Path) -> VoiceInfo | None:
        try:  # the header only, not the arrays (its metadata is str -> str)
            with safe_open(path, framework="np") as f:
                m = f.metadata() or {}
            info = VoiceInfo(name=check_name(m["name"]), prompt_text=m["prompt_text"],
                             prompt_seconds=float(m["prompt_seconds"]), created=float(m["created"]),
                             model_fingerprint=m.get("model_fingerprint", ""), owner=m.get("owner", ""))
        except (OSError, ValueError, KeyError, SafetensorError):  # a field missing or bad (VoiceError: the name)
            return None  # a foreign or damaged file in the folder: not a voice
        return info if path.stem == info.name else None

    def info(self, name: str) -> VoiceInfo:
        info = self._read_info(self._path(name))  # None for a missing file too
        if info is None:
            raise VoiceError(Message("no_voice", "no saved voice named {name!r}", name=check_name(name)),
                             code="not_found")
        return info

    def load(self, name: str) -> VoiceFeatures:
        """The saved features of `name`; `VoiceError` if unknown, damaged or from another model."""
        info = self.info(name)
        if self.model_fingerprint and info.model_fingerprint != self.model_fingerprint:
            raise VoiceError(f"voice {info.name!r} was saved with another model; save it again from its recording",
                             code="other_model")
        try:
            arrays = safetensors.numpy.load_file(self._path(info.name))
            text = np.frombuffer(info.prompt_text.encode("utf-8"), dtype=np.uint8)
            return VoiceFeatures.from_arrays({**arrays, "prompt_text_utf8": text})
        except (OSError, ValueError, KeyError, AssertionError, SafetensorError) as e:
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
        info = VoiceInfo(name=name, prompt_text=voice.prompt_text,
                         prompt_seconds=round(voice.n_prompt_tokens / TOKEN_RATE_HZ, 2),
                         created=time.time() if created is None else created,
                         model_fingerprint=self.model_fingerprint, owner=self.owner)
        data = voice_bytes(info, voice)
        with self._lock:
            self.refuse_taken(name, overwrite)
            with self._writing():
                self.root.mkdir(parents=True, exist_ok=True)
                # atomic: a reader sees the old file or the new one, never half of it
                fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=SUFFIX)
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                    os.replace(tmp, self._path(name))
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
        return info

    def refuse_taken(self, name: str, overwrite: bool = False) -> None:
        if not overwrite and (path := self._path(name)).exists():
            raise VoiceError(Message("voice_exists", "a voice named {name!r} exists already; delete it first or choose "
                                     "another name", name=path.stem), code="exists")

    def delete(self, name: str) -> None:
        """Remove `name`; `VoiceError` if there is no such voice."""
        path = self._path(name)
        with self._lock:
            if not path.exists():
                raise VoiceError(Message("no_voice", "no saved voice named {name!r}", name=path.stem), code="not_found")
            with self._writing():
                path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """A write to the folder; its OSError (read-only, full, no permission) as VoiceError "unwritable",
        whose message names no path (the log line does, for the operator)."""
        try:
            yield
        except OSError as e:
            log.error("cannot write the voices folder %s: %s", self.root, e.strerror or type(e).__name__)
            raise VoiceError(Message("voices_unwritable", "saved voices cannot be changed now: the server cannot write "
                                     "its voices folder (voices saved before still work); try again later or tell "
                                     "the server's operator"), code="unwritable") from e
