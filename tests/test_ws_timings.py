"""Word timings on the text-streaming socket (app/server/ws_timings.py), in process: the take's one segment aligned
to its sentences and sent as one `timestamps` message per sentence; an unavailable aligner's one message; a client
that leaves cancels the alignment still due; off, nothing. The aligner is the random tiny Whisper of
app/model/random/whisper.py on the example recordings (times arbitrary: their shape is what is checked). The door itself
on a real server: tests/test_ws_speech.py."""

from __future__ import annotations

import asyncio
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf

from app.config import AsrConfig
from app.engine.requests import AudioChunk
from app.model.random.whisper import make_tiny_whisper
from app.model.words import split_words
from app.server.ws_timings import alignment_messages
from app.service.timings import Aligner

ASSETS = Path(__file__).resolve().parents[1] / "assets"
SENTENCES = ["The quick brown fox jumps over the lazy dog.", "今天天气很好，我们一起去公园散步吧。", "Fine, thanks."]


class Socket:
    """What `alignment_messages` uses of a WebSocket: the JSON it sends."""

    def __init__(self) -> None:
        self.sent: list[dict] = []

    async def send_json(self, message: dict) -> None:
        self.sent.append(message)


@pytest.fixture(scope="module")
def aligner(tmp_path_factory) -> Aligner:
    folder = make_tiny_whisper(tmp_path_factory.mktemp("whisper") / "random", seed=1)
    return Aligner(AsrConfig(model_id=str(folder), device="cpu"))


@pytest.fixture(scope="module")
def take() -> np.ndarray:
    """The socket's take: the two example recordings, one after the other (24 kHz float32)."""
    return np.concatenate([sf.read(ASSETS / n, dtype="float32")[0] for n in ("prompt_en.wav", "prompt_zh.wav")])


def one_segment(samples: np.ndarray, n: int = 5) -> list[AudioChunk]:
    """The take as the socket's engine makes it: every chunk of segment 0, the last one final."""
    return [AudioChunk(p, i, 0, i == n - 1) for i, p in enumerate(np.array_split(samples, n))]


def messages(aligner, chunks: list[AudioChunk], texts: list[str], *, on: bool = True) -> list[dict]:
    async def main():
        ws, feed = Socket(), SimpleNamespace(texts=[])
        async with alignment_messages(ws, aligner, feed, on=on) as tap:
            for c in chunks:
                tap(c)
                assert ws.sent == []  # nothing before the take ended, and no audio waits for it
            feed.texts += texts  # the socket's text may come last: the timer reads it once the take ended
        return ws.sent

    return asyncio.run(main())


def test_one_message_per_sentence_tiling_the_take(aligner, take):
    """One `timestamps` message per sentence, by index: its text, one word per word of it (split_words), its
    characters; monotone, from the take's first sample, the sentences one after another to the take's end."""
    got = messages(aligner, one_segment(take), SENTENCES)
    assert [m["type"] for m in got] == ["timestamps"] * 3 and [m["index"] for m in got] == [0, 1, 2]
    assert [m["text"] for m in got] == SENTENCES
    take_ms = round(len(take) / 24)
    assert got[0]["start_ms"] == 0 and got[-1]["end_ms"] == take_ms
    assert all(a["end_ms"] == b["start_ms"] for a, b in pairwise(got))
    for m, text in zip(got, SENTENCES, strict=True):
        assert [w["word"] for w in m["words"]] == [w.text for w in split_words(text)]
        times = [t for w in m["words"] for t in (w["start_ms"], w["end_ms"])]
        assert times == sorted(times) and m["start_ms"] <= times[0] and times[-1] <= m["end_ms"], m
        c = m["chars"]
        assert "".join(c["chars"]) == text and c["charStartTimesMs"] == sorted(c["charStartTimesMs"])
        assert m["start_ms"] <= c["charStartTimesMs"][0] and c["charStartTimesMs"][-1] + c["charDurationsMs"][-1] \
            <= m["end_ms"]


def test_a_take_over_one_window_is_interpolated_per_sentence(aligner, take):
    """Over 30 s (one Whisper window): every sentence still has its message and words, interpolated, noted."""
    long = np.concatenate([take] * 3)
    got = messages(aligner, one_segment(long), SENTENCES)
    assert [m["index"] for m in got] == [0, 1, 2] and all(m["note"] for m in got)
    assert all(w["interpolated"] for m in got for w in m["words"]) and got[-1]["end_ms"] == round(len(long) / 24)


def test_unavailable_aligner_is_one_message(take):
    got = messages(Aligner(AsrConfig(enabled=False)), one_segment(take), SENTENCES)
    assert len(got) == 1 and "index" not in got[0] and got[0]["words"] == [], got
    assert got[0]["type"] == "timestamps" and "[asr] enabled = false" in got[0]["note"]


def test_off_sends_nothing(take):
    assert messages(Aligner(AsrConfig(enabled=False)), one_segment(take), SENTENCES, on=False) == []


def test_a_client_that_leaves_cancels_the_alignment(take):
    """The take's task cancelled (the client left) while its alignment runs: the alignment is cancelled too."""
    started, cancelled = asyncio.Event(), asyncio.Event()

    class Stuck:  # an aligner that never finishes
        async def sentence(self, *args, **kwargs):
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise

    async def main():
        async def produce():
            async with alignment_messages(Socket(), Stuck(), SimpleNamespace(texts=SENTENCES), on=True) as tap:
                for c in one_segment(take):
                    tap(c)

        task = asyncio.create_task(produce())
        await asyncio.wait_for(started.wait(), 5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return cancelled.is_set()

    assert asyncio.run(main())
