"""The saved-voice box's Export and Import: a voice as a `.cvvoice` file (app/engine/voice_door.py).

Design notes: docs/design.md.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import gradio as gr

from app.engine import voice_door
from app.engine.service import NotReadyError, StudioService
from app.engine.voice_file import SUFFIX
from app.engine.voices import VoiceError
from app.message import Message
from app.ui.handlers import caller, page_error
from app.ui.i18n import error, lang_of, say


class VoiceFileEvents:
    def __init__(self, service: StudioService) -> None:
        self.service = service

    async def export_voice(self, voice: str | None, request: gr.Request = None,
                           profile: gr.OAuthProfile | None = None) -> AsyncIterator[str]:
        """The caller's saved voice `voice` as a `<name>.cvvoice` file (its path; docs/api.md: the format).
        A generator so that its folder goes once Gradio has copied the file (no file left per click)."""
        lang = lang_of(request)
        if not voice:
            raise error(Message("pick_to_export", "Pick a saved voice to export."), lang)
        try:
            info, data = await asyncio.to_thread(voice_door.export, self.service, caller(request, profile).owner,
                                                 voice)
        except VoiceError as e:
            raise page_error(e, lang) from e
        folder = Path(tempfile.mkdtemp(prefix="voice-"))
        try:
            path = folder / f"{info.name}{SUFFIX}"
            path.write_bytes(data)
            yield str(path)
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # Gradio has copied the yielded file to its cache by now

    async def import_voice(self, file: str | None, overwrite: bool = False, request: gr.Request = None,
                           profile: gr.OAuthProfile | None = None) -> tuple[str, str]:
        """Add the voice in a `.cvvoice` file to the caller's voices under the file's name; returns (message,
        its name). A voice of that name is replaced only with `overwrite`, else refused."""
        lang = lang_of(request)
        if not file:
            raise error(Message("choose_voice_file", "Choose a .cvvoice file to import."), lang)
        try:
            info = await voice_door.import_file(self.service, caller(request, profile).owner, file,
                                                overwrite=bool(overwrite))
        except OSError as e:  # its message would name the server's upload folder
            raise error(Message("voice_file_unread", "the voice file could not be read; upload it again"), lang) from e
        except (VoiceError, NotReadyError) as e:
            raise page_error(e, lang) from e
        done = Message("imported_voice", "Imported voice **{name}** ({seconds:.1f} s).", name=info.name,
                       seconds=info.prompt_seconds)
        return say(done, lang), info.name
