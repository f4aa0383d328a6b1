"""Saved voices as files (`.cvvoice`): export a voice from one deployment, import it into another.
The file is the store's safetensors format (app/service/voices.py). Design notes: docs/design.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import unicodedata

import numpy as np
import safetensors.numpy
from safetensors import SafetensorError

from app.audio import MAX_PROMPT_SECONDS, MEL_FRAMES_PER_TOKEN, N_MELS, TOKEN_RATE_HZ
from app.message import Message
from app.model.frontend import VoiceFeatures
from app.model.llm import SPEECH_TOKEN_SIZE
from app.model.onnx_models import SPEAKER_EMBED_DIM
from app.service.voices import (
    ARRAY_DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    VoiceError,
    VoiceInfo,
    VoiceStore,
    voice_bytes,
)

SUFFIX, MEDIA_TYPE = ".cvvoice", "application/octet-stream"
MAX_PROMPT_TOKENS = int(MAX_PROMPT_SECONDS * TOKEN_RATE_HZ)  # 750: the speech tokenizer takes at most 30 s
TEXT_VOCAB_ROWS = 151_936  # rows of the LM's text embedding (Qwen2-0.5B): an id past it would index outside
REDO = "export it again from the server that has the voice"


class VoiceFileError(VoiceError):
    """A voice file cannot be imported; the message says why, `code` says it for the API."""

    def __init__(self, message: str, code: str = "invalid_voice_file") -> None:
        super().__init__(message, code=code)  # invalid_voice_file | other_model | file_too_large | not_ready


def export_voice(store: VoiceStore, name: str) -> tuple[VoiceInfo, bytes]:
    """(info, `.cvvoice` bytes) of `store`'s voice `name`; `VoiceError` if unknown, damaged or of another model.
    The bytes are the store's format without the owner (the importer becomes the owner)."""
    info = store.info(name)
    return info, voice_bytes(info, store.load(name), with_owner=False)


def import_voice(store: VoiceStore, data: bytes, *, max_bytes: int, name: str | None = None,
                 overwrite: bool = False) -> VoiceInfo:
    """Save the voice in `data` (a `.cvvoice` file) into `store`, under `name` or the file's; nothing is written
    unless every check passes. `VoiceFileError` for the file, `VoiceError` for the name (invalid, or taken
    without `overwrite`)."""
    if not store.model_fingerprint:
        raise VoiceFileError(Message("voice_file_not_ready", "the voice file cannot be checked yet: the model is still "
                                     "loading; try again in a moment"), code="not_ready")
    info, features = read_voice_file(data, store.model_fingerprint, max_bytes=max_bytes)
    created = min(info.created, time.time())  # a file's future date would keep it atop every listing
    return store.save(name or info.name, features, overwrite=overwrite, created=created)


def read_voice_file(data: bytes, model_fingerprint: str, *, max_bytes: int) -> tuple[VoiceInfo, VoiceFeatures]:
    """The checked voice in `data` (its info's name as the file says, not yet checked: the importer may rename
    it); `VoiceFileError` saying what is wrong. `model_fingerprint`: this deployment's (a voice only works with
    the model whose tokenizers made it)."""
    if len(data) > max_bytes:
        raise VoiceFileError(Message("voice_file_too_large", "the voice file is larger than {mb:g} MB ([limits] "
                                     "max_upload_mb); a real one is under 1 MB: is it a .cvvoice file?",
                                     mb=max_bytes / (1 << 20)), code="file_too_large")
    if not data:
        raise VoiceFileError(Message("voice_file_bad", "the voice file {why}", why="is empty"))
    if data[:4] == b"PK\3\4":  # version 1, a zip of .npy files (written 2026-12-03 to 12-04 only)
        raise VoiceFileError(f"the voice file has format version 1, which is not supported any more; {REDO}")
    info, arrays = _read(data)
    got = info.model_fingerprint
    if got != model_fingerprint:
        raise VoiceFileError(Message("voice_file_other_model", "the voice file was made with another model "
                                     "(fingerprint {got!r}; this server's is {ours!r}): a voice works only with "
                                     "the model that made it. Save it again here from its recording", got=got[:32],
                                     ours=model_fingerprint), code="other_model")
    _check_arrays(arrays, info.prompt_text, info.prompt_seconds)
    text = np.frombuffer(info.prompt_text.encode("utf-8"), dtype=np.uint8)
    return info, VoiceFeatures.from_arrays({**arrays, "prompt_text_utf8": text})


