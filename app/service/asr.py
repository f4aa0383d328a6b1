"""The process's one Whisper transcriber: loaded on first use, run in worker threads, never on the loop.
Design notes: docs/design.md."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from app.audio import AudioError
from app.config import AsrConfig
from app.message import Message
from app.model.asr import AsrInputError, AsrModelError, Transcript, WhisperAsr, fetch_asr_model
from app.service.voices import ClipCache

log = logging.getLogger(__name__)

TRANSCRIPT_CACHE_SIZE = 64  # clips whose transcripts stay in memory
Report = Callable[[int, int], None]  # (bytes done, bytes total) of the model download


class AsrUnavailable(RuntimeError):
    """No transcript could be made; `str(e)` says why and what to do."""


class Transcriber:
    """Lazy, shared Whisper: `status` (for the page), `error` (why it is off or failed, "" if not), `transcribe`."""

    def __init__(self, cfg: AsrConfig) -> None:
        self.cfg = cfg
        self.status = "not loaded" if cfg.enabled else "off"
        self.error = "" if cfg.enabled else Message("asr_off", "automatic transcription is off ([asr] enabled = false)")
        self._asr: WhisperAsr | None = None
        self._load_lock = asyncio.Lock()  # one load, however many first uses arrive together
        # one forward at a time on the model, a clip's or the aligner's: each uses every core (or the GPU)
        self.run_lock = asyncio.Lock()
        self._cache: ClipCache[Transcript] = ClipCache(TRANSCRIPT_CACHE_SIZE)  # by the clip's bytes and language

    async def transcribe(self, src: str | Path | bytes, *, report: Report | None = None,
                         retry: bool = False) -> Transcript:
        """The clip's words and language (cached by content). Raises `AsrUnavailable`."""
        if not self.cfg.enabled:
            raise AsrUnavailable(self.error)
        async with self.run_lock:
            asr = await self.model(report, retry)  # at once when loaded (a cached clip implies it is)
            return await self._cache.get(src, self.cfg.language, lambda clip, lang: _transcribe(asr, clip, lang))

    async def model(self, report: Report | None = None, retry: bool = False) -> WhisperAsr:
        """The loaded Whisper (loaded now on first use; the aligner's too). Raises `AsrUnavailable`."""
        async with self._load_lock:
            if self._asr is not None:
                return self._asr
            if self.error and not retry:
                raise AsrUnavailable(self.error)
            c = self.cfg

            def on_bytes(done: int, total: int) -> None:  # download progress (called from the download thread)
                self.status = f"downloading {c.model_id}: {done / 1e9:.2f} / {total / 1e9:.2f} GB"
                if report is not None:
                    report(done, total)

            try:
                self.status = f"fetching {c.model_id}"
                folder = await asyncio.to_thread(fetch_asr_model, c.model_id, download=c.download, report=on_bytes)
                self.status = f"loading {c.model_id}"
                self._asr = await asyncio.to_thread(WhisperAsr.load, folder, c.device)
            except AsrModelError as e:
                self.error = Message("asr_unavailable", "automatic transcription is unavailable: {error}", error=e)
                self.status = "unavailable"
                log.warning("%s", self.error)
                raise AsrUnavailable(self.error) from e
            self.error, self.status = "", f"ready ({c.model_id} on {self._asr.device})"
            log.info("transcription model %s loaded on %s", c.model_id, self._asr.device)
            return self._asr


def _transcribe(asr: WhisperAsr, src: str | Path | bytes, language: str) -> Transcript:
    """`asr`'s transcript of `src` (the path, not the bytes, keeps the file's suffix for format errors)."""
    try:
        return asr.transcribe(src, language)
    except (AsrInputError, AudioError) as e:
        raise AsrUnavailable(Message("asr_failed", "the reference could not be transcribed: {error}", error=e)) from e
