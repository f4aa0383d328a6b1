"""The saved-voice box's Export and Import: a voice as a `.cvvoice` file (app/engine/voice_file.py).

Design notes: docs/design.md.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import gradio as gr

from app.engine.service import NotReadyError, StudioService
from app.engine.voice_file import SUFFIX, VoiceFileError, export_voice, import_voice
from app.engine.voices import VoiceError
from app.ui.handlers import caller, refused

MIB = 1 << 20


class VoiceFileEvents:
    def __init__(self, service: StudioService) -> None:
        self.service = service

    async def export_voice(self, voice: str | None, request: gr.Request = None,
                           profile: gr.OAuthProfile | None = None) -> AsyncIterator[str]:
        """The caller's saved voice `voice` as a `<name>.cvvoice` file (its path; docs/api.md: the format).
        A generator so that its folder goes once Gradio has copied the file (no file left per click)."""
        if not voice:
            raise gr.Error("Pick a saved voice to export.")
        try:
            info, data = await asyncio.to_thread(export_voice, self.service.voices.of(caller(request, profile).owner),
                                                 voice)
        except VoiceError as e:
            raise refused(e) from e
        folder = Path(tempfile.mkdtemp(prefix="voice-"))
        try:
            path = folder / f"{info.name}{SUFFIX}"
            path.write_bytes(data)
            yield str(path)
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # Gradio has copied the yielded file to its cache by now

    def import_voice(self, file: str | None, overwrite: bool = False, request: gr.Request = None,
                     profile: gr.OAuthProfile | None = None) -> tuple[str, str]:
        """Add the voice in a `.cvvoice` file to the caller's voices under the file's name; returns (message,
        its name). A voice of that name is replaced only with `overwrite`, else refused."""
        try:
            self.service.require_ready()  # the model's fingerprint is known once it is loaded
        except NotReadyError as e:
            raise gr.Error(str(e), title="Not ready") from e
        if not file:
            raise gr.Error("Choose a .cvvoice file to import.")
        max_mb = self.service.cfg.limits.max_upload_mb
        try:
            if Path(file).stat().st_size > max_mb * MIB:  # Gradio's own cap is the same; read nothing larger
                raise VoiceFileError(f"the voice file is larger than {max_mb} MB ([limits] max_upload_mb)")
            info = import_voice(self.service.voices.of(caller(request, profile).owner), Path(file).read_bytes(),
                                max_bytes=max_mb * MIB, overwrite=bool(overwrite))
        except OSError as e:  # its message would name the server's upload folder
            raise gr.Error("the voice file could not be read; upload it again") from e
        except VoiceError as e:
            if e.code == "exists":
                raise gr.Error(f"{e}. Replace it: tick \"Replace a saved voice of that name\" on the page, or "
                               "pass overwrite=True through the API.", title="Name taken") from e
            raise refused(e) from e
        return f"Imported voice **{info.name}** ({info.prompt_seconds:.1f} s).", info.name
