"""`Utterance`: every piece of one request's state, in one object (nano-vllm's `Sequence` is the model).

The `Synthesizer` makes one per request and drives it; it dies with the request. It holds the
request, its text segments, the segment being spoken (its token list, LM stream, token->wave
stream), the worker the request sticks to, and its timings. Token->wave worker threads touch it
only through `finish_chunk` (one job of this request runs at a time: the pipeline awaits each chunk
before planning the next), so nothing per-request lives on a shared object.
"""

from __future__ import annotations

import functools
import hashlib
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import torch

from app.audio import OUTPUT_SAMPLE_RATE_HZ
from app.engine.requests import RequestStats, SynthesisRequest
from app.model.token2wav import ChunkPlan, Token2WavStream


@dataclass
class Segment:
    """The segment being spoken: its LM stream, the tokens so far and its token->wave stream."""

    index: int
    text: str
    t2w: Token2WavStream
    lm: AsyncIterator[list[int]]
    tokens: list[int]
    lm_finished: bool = False
    resolve: bool = False  # incremental flow refused (no room): its hops re-solve


class Utterance:
    """One request from its start to its final chunk (see the module docstring)."""

    def __init__(self, request: SynthesisRequest, segments: list[str], *, n_workers: int = 1) -> None:
        self.request = request
        self.segments = segments
        # a request sticks to one token->wave worker (its CUDA stream): from its id, no shared counter
        self.worker = zlib.crc32(request.request_id.encode()) % max(1, n_workers)
        self.segment: Segment | None = None
        self.chunk_index = 0
        # timings (seconds, time.perf_counter clock)
        self.t0 = time.perf_counter()
        self.first_audio: float | None = None
        self.lm_s = self.flow_s = self.hift_s = 0.0
        self.n_tokens = self.n_samples = self.n_chunks = 0
        self.chunk_flow_ms: list[float] = []  # per chunk: its flow call's wall ms
        self.chunk_frames: list[int] = []  # per chunk: mel frames the flow emitted

    @functools.cached_property
    def voice_key(self) -> str:
        """The voice as the flow's prompt cache knows it (an exact match is checked on every hit); hashed
        on first use, i.e. only with the incremental flow."""
        v = self.request.voice
        return hashlib.sha1(v.speech_tokens.numpy().tobytes() + v.embedding.numpy().tobytes()).hexdigest()

    @property
    def is_last_segment(self) -> bool:
        return self.segment is not None and self.segment.index == len(self.segments) - 1

    def deadline(self) -> float:
        """When this request's next chunk is needed: a first chunk's listener waits since the start; a
        later chunk is due when the audio already sent has played out."""
        if self.first_audio is None:
            return self.t0
        return self.first_audio + self.n_samples / OUTPUT_SAMPLE_RATE_HZ

    def add_tokens(self, new: list[int], waited_s: float) -> None:
        seg = self.segment
        assert seg is not None
        seg.tokens.extend(new)
        self.n_tokens += len(new)
        self.lm_s += waited_s

    def finish_chunk(self, plan: ChunkPlan, mel: torch.Tensor, flow_s: float) -> np.ndarray:
        """HiFT for `plan` on its flow output (on a token->wave worker): the chunk's samples, [N] float32.

        `flow_s` is the whole (maybe batched) flow call: the time this request waited on it.
        """
        seg = self.segment
        assert seg is not None
        t = time.perf_counter()
        wave = seg.t2w.finish(mel, plan)
        self.hift_s += time.perf_counter() - t
        self.flow_s += flow_s
        self.chunk_flow_ms.append(flow_s * 1e3)
        self.chunk_frames.append(int(mel.shape[2]))
        return wave.cpu().numpy().astype(np.float32, copy=False)

    def emitted(self, n_samples: int) -> None:
        """A chunk of `n_samples` goes out."""
        self.n_samples += n_samples
        self.n_chunks += 1
        self.chunk_index += 1
        if self.first_audio is None and n_samples:
            self.first_audio = time.perf_counter()

    def stats(self) -> RequestStats:
        now = time.perf_counter()
        first = self.first_audio if self.first_audio is not None else now
        return RequestStats(
            ttfa_ms=(first - self.t0) * 1e3, wall_s=now - self.t0, audio_s=self.n_samples / OUTPUT_SAMPLE_RATE_HZ,
            n_tokens=self.n_tokens, n_segments=len(self.segments), n_chunks=self.n_chunks, lm_s=self.lm_s,
            flow_s=self.flow_s, hift_s=self.hift_s, chunk_flow_ms=tuple(self.chunk_flow_ms),
            chunk_frames=tuple(self.chunk_frames))
