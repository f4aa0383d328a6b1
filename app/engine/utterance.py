"""`Utterance`: every piece of one request's state, in one object (nano-vllm's `Sequence` is the model).
Design notes: docs/design.md."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from app.audio import OUTPUT_SAMPLE_RATE_HZ
from app.engine.requests import RequestStats, SynthesisRequest, Turn
from app.engine.t2w_scheduler import finish_each
from app.model.frontend import VoiceFeatures
from app.model.hift_batch import length_buckets, vocode_rows
from app.model.token2wav import ChunkPlan, Token2WavStream


@dataclass
class Segment:
    """The segment being spoken: its LM stream, the tokens so far and its token->wave stream."""

    t2w: Token2WavStream
    lm: AsyncIterator[list[int]]
    tokens: list[int]
    voice: VoiceFeatures | None = None  # whose voice it is spoken in (a dialogue's turns differ)
    lm_finished: bool = False
    resolve: bool = False  # incremental flow refused (no room): its hops re-solve


class Utterance:
    """One request from its start to its final chunk (see the module docstring)."""

    def __init__(self, request: SynthesisRequest, segments: list[Turn]) -> None:
        self.request = request
        self.segments = segments  # sentences in order, each with its voice (a dialogue's turns may differ)
        # the token->wave worker (its CUDA stream) this request sticks to: none until its first chunk runs on
        # whichever worker is free first (`pin`, app/engine/t2w_scheduler.py)
        self.worker: int | None = None
        self.segment: Segment | None = None
        self._voice_keys: dict[int, str] = {}  # id(voice) -> voice_key (the request holds the voices)
        self._next_lm: tuple[AsyncIterator[list[int]], asyncio.Future] | None = None  # see start_next_lm
        # timings (seconds, time.perf_counter clock)
        self.t0 = time.perf_counter()
        self.first_audio: float | None = None
        self.first_token: float | None = None  # the LM's first token arrived
        self.first_hop: float | None = None  # the first chunk's tokens were all in (its flow job is queued)
        self.first_wave: float | None = None  # the first chunk's wave was ready on its worker (after its HiFT)
        self.first_hift_s: float | None = None
        self.first_delta_tokens = 0  # tokens in the LM's first delta (arrived at first_token)
        self.first_hop_tokens = 0  # tokens in by first_hop
        self.lm_s = self.flow_s = self.hift_s = 0.0
        self.n_tokens = self.n_samples = self.n_chunks = 0  # n_chunks: emitted so far (the next one's index)
        self.chunk_flow_ms: list[float] = []  # per chunk: its flow call's wall ms
        self.chunk_frames: list[int] = []  # per chunk: mel frames the flow emitted

    def pin(self, worker: int) -> None:
        """The scheduler ran this request's first token->wave job on `worker`: its later jobs go there too
        (called on that worker, before the job runs; the next job is submitted after this one has ended)."""
        if self.worker is None:
            self.worker = worker

    def voice_key(self, voice: VoiceFeatures) -> str:
        """`voice` as the flow's prompt cache knows it (an exact match is checked on every hit); hashed on
        first use, i.e. only with the incremental flow."""
        if id(voice) not in self._voice_keys:
            data = voice.speech_tokens.numpy().tobytes() + voice.embedding.numpy().tobytes()
            self._voice_keys[id(voice)] = hashlib.sha1(data).hexdigest()
        return self._voice_keys[id(voice)]

    def deadline(self) -> float:
        """When this request's next chunk is needed: a first chunk's listener waits since the start; a
        later chunk is due when the audio already sent has played out."""
        if self.first_audio is None:
            return self.t0
        return self.first_audio + self.n_samples / OUTPUT_SAMPLE_RATE_HZ

    def start_next_lm(self, lm: AsyncIterator[list[int]]) -> None:
        """Start the next segment's LM stream now: a task takes its first tokens (the engine then keeps
        decoding ahead, its deltas buffered) while this segment's last chunks are vocoded."""
        self._next_lm = (lm, asyncio.ensure_future(anext(lm)))

    def take_next_lm(self) -> tuple[AsyncIterator[list[int]] | None, asyncio.Future | None]:
        """(the LM stream `start_next_lm` began, the task of its first tokens), or (None, None)."""
        taken, self._next_lm = self._next_lm or (None, None), None
        return taken

    async def drop_next_lm(self) -> None:
        """The request ended before reaching the segment whose LM was started: abort that LM request."""
        lm, first = self.take_next_lm()
        if first is not None:
            first.cancel()  # a no-op when it is done
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
                await first  # (also retrieves its exception, if it had one)
        if lm is not None:
            await lm.aclose()

    def add_tokens(self, new: list[int], waited_s: float) -> None:
        self.segment.tokens.extend(new)
        self.n_tokens += len(new)
        self.lm_s += waited_s
        if self.first_token is None and new:
            self.first_token = time.perf_counter()
            self.first_delta_tokens = len(new)

    def planned(self) -> None:
        """A chunk's tokens are in and its token->wave job is about to be queued."""
        if self.first_hop is None:
            self.first_hop = time.perf_counter()
            self.first_hop_tokens = self.n_tokens

    def chunk_done(self, wave: torch.Tensor, n_frames: int, flow_s: float, hift_s: float) -> np.ndarray:
        """Count a chunk's stage times (s) and its `n_frames` flow frames; its samples as [N] float32."""
        if self.first_wave is None:  # (on the worker thread; read once the request has ended)
            self.first_wave, self.first_hift_s = time.perf_counter(), hift_s
        self.hift_s += hift_s
        self.flow_s += flow_s
        self.chunk_flow_ms.append(flow_s * 1e3)
        self.chunk_frames.append(n_frames)
        return wave.cpu().numpy().astype(np.float32, copy=False)

    def emitted(self, n_samples: int) -> None:
        """A chunk of `n_samples` goes out."""
        self.n_samples += n_samples
        self.n_chunks += 1
        if self.first_audio is None and n_samples:
            self.first_audio = time.perf_counter()

    def stats(self) -> RequestStats:
        now = time.perf_counter()
        first = self.first_audio if self.first_audio is not None else now
        n = self.first_hop_tokens - self.first_delta_tokens  # tokens between the first delta and the first hop
        per_token = (self.first_hop - self.first_token) * 1e3 / n \
            if self.first_token is not None and self.first_hop is not None and n >= 1 else None
        return RequestStats(
            ttfa_ms=(first - self.t0) * 1e3, wall_s=now - self.t0, audio_s=self.n_samples / OUTPUT_SAMPLE_RATE_HZ,
            n_tokens=self.n_tokens, n_segments=len(self.segments), n_chunks=self.n_chunks, lm_s=self.lm_s,
            flow_s=self.flow_s, hift_s=self.hift_s, chunk_flow_ms=tuple(self.chunk_flow_ms),
            chunk_frames=tuple(self.chunk_frames), first_token_ms=self._since_t0(self.first_token),
            first_hop_ms=self._since_t0(self.first_hop), lm_ms_per_token=per_token,
            first_wave_ms=self._since_t0(self.first_wave),
            first_hift_ms=None if self.first_hift_s is None else self.first_hift_s * 1e3)

    def _since_t0(self, t: float | None) -> float | None:
        return None if t is None else (t - self.t0) * 1e3


