"""CUDA graphs of HiFT's batched step (`engine.hift_graphs`, GPU only, off by default).

Why: a HiFT chunk is ~100 small kernels (F0 convs, the NSF source, three up-sampling stages of
resblocks); at a few rows a GPU spends its time launching them. A captured graph launches them at
once. What is captured is `vocode_step` (app/model/hift_batch.py): f0 -> source -> cache
overwrite -> decoder up to conv_post, static shapes and no host sync (the NSF noise is drawn
before, from each stream's own generator, into the static input; the source cache is a fixed-width
tensor + per-row lengths). The iSTFT runs eagerly after the replay: torch.istft checks its window
envelope on the host, which capture forbids.

Shapes: one graph per (padded rows, mel frames, cache width, noise on, dtype, device, CUDA stream).
Rows are padded to a power of two with copies of the last row (rows never interact; extra outputs
dropped); frames are never padded (HiFT is not causal: see hift_batch.py), so a graph serves one
exact chunk length: in the official schedule mid-stream chunks have two lengths (108 and 208 HiFT
frames), first chunks one per prompt pad, finals any (a bounded LRU of `max_graphs`).
Each token2wav worker has its own CUDA stream and its own memory pool: replays on one stream run in
order, so a static output is read (cloned) before the next replay overwrites it without any host
sync or lock, and two workers never share buffers. A failed capture runs eagerly (counted).
Not exercised on the CPU (nothing to capture there): scripts/gpu_hift_batch.py checks it on a GPU.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from app.model.hift import HiFTGenerator
from app.model.hift_batch import HiftRow, stack_rows, vocode_step

log = logging.getLogger(__name__)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[Tensor | None, ...]  # static mel, eps, cache, cache_len
    outputs: tuple[Tensor, Tensor]  # static spec, source


@dataclass
class HiftGraphStats:
    captures: int = 0
    replays: int = 0
    evictions: int = 0
    eager: int = 0  # calls run without a graph (not CUDA, or a failed capture)
    capture_failures: int = 0


class HiftGraphs:
    """`graphs(hift, rows)` -> (spec [R, 18, 120 T + 1], source [R, 1, 480 T]) for equal-length rows,
    R = rows padded to a power of two; see the module docstring."""

    def __init__(self, *, max_graphs: int = 32) -> None:
        if max_graphs < 1:
            raise ValueError("max_graphs must be >= 1")
        self.max_graphs = max_graphs
        self.stats = HiftGraphStats()
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._pools: dict[int, object] = {}  # per CUDA stream: graph_pool_handle of its first capture

    @property
    def n_graphs(self) -> int:
        return len(self._graphs)

    @staticmethod
    def padded_rows(n_rows: int) -> int:
        return 1 << (n_rows - 1).bit_length()

    def __call__(self, hift: HiFTGenerator, rows: list[HiftRow]) -> tuple[Tensor, Tensor]:
        args = stack_rows(rows, self.padded_rows(len(rows)))
        mel = args[0]
        if not mel.is_cuda:
            self.stats.eager += 1
            return vocode_step(hift, *args)
        stream = torch.cuda.current_stream(mel.device)
        key = (tuple(mel.shape), args[2].shape[-1], args[1] is not None, mel.dtype, mel.device, stream.cuda_stream)
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(key, hift, args, stream)
            except RuntimeError as e:  # a failed capture leaves its pool unusable: the next one gets a new pool
                log.warning("HiFT graph capture of %s failed (%s): running eagerly", key[:3], e)
                self._pools.pop(stream.cuda_stream, None)
                self.stats.capture_failures += 1
                self.stats.eager += 1
                return vocode_step(hift, *args)
        else:
            self._graphs.move_to_end(key)
        for static, value in zip(entry.inputs, args, strict=True):
            if static is not None:
                static.copy_(value)
        entry.graph.replay()
        self.stats.replays += 1
        return entry.outputs

    def _capture(self, key: tuple, hift: HiFTGenerator, args: tuple, stream: torch.cuda.Stream) -> _Graph:
        device = args[0].device
        side = torch.cuda.Stream(device)
        side.wait_stream(stream)
        with torch.cuda.stream(side):  # warm-up: kernel selection, cuFFT plans, allocator
            inputs = tuple(a.clone() if a is not None else None for a in args)
            vocode_step(hift, *inputs)
        stream.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        pool = self._pools.get(stream.cuda_stream)
        # thread_local: another worker's allocations or syncs during this capture are legal
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):  # on a side stream
            outputs = vocode_step(hift, *inputs)
        self._pools.setdefault(stream.cuda_stream, graph.pool())
        entry = self._graphs[key] = _Graph(graph, inputs, outputs)
        self.stats.captures += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
            self.stats.evictions += 1
        return entry
