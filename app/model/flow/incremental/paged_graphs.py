"""CUDA graphs of the packed incremental solve (`packed_solve`, app/model/flow/incremental/packed.py), one per
(streams, frames, keys) bucket, captured at warm-up only and replayed while serving. Design notes: docs/model.md.
"""

from __future__ import annotations

import itertools
import logging
import threading

import torch
from torch import Tensor

from app.model.flow.flow import CausalFlow
from app.model.flow.incremental.packed import PackedInputs, pack, packed_solve
from app.model.flow.incremental.paged import KVPool, PagedEstCall, block_bytes

log = logging.getLogger(__name__)


def make_pool(flow: CausalFlow, max_bytes: int, *, graphs: bool, max_rows: int = 16,
              max_blocks: int = 32) -> tuple[KVPool, PagedGraphs | None]:
    """A `KVPool` of at most `max_bytes` (at least one block) and, if `graphs` (CUDA), its graphs
    captured now: streams 1, 4, 16, .. up to max_rows; per stream 100 or 200 new frames over 8, 12,
    16, 24, 32, 48, .. up to max_blocks blocks of keys."""
    n_blocks = max(1, max_bytes // block_bytes(flow))
    pool = KVPool(flow, n_blocks)
    if not graphs or not PagedGraphs.available(pool):
        return pool, None
    rows = (*(4**i for i in range(8) if 4**i < max_rows), max_rows)
    keys = sorted({k for i in range(3, 12) for k in (2**i, 3 * 2 ** (i - 1)) if k <= max_blocks} | {max_blocks})
    g = PagedGraphs(flow, pool, rows=rows, frames=(100, 200), key_blocks=tuple(keys))
    g.capture()
    return pool, g


class PagedGraphs:
    def __init__(self, flow: CausalFlow, pool: KVPool, *, rows: tuple[int, ...] = (1, 4, 16),
                 frames: tuple[int, ...] = (100, 200), key_blocks: tuple[int, ...] = (8, 12, 16, 24, 32)) -> None:
        self.flow, self.pool = flow, pool
        self.rows, self.frames, self.key_blocks = tuple(sorted(rows)), tuple(sorted(frames)), tuple(sorted(key_blocks))
        # rows, frames and key blocks are per stream; a bucket (S, S·frames, S·blocks·50) holds them in total
        self._graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, PackedInputs, Tensor]] = {}
        self.lock = threading.Lock()
        # token->wave workers replay on their own CUDA streams: the next caller's stream waits for this event
        # (recorded after the last caller's output clone), else its input copy could overwrite the static
        # buffers while the last replay still reads them
        self._released: torch.cuda.Event | None = None
        self.replays = self.misses = self.capture_failures = 0

    @staticmethod
    def available(pool: KVPool) -> bool:
        return pool.device.type == "cuda"

    @property
    def buckets(self) -> list[tuple[int, int, int]]:
        return sorted(self._graphs)

    def _static(self, S: int, M: int, K: int) -> PackedInputs:
        """Inputs of S padding streams (every write goes to the sink block and the padding tail slot)."""
        return pack(self.flow, self.pool, [], [], [], [], streams=S, frames=M, keys=K)

    @torch.inference_mode()
    def capture(self, buckets: list[tuple[int, int, int]] | None = None) -> int:
        """Captures every (rows, frames, key blocks) bucket (all combinations by default whose keys
        hold the frames); call before serving. Returns the number of graphs now held."""
        if not self.available(self.pool):
            return 0
        Bf = self.pool.block_frames
        todo = buckets or [(b, b * n, b * k * Bf) for b, n, k in itertools.product(self.rows, self.frames,
                                                                                    self.key_blocks) if n <= k * Bf]
        self.flow.noise(1, self.pool.device, self.pool.dtype)  # the fixed noise on the device before any capture
        mempool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.pool.device)
        with self.lock:
            for key in todo:
                if key in self._graphs:
                    continue
                inp = self._static(*key)
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    packed_solve(self.flow, self.pool, inp)  # warm-up: allocator and kernel choices
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize(self.pool.device)
                g = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(g, pool=mempool):
                        out = packed_solve(self.flow, self.pool, inp)
                except RuntimeError as e:  # that bucket then runs eagerly; the next capture gets a new pool
                    log.warning("paged flow graph %s not captured: %s", key, e)
                    self.capture_failures += 1
                    mempool = torch.cuda.graph_pool_handle()
                    continue
                self._graphs[key] = (g, inp, out)
            torch.cuda.synchronize(self.pool.device)
        return len(self._graphs)

    def bucket(self, calls: list[PagedEstCall]) -> tuple[int, int, int] | None:
        """The captured bucket with the least work that holds the calls, or None."""
        S, M, K = len(calls), sum(c.end - c.start for c in calls), sum(c.end for c in calls)
        fits = [k for k in self._graphs if k[0] >= S and k[1] >= M and k[2] >= K]
        return min(fits, key=lambda k: (k[1], k[2], k[0])) if fits else None

    @torch.inference_mode()
    def run(self, calls: list[PagedEstCall], mus: list[Tensor], conds: list[Tensor],
            spks: list[Tensor]) -> Tensor | None:
        """x [1, 80, M_bucket] (a fresh tensor) of the calls' packed solve by a captured graph, or None."""
        key = self.bucket(calls)
        if key is None:
            self.misses += 1
            return None
        inp = pack(self.flow, self.pool, calls, mus, conds, spks, streams=key[0], frames=key[1], keys=key[2])
        with self.lock:
            g, static, out = self._graphs[key]
            stream = torch.cuda.current_stream(self.pool.device)
            if self._released is not None:  # the previous caller's stream is done with the static buffers
                stream.wait_event(self._released)
            static.copy_(inp)
            g.replay()
            self.replays += 1
            x = out.clone()
            self._released = torch.cuda.Event()
            self._released.record(stream)
            return x
