"""CUDA graphs of the flow's velocity estimator at bucketed lengths (`engine.flow_cuda_graphs`).

Design notes: docs/model.md.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)
Key = tuple[tuple[int, ...], torch.dtype, torch.device, bool]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[Tensor, ...]  # static x, mask, mu, t, spks, cond
    output: Tensor  # static velocity


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    evictions: int = 0
    eager: int = 0  # evaluations run without a graph (capture off, not CUDA, or a failed capture)
    capture_failures: int = 0


class EstimatorGraphs:
    """Pads and replays `estimator(x, mask, mu, t, spks, cond, streaming=...)` (shapes as in
    `CausalConditionalDecoder.forward`); see the module docstring."""

    def __init__(self, estimator: nn.Module, *, bucket_frames: int = 64, max_graphs: int = 64,
                 capture: bool = True) -> None:
        if bucket_frames < 1 or max_graphs < 1:
            raise ValueError("bucket_frames and max_graphs must be >= 1")
        self.estimator, self.bucket_frames, self.max_graphs = estimator, bucket_frames, max_graphs
        self.capture = capture
        self.lock = threading.Lock()  # one solve at a time: the static buffers and the pool are shared
        self.stats = GraphStats()
        self._graphs: OrderedDict[Key, _Graph] = OrderedDict()
        self._pool = None  # torch.cuda.graph_pool_handle() of the first capture, shared by all

    @property
    def n_graphs(self) -> int:
        return len(self._graphs)

    def padded_length(self, n_frames: int) -> int:
        return -(-n_frames // self.bucket_frames) * self.bucket_frames

    @staticmethod
    def padded_rows(n_rows: int) -> int:
        """Rows of a batched solve round up to a power of two: 5 batch sizes cover flow_batch 16."""
        return 1 << (n_rows - 1).bit_length()

    def __call__(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                 streaming: bool) -> Tensor:
        """One velocity evaluation [rows, 80, T]; with a graph it is the static output (valid until the
        next replay)."""
        args = (x, mask, mu, t, spks, cond)
        if not (self.capture and x.is_cuda):
            self.stats.eager += 1
            return self.estimator(*args, streaming=streaming)
        key: Key = (tuple(x.shape), x.dtype, x.device, streaming)
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(key, args, streaming)
            except RuntimeError as e:
                # a failed capture ends without releasing its pool's recording state (torch), which
                # would fail every later capture in that pool: start a new pool, run this one eagerly
                log.warning("flow graph capture of %s failed (%s): evaluating eagerly, next capture in a new pool",
                            key[0], e)
                self._pool = None
                self.stats.capture_failures += 1
                self.stats.eager += 1
                return self.estimator(*args, streaming=streaming)
        else:
            self._graphs.move_to_end(key)
        for static, value in zip(entry.inputs, args, strict=True):
            static.copy_(value)
        entry.graph.replay()
        self.stats.replays += 1
        return entry.output

    def _capture(self, key: Key, args: tuple[Tensor, ...], streaming: bool) -> _Graph:
        device = args[0].device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up: kernel selection, cuBLAS workspaces, allocator
            inputs = tuple(a.clone() for a in args)
            self.estimator(*inputs, streaming=streaming)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another token2wav worker's allocations or syncs (HiFT, copies to the CPU) are
        # legal during this capture; in the default "global" mode they invalidate it
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            output = self.estimator(*inputs, streaming=streaming)
        if self._pool is None:
            self._pool = graph.pool()
        entry = self._graphs[key] = _Graph(graph, inputs, output)
        self.stats.captures += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
            self.stats.evictions += 1
        return entry

    def synchronize(self, x: Tensor) -> None:
        """Wait until the work queued for `x` ran (the shared buffers are then free for another solve)."""
        if x.is_cuda:
            torch.cuda.current_stream(x.device).synchronize()
