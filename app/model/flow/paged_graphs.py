"""CUDA graphs of the paged incremental solve (`paged_solve`, app/model/flow/paged_solve.py), one per
(streams, new frames, key blocks) bucket, captured at warm-up only and replayed while serving.

Why warm-up only: a capture while other threads issue CUDA work breaks their work ("operation not
permitted when stream is capturing"; docs/performance.md), so `capture` runs before the engine
serves and `run` never captures: a call with no fitting bucket returns None and runs eagerly (the same
static-shape code, at its tight shape). A bucket (B, N, nb) fits a call of b <= B streams whose new
frames n_i <= N and whose keys fit nb blocks from each stream's start (start_i + N <= 50·nb). Graphs
share one memory pool and static buffers are reused, so `run` holds `lock` from the input copy to
the output clone (the clone is taken on the caller's stream before the lock is released), and each
caller's CUDA stream first waits for the previous caller's (workers replay on streams of their own).
"""

from __future__ import annotations

import itertools
import logging
import threading

import torch
from torch import Tensor

from app.model.flow.flow import CausalFlow
from app.model.flow.paged import KVPool, PagedEstCall, block_bytes
from app.model.flow.paged_solve import PagedInputs, bucket_up, paged_solve

log = logging.getLogger(__name__)


def make_pool(flow: CausalFlow, max_bytes: int, *, graphs: bool, max_rows: int = 16,
              max_blocks: int = 32) -> tuple[KVPool, PagedGraphs | None]:
    """A `KVPool` of at most `max_bytes` (at least one block) and, if `graphs` (CUDA), its graphs
    captured now: rows 1, 4, 16, .. up to max_rows; key blocks 8, 12, 16, 24, 32, 48, .. up to max_blocks."""
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
        self._graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, PagedInputs, Tensor]] = {}
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

    def _static(self, B: int, N: int, nb: int) -> PagedInputs:
        """Inputs of B padding streams (every write goes to the sink block and the padding tail slot)."""
        dev, dt = self.pool.device, self.pool.dtype
        ix = torch.zeros(B, 3 * N + nb + 3, dtype=torch.long)
        ix[:, :N] = 1  # SINK_BLOCK
        ix[:, 2 * N : 3 * N] = torch.arange(N)
        ix[:, 3 * N + nb] = 1
        return PagedInputs(torch.zeros(B, 80, N, dtype=dt, device=dev), torch.zeros(B, 80, N, dtype=dt, device=dev),
                           torch.zeros(B, 80, dtype=dt, device=dev), ix.to(dev), N, nb)

    @torch.inference_mode()
    def capture(self, buckets: list[tuple[int, int, int]] | None = None) -> int:
        """Captures every (rows, frames, key blocks) bucket (all combinations by default whose keys
        hold the frames); call before serving. Returns the number of graphs now held."""
        if not self.available(self.pool):
            return 0
        todo = buckets or [(b, n, k) for b, n, k in itertools.product(self.rows, self.frames, self.key_blocks)
                           if n <= k * self.pool.block_frames]
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
                    paged_solve(self.flow, self.pool, inp)  # warm-up: allocator and kernel choices
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize(self.pool.device)
                g = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(g, pool=mempool):
                        out = paged_solve(self.flow, self.pool, inp)
                except RuntimeError as e:  # that bucket then runs eagerly; the next capture gets a new pool
                    log.warning("paged flow graph %s not captured: %s", key, e)
                    self.capture_failures += 1
                    mempool = torch.cuda.graph_pool_handle()
                    continue
                self._graphs[key] = (g, inp, out)
            torch.cuda.synchronize(self.pool.device)
        return len(self._graphs)

    def bucket(self, calls: list[PagedEstCall]) -> tuple[int, int, int] | None:
        Bf = self.pool.block_frames
        B = bucket_up(len(calls), self.rows)
        N = bucket_up(max(c.end - c.start for c in calls), self.frames)
        if B is None or N is None:
            return None
        nb = bucket_up(max(max(-(-c.end // Bf), -(-(c.start + N) // Bf)) for c in calls), self.key_blocks)
        key = (B, N, nb) if nb is not None else None
        return key if key in self._graphs else None

    @torch.inference_mode()
    def run(self, calls: list[PagedEstCall], mus: list[Tensor], conds: list[Tensor],
            spks: list[Tensor]) -> Tensor | None:
        """x [B_bucket, 80, N_bucket] (a fresh tensor) of the calls' solve by a captured graph, or None."""
        from app.model.flow.paged_solve import make_inputs

        key = self.bucket(calls)
        if key is None:
            self.misses += 1
            return None
        inp = make_inputs(self.pool, calls, mus, conds, spks, rows=key[0], n_frames=key[1], n_blocks=key[2])
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
