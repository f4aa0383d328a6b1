"""The page's transcription events: the Transcribe button and the fill at Generate / Save voice.
Design notes: docs/design.md."""

from __future__ import annotations

import gradio as gr

from app.engine.asr import AsrUnavailable
from app.engine.inputs import check_transcript
from app.engine.prepare import HEARD_NOTHING_NOTE
from app.engine.service import StudioService
from app.ui.i18n import error, lang_of, t


class TranscriptionEvents:
    def __init__(self, service: StudioService) -> None:
        self.service = service

    async def _run(self, prompt_audio: str, lang: str, progress: gr.Progress, retry: bool) -> str:
        """The clip's cleaned transcript, said found in a pop-up; `AsrUnavailable` as it comes."""
        model = self.service.asr.cfg.model_id

        def report(done: int, total: int) -> None:  # from the download thread: Gradio's progress is thread-safe
            progress(done / total, desc=t(lang, "downloading", model=model, done=done / 1e9, total=total / 1e9))

        progress(None, desc=t(lang, "transcribing"))
        got = await self.service.asr.transcribe(prompt_audio, report=report, retry=retry)
        limit = self.service.cfg.limits.max_transcript_chars
        text = check_transcript(got.text[:limit], limit)
        if text:
            gr.Info(t(lang, "transcribed", language=got.language))
        return text

    async def transcribe(self, prompt_audio: str | None, request: gr.Request = None,
                         progress: gr.Progress = gr.Progress()) -> str:  # noqa: B008 (Gradio's injection idiom)
        """Whisper's transcript of `prompt_audio` (retries a model that failed to load before)."""
        lang = lang_of(request)
        if not prompt_audio:
            raise error(t(lang, "need_audio"), lang)
        try:
            text = await self._run(prompt_audio, lang, progress, retry=True)
        except AsrUnavailable as e:
            raise error(e, lang) from e
        if not text:
            raise error(HEARD_NOTHING_NOTE, lang)
        return text

    async def fill(self, prompt_audio: str | None, prompt_text: str | None, mode: str | None, voice: str | None,
                   request: gr.Request = None, progress: gr.Progress = gr.Progress()):  # noqa: B008
        """The transcript box after Generate / Save voice: Whisper's words for a blank one, else unchanged."""
        limit = self.service.cfg.limits.max_transcript_chars
        if (not prompt_audio or voice or mode not in (None, "", "zero_shot") or check_transcript(prompt_text, limit)
                or not self.service.asr.cfg.enabled):
            return gr.skip()
        try:
            text = await self._run(prompt_audio, lang_of(request), progress, retry=False)
        except AsrUnavailable:  # synthesis / the save says why in its notes, and falls back to cross-lingual
            return gr.skip()
        return text or gr.skip()

    async def fill_for_save(self, prompt_audio: str | None, prompt_text: str | None, request: gr.Request = None,
                            progress: gr.Progress = gr.Progress()):  # noqa: B008
        """`fill` for Save voice (a saved voice keeps its transcript whatever the mode)."""
        return await self.fill(prompt_audio, prompt_text, None, None, request, progress)
