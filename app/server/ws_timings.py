"""Word timings on the text-streaming socket (`/v1/audio/speech/stream` with `"timestamps": true` in its start;
docs/api.md): one `timestamps` message per sentence the socket read (the `index` of its `segment` message), in the
SSE door's shape (`timings_json`), or one message with no words whose `note` says why the take has none.

The socket's take is one engine segment: bi-streaming feeds its sentences to the speech LM as one text, so the audio
has no sentence boundaries and every `AudioChunk.segment` is 0. Its audio is therefore aligned once, to the sentences'
texts joined by a space, when the final chunk has passed (a SentenceTimer: in the background, no audio waits), then
cut into sentences at their characters. A take over 30 s (one Whisper window) is interpolated, not aligned (`note`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from itertools import accumulate

from fastapi import WebSocket

from app.engine.bistream import TextFeed
from app.model.words import split_words
from app.server.speech import Tap, no_tap
from app.server.sse_speech import timings_json
from app.service.take_timings import SentenceTimer
from app.service.timings import Aligner, CharTimings, SentenceTimings


@contextlib.asynccontextmanager
async def alignment_messages(ws: WebSocket, aligner: Aligner, feed: TextFeed, *, on: bool) -> AsyncIterator[Tap]:
    """A tap for the take's chunks (`on`: into a SentenceTimer; else it drops them). A normal exit sends the take's
    `timestamps` messages once they are aligned (none for a take stopped before its final chunk); any exit (the
    client left, a failure) cancels the alignment still due."""
    if not on:
        yield no_tap
        return
    timer = SentenceTimer(aligner, lambda: take_texts(feed))  # called once the take ended: all text is in
    try:
        yield timer.push
        async for t in timer.rest():
            if isinstance(t, str):  # the aligner is unavailable: why, once
                await ws.send_json({"type": "timestamps", **timings_json(t)})
                continue
            for index, sentence in enumerate(by_sentence(t, feed.texts)):
                await ws.send_json({"type": "timestamps", "index": index, **timings_json(sentence)})
    finally:
        await timer.aclose()


def take_texts(feed: TextFeed) -> list[str]:
    """The socket's take as SentenceTimer reads it: one segment, the sentences joined by one space (as
    `by_sentence` cuts them apart again)."""
    return [" ".join(feed.texts)]


def by_sentence(t: SentenceTimings, texts: Sequence[str]) -> list[SentenceTimings]:
    """`t` (the timings of `texts` joined by one space) as one SentenceTimings per text: the words that start in it,
    its characters, its span from its first character to the next text's first (the first text's from the take's
    start, the last one's to its end: the sentences tile the take) and `t`'s note."""
    firsts = list(accumulate((len(s) + 1 for s in texts), initial=0))  # [len(texts) + 1] first chars in t.text
    word_starts = [w.start_char for w in split_words(t.text)]  # [W], one per t.words
    out = []
    for k, text in enumerate(texts):
        lo, hi = firsts[k], firsts[k] + len(text)
        start_ms = t.start_ms if k == 0 else t.chars.start_ms[lo]
        end_ms = t.end_ms if k == len(texts) - 1 else t.chars.start_ms[firsts[k + 1]]
        words = tuple(w for w, c in zip(t.words, word_starts, strict=True) if lo <= c < hi)
        chars = CharTimings(t.chars.chars[lo:hi], t.chars.start_ms[lo:hi], t.chars.duration_ms[lo:hi])
        out.append(SentenceTimings(text, start_ms, end_ms, words, chars, t.note))
    return out