def _read(data: bytes) -> tuple[VoiceInfo, dict[str, np.ndarray]]:
    """(checked info, arrays) of a safetensors voice file. The library checks the header against the bytes,
    and that the metadata is str -> str (a lone surrogate in it is not valid JSON there)."""
    try:
        arrays = safetensors.numpy.load(data)
        meta = json.loads(data[8:8 + int.from_bytes(data[:8], "little")]).get("__metadata__") or {}
    except (SafetensorError, ValueError, TypeError, RecursionError) as e:  # cut short, not safetensors, ...
        raise VoiceFileError(Message("voice_file_bad", "the voice file {why}", why=f"is not a readable .cvvoice file "
                                     f"({str(e)[:120]}); it may be cut short: {REDO}")) from e
    if set(arrays) != set(ARRAY_DTYPES):
        raise VoiceFileError(f"the voice file holds the arrays {sorted(arrays)[:8]}; a .cvvoice file holds exactly "
                             f"{sorted(ARRAY_DTYPES)}")
    for k, a in arrays.items():
        if a.dtype != ARRAY_DTYPES[k]:
            raise VoiceFileError(f"the voice file's {k} holds {a.dtype.str}; expected {ARRAY_DTYPES[k].str}")
    if meta.get("format") != FORMAT_NAME:
        raise VoiceFileError(Message("voice_file_bad", "the voice file {why}", why="is not a CosyVoice2 Studio voice "
                                     f"(its format is not {FORMAT_NAME!r})"))
    v = meta.get("version")
    version = int(v) if v and v.isdecimal() and len(v) < 9 else v
    if version != FORMAT_VERSION:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        raise VoiceFileError(Message("voice_file_version", "the voice file has format version {got}; this server reads "
                                     "version {version}{advice}", got=json.dumps(version)[:20], version=FORMAT_VERSION,
                                     advice="; update the server" if newer else ""))
    for key in ("prompt_seconds", "created"):
        with contextlib.suppress(TypeError, ValueError):  # None (missing) or not a number: refused below
            meta[key] = float(meta.get(key))
    fields = {"name": str, "prompt_text": str, "model_fingerprint": str, "prompt_seconds": float, "created": float}
    for key, kind in fields.items():
        if not isinstance(meta.get(key), kind) or (kind is float and not 0 <= meta[key] < math.inf):  # NaN too
            raise VoiceFileError(f"the voice file has no valid {key!r} "
                                 f"({'a number >= 0' if kind is float else kind.__name__} expected); {REDO}")
    return VoiceInfo(**{k: meta[k] for k in fields}), arrays


def _check_arrays(a: dict[str, np.ndarray], prompt_text: str, prompt_seconds: float) -> None:
    """Shapes, ranges and finiteness of the four arrays, as the LM and the flow index and read them."""
    tokens, mel, emb, ids = a["speech_tokens"], a["speech_mel"], a["embedding"], a["prompt_text_ids"]
    n = tokens.shape[1] if tokens.ndim == 2 and tokens.shape[0] == 1 else -1  # P
    problems = []
    if not 1 <= n <= MAX_PROMPT_TOKENS:
        problems.append(f"speech_tokens has shape {list(tokens.shape)[:8]}, expected [1, P] with 1 <= P <= "
                        f"{MAX_PROMPT_TOKENS}")
    elif tokens.min() < 0 or tokens.max() >= SPEECH_TOKEN_SIZE:
        problems.append(f"speech_tokens holds ids outside 0..{SPEECH_TOKEN_SIZE - 1}")
    elif abs(prompt_seconds - round(n / TOKEN_RATE_HZ, 2)) > 0.006:
        problems.append(f"prompt_seconds is {prompt_seconds}, its {n} speech tokens last {n / TOKEN_RATE_HZ:.2f} s")
    if n >= 1 and mel.shape != (1, MEL_FRAMES_PER_TOKEN * n, N_MELS):
        problems.append(f"speech_mel has shape {list(mel.shape)[:8]}, expected [1, {MEL_FRAMES_PER_TOKEN * n}, "
                        f"{N_MELS}]")
    if emb.shape != (1, SPEAKER_EMBED_DIM):
        problems.append(f"embedding has shape {list(emb.shape)[:8]}, expected [1, {SPEAKER_EMBED_DIM}]")
    for k in ("speech_mel", "embedding"):
        if not np.isfinite(a[k]).all():
            problems.append(f"{k} holds NaN or infinite values")
    # each text token spells at least one byte of the transcript (the tokenizer sees it NFC-normalised)
    n_bytes = max(len(t.encode("utf-8")) for t in (prompt_text, unicodedata.normalize("NFC", prompt_text)))
    if ids.ndim != 1 or ids.shape[0] > n_bytes:
        problems.append(f"prompt_text_ids has shape {list(ids.shape)[:8]}, expected [L] with L <= {n_bytes}")
    elif ids.size and (ids.min() < 0 or ids.max() >= TEXT_VOCAB_ROWS):
        problems.append(f"prompt_text_ids holds ids outside 0..{TEXT_VOCAB_ROWS - 1}")
    if problems:
        raise VoiceFileError(f"the voice file's features are not a voice of this model: {'; '.join(problems)}")