@dataclass(frozen=True)
class ChunkFinish:
    """A flow job's finish, on a worker: HiFT of `plan` for `utterance`, alone (`__call__`: [N] float32 samples;
    `flow_s`, the whole maybe-batched flow call, is the time the request waited on it) or with its flow call's
    other jobs (`vocode_chunks`)."""

    utterance: Utterance
    plan: ChunkPlan

    def __call__(self, mel: torch.Tensor, flow_s: float) -> np.ndarray:
        t = time.perf_counter()
        wave = self.utterance.segment.t2w.finish(mel, self.plan)
        return self.utterance.chunk_done(wave, int(mel.shape[2]), flow_s, time.perf_counter() - t)


def vocode_chunks(hift, finishes: list[ChunkFinish], mels: list[torch.Tensor], flow_s: float,
                  graphs=None) -> Iterator[tuple[int, np.ndarray | None, Exception | None]]:
    """HiFT of one flow call's chunks (`mels[i]` [1, 80, T_i] for `finishes[i]`), one batched call per
    HiFT input length, the most urgent job's length first; yields (index, samples, error) per chunk as
    its bucket is done. A request's hift_s is its own row's work plus its bucket's call (the time it
    waited); a bucket whose call fails runs its rows one by one, so one bad row fails alone.
    `graphs`: a HiftGraphs (CUDA) or None."""
    if len(finishes) == 1 and graphs is None:  # alone: the job's own path (Token2WavStream.finish), same numbers
        yield from finish_each(finishes, mels, flow_s)
        return
    rows, prep_s = {}, {}
    for i, (f, mel) in enumerate(zip(finishes, mels, strict=True)):
        t = time.perf_counter()
        try:
            rows[i] = f.utterance.segment.t2w.hift_row(mel, f.plan)  # draws this stream's noise
        except Exception as e:
            yield i, None, e
            continue
        prep_s[i] = time.perf_counter() - t
    live = list(rows)
    groups = [[live[b] for b in bucket] for bucket in length_buckets([rows[i] for i in live])]
    while groups:
        idx = groups.pop(0)
        t = time.perf_counter()
        try:
            outs = vocode_rows(hift, [rows[i] for i in idx], graphs)
        except Exception as e:
            if len(idx) > 1:
                groups[:0] = [[i] for i in idx]  # each row alone (its noise is drawn: same numbers)
            else:
                yield idx[0], None, e
            continue
        call_s = time.perf_counter() - t
        for i, (wav, source) in zip(idx, outs, strict=True):
            f = finishes[i]
            try:
                hift_s = prep_s[i] + call_s
                wave = f.utterance.segment.t2w.finish_vocoded(rows[i], wav, source, f.plan)
                yield i, f.utterance.chunk_done(wave, int(mels[i].shape[2]), flow_s, hift_s), None
            except Exception as e:
                yield i, None, e
