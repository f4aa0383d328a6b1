"""Word and character timings of a take: each finished sentence's audio aligned to its text, in ms from the
take's start. The aligner is the `[asr]` Whisper, loaded on first use, run in a worker thread.

    aligner = Aligner(cfg.asr, transcriber)  # the Transcriber's Whisper, one copy for both
    timings = await aligner.take(sentences_of(chunks, texts))  # TakeTimings; AlignerUnavailable says why

Design notes: docs/timings.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from app.audio import OUTPUT_SAMPLE_RATE_HZ
from app.config import AsrConfig
from app.engine.requests import AudioChunk
from app.message import Message
from app.model.align import AlignedWords, WhisperAligner
from app.model.asr import AsrModelError
from app.model.words import char_edges_ms
from app.service.asr import AsrUnavailable, Transcriber

log = logging.getLogger(__name__)

MIN_WORD_S = 0.06  # an interpolated word gets at least this long where its neighbours can lend it the time


class AlignerUnavailable(RuntimeError):
    """No timings can be made; `str(e)` says why (the same words every time: say it once per take)."""


@dataclass(frozen=True)
class WordTiming:
    word: str  # as written, with its punctuation ("there," "好。")
    start_ms: int  # from the take's first sample
    end_ms: int
    interpolated: bool = False  # the aligner missed it: placed between its neighbours by its characters


@dataclass(frozen=True)
class CharTimings:
    """Every character of the text (spaces and punctuation too), ElevenLabs' `alignment` shape."""

    chars: tuple[str, ...]
    start_ms: tuple[int, ...]  # from the take's first sample
    duration_ms: tuple[int, ...]

    def to_json(self) -> dict[str, list]:
        return {"chars": list(self.chars), "charStartTimesMs": list(self.start_ms),
                "charDurationsMs": list(self.duration_ms)}


@dataclass(frozen=True)
class SentenceTimings:
    text: str
    start_ms: int  # the sentence's audio in the take
    end_ms: int
    words: tuple[WordTiming, ...]  # one per word of `text` (app/model/words.py split_words)
    chars: CharTimings
    note: str = ""  # why the aligner did not run ("" when it did; then only missed words are interpolated)


@dataclass(frozen=True)
class TakeTimings:
    sentences: tuple[SentenceTimings, ...]

    @property
    def words(self) -> tuple[WordTiming, ...]:
        return tuple(w for s in self.sentences for w in s.words)

    @property
    def chars(self) -> CharTimings:
        """The sentences' characters one after another (their texts joined with nothing between)."""
        return CharTimings(*(tuple(x for s in self.sentences for x in getattr(s.chars, f))
                             for f in ("chars", "start_ms", "duration_ms")))


def place_words(a: AlignedWords) -> list[tuple[float, float, bool]]:
    """(start_s, end_s, interpolated) per word: the aligner's span where it is sound (positive, in order, inside
    the audio), else shared out by characters between the sound neighbours; a gap shorter than MIN_WORD_S per
    word borrows half of each neighbour's span. Monotone, inside [0, duration_s]."""
    start, end = np.array(a.start_s, float), np.array(a.end_s, float)  # [W] seconds
    ok = np.isfinite(start) & np.isfinite(end) & (end > start) & (start >= 0) & (end <= a.duration_s + 1e-6)
    last_end = 0.0
    for i in np.flatnonzero(ok):  # in order: a word starting before the last sound word ended is missed
        ok[i], last_end = (False, last_end) if start[i] < last_end - 1e-6 else (True, end[i])
    weights = np.array([max(1, len(w.text.replace(" ", ""))) for w in a.words], float)
    i = 0
    while i < len(ok):
        if ok[i]:
            i += 1
            continue
        k = i + int(np.argmax(ok[i:])) if ok[i:].any() else len(ok)  # [i, k) a run of missed words
        lo = end[i - 1] if i > 0 else a.speech_s[0]
        hi = start[k] if k < len(ok) else max(a.speech_s[1], lo)
        if hi - lo < MIN_WORD_S * (k - i):
            if i > 0:
                lo = end[i - 1] = end[i - 1] - (end[i - 1] - start[i - 1]) / 2
            if k < len(ok):
                hi = start[k] = start[k] + (end[k] - start[k]) / 2
        edges = lo + (hi - lo) * np.concatenate([[0.0], np.cumsum(weights[i:k])]) / weights[i:k].sum()
        start[i:k], end[i:k] = edges[:-1], edges[1:]
        i = k
    start, end = np.clip(start, 0, a.duration_s), np.clip(end, 0, a.duration_s)
    return [(float(s), float(e), not bool(o)) for s, e, o in zip(start, end, ok, strict=True)]


