"""A take's sentence timings while it streams (app/service/take_timings.py): each sentence aligned once its last
chunk has passed, before the take ends, with the offsets `Aligner.take` gives the whole take; a sentence without
audio; an unavailable aligner's one note; a take that ends without its final chunk. The aligner is the random
tiny Whisper of app/model/random/whisper.py on the example recordings (no download)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from app.config import AsrConfig
from app.engine.requests import AudioChunk
from app.model.random.whisper import make_tiny_whisper
from app.model.words import split_words
from app.service.take_timings import SentenceTimer
from app.service.timings import Aligner, SentenceTimings

ASSETS = Path(__file__).resolve().parents[1] / "assets"
EN = "The quick brown fox jumps over the lazy dog."
ZH = "今天天气很好，我们一起去公园散步吧。"
WAIT_S = 60  # one sentence on the tiny Whisper takes ~0.7 s of this loaded 2-core box


@pytest.fixture(scope="module")
def aligner(tmp_path_factory) -> Aligner:
    folder = make_tiny_whisper(tmp_path_factory.mktemp("whisper") / "random", seed=1)
    return Aligner(AsrConfig(model_id=str(folder), device="cpu"))


@pytest.fixture(scope="module")
def waves() -> list[np.ndarray]:
    return [sf.read(ASSETS / name, dtype="float32")[0] for name in ("prompt_en.wav", "prompt_zh.wav")]


def chunks_of(waves: list[np.ndarray], n_per: int = 3) -> list[AudioChunk]:
    """Each wave (one segment each) cut into `n_per` chunks; the last chunk of all is the final one."""
    parts = [(seg, p) for seg, w in enumerate(waves) for p in np.array_split(w, n_per)]
    return [AudioChunk(p, i, seg, i == len(parts) - 1) for i, (seg, p) in enumerate(parts)]


async def _first_ready(timer: SentenceTimer) -> list:
    for _ in range(WAIT_S * 20):
        if got := timer.ready():
            return got
        await asyncio.sleep(0.05)
    raise AssertionError("nothing aligned in time")


def test_each_sentence_is_aligned_before_the_take_ends(aligner, waves):
    """Sentence 1 comes out once sentence 2's first chunk has passed (the final one not yet pushed); both equal
    what `Aligner.take` gives the whole take, offsets included."""
    async def main():
        chunks = chunks_of(waves)
        timer = SentenceTimer(aligner, lambda: [EN, ZH])
        try:
            for c in chunks[:4]:  # sentence 1's three chunks and sentence 2's first
                timer.push(c)
            first = await _first_ready(timer)
            for c in chunks[4:]:
                timer.push(c)
            rest = [t async for t in timer.rest()]
        finally:
            await timer.aclose()
        whole = await aligner.take([(EN, waves[0]), (ZH, waves[1])])
        return first, rest, whole

    first, rest, whole = asyncio.run(main())
    assert len(first) == 1 and len(rest) == 1 and all(isinstance(t, SentenceTimings) for t in first + rest)
    assert (first[0], rest[0]) == whole.sentences
    assert rest[0].start_ms == round(len(waves[0]) / 24) and rest[0].end_ms == round(sum(map(len, waves)) / 24)


def test_a_sentence_without_audio_keeps_its_words_in_place(aligner, waves):
    """Segment 2 made no chunk (the LM stopped at once): its words still come, 0 ms long, where it would be."""
    async def main():
        timer = SentenceTimer(aligner, lambda: ["Hi.", "Nothing here.", EN])
        timer.push(AudioChunk(np.zeros(2400, np.float32), 0, 0, False))
        timer.push(AudioChunk(waves[0], 1, 2, True))
        try:
            return [t async for t in timer.rest()]
        finally:
            await timer.aclose()

    hi, nothing, en = asyncio.run(main())
    assert [w.word for w in nothing.words] == ["Nothing", "here."] and nothing.note == "no audio"
    assert all(w.start_ms == w.end_ms == 100 and w.interpolated for w in nothing.words)
    assert hi.end_ms == nothing.start_ms == en.start_ms == 100
    assert [w.word for w in en.words] == [w.text for w in split_words(EN)]


def test_unavailable_aligner_is_one_note(waves):
    async def main():
        timer = SentenceTimer(Aligner(AsrConfig(enabled=False)), lambda: [EN, ZH])
        for c in chunks_of(waves):
            timer.push(c)
        try:
            return [t async for t in timer.rest()], timer.ready()
        finally:
            await timer.aclose()

    got, after = asyncio.run(main())
    assert len(got) == 1 and isinstance(got[0], str) and "[asr] enabled = false" in got[0] and after == []


def test_a_take_without_its_final_chunk_ends_at_rest(aligner, waves):
    """Stopped mid-sentence: the sentences complete by then are aligned; the open one is not; rest() ends."""
    async def main():
        timer = SentenceTimer(aligner, lambda: [EN, ZH])
        for c in chunks_of(waves)[:5]:
            timer.push(c)
        try:
            return [t async for t in timer.rest()]
        finally:
            await timer.aclose()

    got = asyncio.run(main())
    assert [t.text for t in got] == [EN]


def test_aclose_cancels_what_is_due(aligner, waves):
    async def main():
        timer = SentenceTimer(aligner, lambda: [EN, ZH])
        for c in chunks_of(waves):
            timer.push(c)
        await asyncio.wait_for(timer.aclose(), 5)  # not after every sentence is aligned
        return timer._task

    assert asyncio.run(main()).cancelled()
