"""A take's word timings while it streams: each sentence aligned as soon as its last chunk has passed, in the
background, so a door's audio is never held back (docs/timings.md, "For a door").

    timer = SentenceTimer(service.aligner, texts)  # texts: () -> the take's sentence texts, called once
    try:
        async for chunk in take:
            timer.push(chunk)                        # never waits
            send(chunk)
            for t in timer.ready(): send(t)          # what is aligned by now
        async for t in timer.rest(): send(t)         # the last sentences' (waits for them)
    finally:
        await timer.aclose()                         # cancels what is still due

Each result is a `SentenceTimings` (times from the take's first sample), or once a `str`: why the take has no
timings (the aligner is unavailable; nothing follows it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence

import numpy as np

from app.audio import OUTPUT_SAMPLE_RATE_HZ
from app.engine.requests import AudioChunk
from app.message import said
from app.model.align import AlignedWords
from app.model.words import split_words
from app.service.timings import Aligner, AlignerUnavailable, SentenceTimings, sentence_timings

log = logging.getLogger(__name__)

Timing = SentenceTimings | str  # a sentence's timings, or (once, last) why there are none
Due = tuple[int, np.ndarray, int]  # (segment, its samples [N] float32 at 24 kHz, samples before it in the take)


class SentenceTimer:
    """One take's sentence timings as its chunks pass. A sentence (`AudioChunk.segment`) is complete when a chunk
    of a later segment, or the final chunk, arrives; a background task then aligns it (`Aligner.sentence`: a worker
    thread, one sentence at a time in the process) and the results come out in sentence order. `texts()` gives the
    take's segment texts; it is called once, in a worker thread, when the first sentence is complete (so a socket
    whose text is still arriving, or a door that has not split its text yet, can pass it)."""

    def __init__(self, aligner: Aligner, texts: Callable[[], Sequence[str]], *, language: str = "") -> None:
        self.aligner, self.texts, self.language = aligner, texts, language
        self._parts: list[np.ndarray] = []  # the open sentence's samples, chunk by chunk
        self._segment, self._offset = 0, 0  # the open sentence; samples of the sentences before it
        self._due: asyncio.Queue[Due | None] = asyncio.Queue()  # None: the take ended
        self._out: asyncio.Queue[Timing | None] = asyncio.Queue()  # None: nothing more will come
        self._ended = self._done = False
        self._task = asyncio.get_running_loop().create_task(self._work())

    def push(self, chunk: AudioChunk) -> None:
        """One chunk of the take, in order (never waits)."""
        if self._ended:
            return
        while chunk.segment > self._segment:  # a segment that made no chunk is a sentence without audio
            self._close_sentence()
        if chunk.samples.size:
            self._parts.append(chunk.samples)
        if chunk.is_final:
            self._close_sentence()
            self._end()

    def ready(self) -> list[Timing]:
        """The results aligned by now (never waits)."""
        got = []
        while not self._done and not self._out.empty():
            item = self._out.get_nowait()
            self._done = item is None
            if item is not None:
                got.append(item)
        return got

    async def rest(self) -> AsyncIterator[Timing]:
        """The remaining results as they are aligned. A take that ended without its final chunk (stopped) ends
        here: its open sentence is not aligned."""
        self._end()
        while not self._done:
            item = await self._out.get()
            self._done = item is None
            if item is not None:
                yield item

    async def aclose(self) -> None:
        self._end()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def _close_sentence(self) -> None:
        samples = np.concatenate(self._parts) if self._parts else np.zeros(0, np.float32)
        self._due.put_nowait((self._segment, samples, self._offset))
        self._parts, self._segment, self._offset = [], self._segment + 1, self._offset + samples.size

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self._due.put_nowait(None)

    async def _work(self) -> None:
        texts: Sequence[str] | None = None
        try:
            while (due := await self._due.get()) is not None:
                segment, samples, offset = due
                if texts is None:
                    texts = await asyncio.to_thread(self.texts)
                text = texts[segment] if segment < len(texts) else ""
                if samples.size == 0:
                    self._out.put_nowait(silent(text, offset))
                    continue
                self._out.put_nowait(await self.aligner.sentence(text, samples, offset_samples=offset,
                                                                 language=self.language))
        except AlignerUnavailable as e:
            self._out.put_nowait(said(e))  # a Message: each door says it in its language
        except Exception as e:  # a bug must not end the take's audio: its timings end here, the log says why
            log.exception("word timings failed")
            self._out.put_nowait(f"word timings failed: {e}")
        finally:
            self._out.put_nowait(None)


def silent(text: str, offset_samples: int) -> SentenceTimings:
    """A sentence with no audio: every word (interpolated) and character at its place in the take, 0 ms long."""
    words = tuple(split_words(text))
    nan = (float("nan"),) * len(words)
    aligned = AlignedWords(words, nan, nan, 0.0, (0.0, 0.0), note="no audio")
    return sentence_timings(aligned, text, offset_samples * 1000 / OUTPUT_SAMPLE_RATE_HZ, 0.0)