def sentence_timings(a: AlignedWords, text: str, offset_ms: float, duration_ms: float) -> SentenceTimings:
    """`a` placed (place_words) and offset by the sentence's start in the take; `duration_ms` its own audio."""
    def ms(s: float) -> int:
        return round(offset_ms + min(s * 1000, duration_ms))

    words = tuple(WordTiming(w.text, ms(s), ms(e), miss)
                  for w, (s, e, miss) in zip(a.words, place_words(a), strict=True))
    start_ms, end_ms = round(offset_ms), round(offset_ms + duration_ms)
    return SentenceTimings(text, start_ms, end_ms, words, _char_timings(text, a, words, start_ms, end_ms), a.note)


def _char_timings(text: str, a: AlignedWords, words: tuple[WordTiming, ...], start_ms: int,
                  end_ms: int) -> CharTimings:
    """Each word's span shared evenly by its characters; the characters between words (spaces, text outside
    every word) share the gap between them. Contiguous over [start_ms, end_ms]."""
    starts: list[int] = []
    durations: list[int] = []

    def share(n_chars: int, lo: int, hi: int) -> None:
        edges = char_edges_ms(lo, max(lo, hi), n_chars)  # [n_chars + 1]
        starts.extend(edges[:-1])
        durations.extend(hi_ms - lo_ms for lo_ms, hi_ms in pairwise(edges))

    cursor, at = start_ms, 0  # where the previous word ended (ms); the first character not shared yet
    for span, w in zip(a.words, words, strict=True):
        share(span.start_char - at, cursor, w.start_ms)
        share(span.end_char - span.start_char, w.start_ms, w.end_ms)
        cursor, at = w.end_ms, span.end_char
    share(len(text) - at, cursor, end_ms)
    return CharTimings(tuple(text), tuple(starts), tuple(durations))


def sentences_of(chunks: Iterable[AudioChunk], texts: Sequence[str]) -> list[tuple[str, np.ndarray]]:
    """A take's chunks gathered per sentence: (texts[segment], its samples [N] float32 at 24 kHz), in order."""
    parts: list[list[np.ndarray]] = [[] for _ in texts]
    for c in chunks:
        parts[c.segment].append(c.samples)
    return [(t, np.concatenate(p) if p else np.zeros(0, np.float32)) for t, p in zip(texts, parts, strict=True)]


class Aligner:
    """Lazy, shared forced aligner on the `[asr]` model: the `transcriber`'s own Whisper (one copy in memory; its
    attention becomes eager, the only kind that returns weights), loaded by it on first use. `error` (why it is
    off or failed, "" if not), `sentence`, `take`. A failed load is logged once and not retried."""

    def __init__(self, cfg: AsrConfig, transcriber: Transcriber | None = None) -> None:
        self.cfg, self.transcriber = cfg, transcriber or Transcriber(cfg)
        self.error: str = "" if cfg.enabled else Message(
            "timings_asr_off", "word timings are off: they use the [asr] model ([asr] enabled = false)")
        self._aligner: WhisperAligner | None = None
        self._load_lock = asyncio.Lock()  # one load, however many first takes arrive together

    async def take(self, sentences: Sequence[tuple[str, np.ndarray]], *, language: str = "",
                   sample_rate: int = OUTPUT_SAMPLE_RATE_HZ) -> TakeTimings:
        """Timings of a take given as its sentences in order: (text, samples [N] float mono at `sample_rate`);
        each sentence is offset by the samples before it. Raises `AlignerUnavailable`."""
        out, offset = [], 0
        for text, samples in sentences:
            out.append(await self.sentence(text, samples, offset_samples=offset, language=language,
                                           sample_rate=sample_rate))
            offset += len(samples)
        return TakeTimings(tuple(out))

    async def sentence(self, text: str, samples: np.ndarray, *, offset_samples: int = 0, language: str = "",
                       sample_rate: int = OUTPUT_SAMPLE_RATE_HZ) -> SentenceTimings:
        """One finished sentence's timings, `offset_samples` into its take. Raises `AlignerUnavailable`."""
        aligner = await self._model()
        async with self.transcriber.run_lock:  # one forward at a time on the model (each uses every core or the GPU)
            aligned = await asyncio.to_thread(aligner.align, samples, sample_rate, text, language)
        return sentence_timings(aligned, text, offset_samples * 1000 / sample_rate, len(samples) * 1000 / sample_rate)

    async def _model(self) -> WhisperAligner:
        async with self._load_lock:
            if self._aligner is not None:
                return self._aligner
            if self.error:
                raise AlignerUnavailable(self.error)
            try:
                asr = await self.transcriber.model()
            except AsrUnavailable as e:  # the model's own words; the Transcriber logged them, once
                cause = e.__cause__ if isinstance(e.__cause__, AsrModelError) else e
                self.error = Message("timings_unavailable", "word timings are unavailable: {error}", error=str(cause))
                raise AlignerUnavailable(self.error) from e
            async with self.transcriber.run_lock:  # not while it transcribes: the attention changes
                self._aligner = WhisperAligner(asr)
            log.info("aligner on %s's model (%s)", self.cfg.model_id, asr.device)
            return self._aligner
