"""CUDA graphs of HiFT's batched step, captured at warm-up only and replayed while serving
(`engine.hift_graphs`, GPU only). Design notes: docs/model.md.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from app.config import StreamingConfig
from app.model.flow_calls import FlowPrompt
from app.model.hift import HiFTGenerator
from app.model.hift_batch import HiftRow, stack_rows, vocode_step
from app.model.token2wav import (
    CHUNK_TOKENS,
    MEL_CACHE_FRAMES,
    PRE_LOOKAHEAD_TOKENS,
    SOURCE_CACHE_SAMPLES,
    Token2WavStream,
)

log = logging.getLogger(__name__)


@dataclass
class _Graph:
    replay: Callable[[], None]
    inputs: tuple[Tensor, Tensor | None, Tensor, Tensor]  # static mel, eps, cache, cache_len
    outputs: tuple[Tensor, Tensor]  # static spec, source


@dataclass
class HiftGraphStats:
    captures: int = 0  # graphs captured (all at warm-up)
    capture_failures: int = 0  # buckets whose capture failed at warm-up (they run eagerly)
    replays: int = 0
    eager: int = 0  # calls with no graph for their shape (or stream): run eagerly


def schedule_frames(streaming: StreamingConfig, *, chunk_tokens: int = CHUNK_TOKENS,
                    pre_lookahead: int = PRE_LOOKAHEAD_TOKENS, max_chunks: int = 64) -> list[int]:
    """HiFT mel lengths of the non-final chunks of `streaming`'s schedule over every prompt length
    (only the prompt length modulo the chunk size matters), the most frequent first. A first chunk has
    2 x hop frames; a later one also the 8-frame mel cache. Walked with `Token2WavStream` itself."""
    counts: Counter[int] = Counter()
    for residue in range(chunk_tokens):
        prompt = FlowPrompt(torch.zeros(1, chunk_tokens + residue, dtype=torch.long), None, None)
        s, last = Token2WavStream(None, None, prompt, streaming, stream=True, chunk_tokens=chunk_tokens,
                                  pre_lookahead=pre_lookahead), None
        for _ in range(max_chunks):
            plan = s.next_plan(1 << 30, lm_finished=False)
            hop = plan.n_tokens - pre_lookahead - plan.token_offset
            frames = 2 * hop + (MEL_CACHE_FRAMES if plan.token_offset else 0)
            counts[frames] += 1
            s.advance(plan)
            if frames == last and s.hop == streaming.max_hop_tokens:
                break  # steady: every later chunk has this length
            last = frames
    return [f for f, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def row_buckets(max_rows: int) -> list[int]:
    """Powers of two up to `max_rows` (rounded up): 16 -> [1, 2, 4, 8, 16]."""
    return [1 << i for i in range((max_rows - 1).bit_length() + 1)]


class HiftGraphs:
    """`graphs(hift, rows)` -> (spec [R, 18, 120 T + 1], source [R, 1, 480 T]), R >= len(rows): a replay
    when (rows padded to a power of two, T) was captured for the calling stream, else the eager step.
    `capture(...)` once at warm-up, then frozen (see the module docstring)."""

    def __init__(self, *, cache_samples: int = SOURCE_CACHE_SAMPLES) -> None:
        self.cache_samples = cache_samples
        self.stats = HiftGraphStats()
        self.frozen = False
        self._graphs: dict[tuple, _Graph] = {}  # (stream key, rows, frames, noise) -> graph

    @property
    def n_graphs(self) -> int:
        return len(self._graphs)

    def cache_width(self, frames: int, hift: HiFTGenerator) -> int:
        return min(self.cache_samples, frames * hift.upsample_factor)

    @staticmethod
    def _stream_key(stream: torch.cuda.Stream | None, device: torch.device) -> int:
        if device.type != "cuda":
            return 0
        return (stream if stream is not None else torch.cuda.current_stream(device)).cuda_stream

    @torch.inference_mode()
    def capture(self, hift: HiFTGenerator, rows: Iterable[int], frames: Iterable[int],
                streams: Iterable[torch.cuda.Stream | None] = (None,), *, max_graphs: int | None = None) -> None:
        """Capture one graph per (rows, frames) bucket for each worker stream (None: the device's current
        stream), at most `max_graphs` per stream (frames in the order given); then freeze the set.

        Per worker: one memory pool and one capture stream (cuBLAS keeps a workspace per stream, which the
        graphs bake in: graphs captured on one stream and replayed concurrently by two workers would share
        it), and one set of input buffers that every bucket views (a call fills all of its inputs)."""
        if self.frozen:
            raise RuntimeError("HiFT graphs are captured once, at warm-up")
        device = next(hift.parameters()).device
        buckets = [(r, f) for f in frames for r in rows][:max_graphs]
        try:
            for stream in streams:
                key0 = self._stream_key(stream, device)
                pool, side = None, torch.cuda.Stream(device) if device.type == "cuda" else None
                flat = self._input_buffers(hift, buckets, device)
                for r, f in buckets:
                    inputs = self._static_inputs(hift, r, f, flat)
                    try:
                        replay, outputs, pool = self._record(hift, inputs, pool, side)
                    except RuntimeError as e:  # left eager; a failed capture's pool is not reused
                        log.warning("HiFT graph capture of %d rows x %d frames failed (%s): eager", r, f, e)
                        self.stats.capture_failures += 1
                        pool = None
                        continue
                    self._graphs[(key0, r, f, inputs[1] is not None)] = _Graph(replay, inputs, outputs)
                    self.stats.captures += 1
        finally:
            self.frozen = True

    def _input_buffers(self, hift: HiFTGenerator, buckets: list[tuple[int, int]], device: torch.device) -> tuple:
        """Flat (mel, eps | None, cache, cache_len) buffers as large as the largest bucket needs."""
        n_rows, frames = max(r for r, _ in buckets), max(f for _, f in buckets)
        up, n_h = hift.upsample_factor, hift.m_source.n_harmonics
        eps = torch.zeros(n_rows * n_h * up * frames, device=device) if hift.nsf_noise else None
        return (torch.zeros(n_rows * hift.dims.in_channels * frames, device=device), eps,
                torch.zeros(n_rows * self.cache_samples, device=device),
                torch.zeros(n_rows, dtype=torch.int64, device=device))

    def _static_inputs(self, hift: HiFTGenerator, n_rows: int, frames: int, flat: tuple) -> tuple:
        """A bucket's inputs [R, 80, T], [R, 9, 480 T] | None, [R, 1, S], [R] as views of `flat`, filled with
        plausible values (a log-mel around -5) for the warm-up call."""
        def view(buf: Tensor, *shape: int) -> Tensor:
            return buf[: math.prod(shape)].view(shape)

        g = torch.Generator(device="cpu").manual_seed(0)
        mel = view(flat[0], n_rows, hift.dims.in_channels, frames)
        mel.copy_(torch.randn(mel.shape, generator=g) - 5)
        eps = None
        if flat[1] is not None:
            eps = view(flat[1], n_rows, hift.m_source.n_harmonics, frames * hift.upsample_factor)
            eps.copy_(hift.m_source.draw_noise(n_rows, frames, g, eps.device))
        cache = view(flat[2], n_rows, 1, self.cache_width(frames, hift)).zero_()
        return mel, eps, cache, view(flat[3], n_rows).zero_()

    def _record(self, hift: HiFTGenerator, inputs: tuple, pool, side: torch.cuda.Stream | None
                ) -> tuple[Callable[[], None], tuple, object]:
        """A CUDA graph of `vocode_step` on the static `inputs`, captured on stream `side` in memory pool
        `pool` (None: a new one): (replay, static outputs, the pool)."""
        device = inputs[0].device
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up: kernel selection, cuFFT plans, this stream's cuBLAS workspace
            vocode_step(hift, *inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
            outputs = vocode_step(hift, *inputs)
        return graph.replay, outputs, pool if pool is not None else graph.pool()

    @torch.inference_mode()
    def __call__(self, hift: HiFTGenerator, rows: list[HiftRow]) -> tuple[Tensor, Tensor]:
        mel0 = rows[0].mel
        n_rows = 1 << (len(rows) - 1).bit_length()
        key = (self._stream_key(None, mel0.device), n_rows, rows[0].n_frames, rows[0].eps is not None)
        entry = self._graphs.get(key)
        width = entry.inputs[2].shape[-1] if entry is not None else 0
        if entry is None or max(r.n_cache for r in rows) > width:
            self.stats.eager += 1
            return vocode_step(hift, *stack_rows(rows))
        self._fill(entry.inputs, rows)
        entry.replay()
        self.stats.replays += 1
        return entry.outputs

    @staticmethod
    def _fill(static: tuple, rows: list[HiftRow]) -> None:
        """Copy `rows` into a graph's static inputs; rows past len(rows) repeat the last row."""
        mel, eps, cache, cache_len = static
        n = len(rows)
        mel[:n].copy_(torch.cat([r.mel for r in rows]))
        mel[n:].copy_(rows[-1].mel.expand(mel.shape[0] - n, -1, -1))
        if eps is not None:
            eps[:n].copy_(torch.cat([r.eps for r in rows]))
            eps[n:].copy_(rows[-1].eps.expand(eps.shape[0] - n, -1, -1))
        cache.zero_()
        lengths = [r.n_cache for r in rows] + [rows[-1].n_cache] * (cache.shape[0] - n)
        for i, r in enumerate(rows + [rows[-1]] * (cache.shape[0] - n)):
            if r.cache_source is not None:
                cache[i, :, : r.n_cache].copy_(r.cache_source[0])
        cache_len.copy_(torch.tensor(lengths, dtype=torch.int64))
