"""The one door to a caller's saved voices (save, import, export, delete) for the HTTP routes and the page.
Each raises what app/service/refusals.py reads (`VoiceError`, `InputError`, `NotReadyError`); doors render it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path

from app.service import inputs
from app.service.owners import Owner
from app.service.prepare import reference_voice
from app.service.voice_file import export_voice, import_voice
from app.service.voices import VoiceError, VoiceInfo, check_name

Upload = Callable[[], Awaitable[bytes]]  # read only once the cheap checks (ready, name, transcript) have passed


async def save(service, owner: Owner, name: str, reference: str | bytes | Upload, transcript: object, *,
               overwrite: bool = False) -> tuple[VoiceInfo, tuple[str, ...]]:
    """Store a reference clip's features as `owner`'s voice `name`: (its info, notes on the clip). A taken name
    is refused before the clip is read, unless `overwrite`."""
    service.require_ready()
    store = service.voices.of(owner)
    inputs.check_transcript(transcript, service.cfg.limits.max_transcript_chars)
    store.refuse_taken(name := check_name(name), overwrite)
    features = await reference_voice(service, await reference() if callable(reference) else reference, transcript)
    return await asyncio.to_thread(store.save, name, features, overwrite=overwrite), features.notes


async def import_file(service, owner: Owner, data: str | bytes | Upload, name: str = "", *,
                      overwrite: bool = False) -> VoiceInfo:
    """Add the voice in a `.cvvoice` file (bytes, an upload, or a path on this host) to `owner`'s voices, under
    `name` or the file's; nothing is written unless every check passes."""
    service.require_ready()  # the model's fingerprint is known once it is loaded
    checked = check_name(name) if name else None
    if not isinstance(data, bytes):
        data = await data() if callable(data) else await asyncio.to_thread(Path(data).read_bytes)
    return await asyncio.to_thread(import_voice, service.voices.of(owner), data, name=checked, overwrite=overwrite,
                                   max_bytes=service.cfg.limits.max_upload_mb << 20)


def export(service, owner: Owner, name: str, of: str | None = None) -> tuple[VoiceInfo, bytes]:
    """(info, `.cvvoice` bytes) of `owner`'s voice `name` (the admin may name another owner, `of`)."""
    with _unknown():
        return export_voice(service.voices.of(owner, of), name)


def delete(service, owner: Owner, name: str, of: str | None = None) -> None:
    with _unknown():
        service.voices.of(owner, of).delete(name)


@contextlib.contextmanager
def _unknown():
    """A name no voice can have is looked up as any unknown one: not found (as another owner's is)."""
    try:
        yield
    except VoiceError as e:
        if e.code != "invalid_name":
            raise
        raise VoiceError(e.args[0], code="not_found") from e
