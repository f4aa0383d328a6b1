"""CUDA graphs of the packed incremental solve (`packed_solve`, app/model/flow/incremental/packed.py), one per
(streams, frames, keys) bucket, and of the hops' encoder pass (encoder_graphs.py), captured at warm-up only and
replayed while serving (bucket_graphs.py). Design notes: docs/model.md.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from app.model.flow.flow import CausalFlow
from app.model.flow.incremental.bucket_graphs import BucketGraphs
from app.model.flow.incremental.encoder_graphs import EncoderGraphs
from app.model.flow.incremental.packed import PackedInputs, pack, packed_solve
from app.model.flow.incremental.paged import KVPool, PagedEstCall, block_bytes


def make_pool(flow: CausalFlow, max_bytes: int, *, graphs: bool, max_rows: int = 16,
              max_blocks: int = 32, encoder_graphs: bool = True) -> tuple[KVPool, PagedGraphs | None]:
    """A `KVPool` of at most `max_bytes` (at least one block) and, if `graphs` (CUDA), its graphs
    captured now: streams 1, 4, 16, .. up to max_rows; per stream 100 or 200 new frames over 8, 12,
    16, 24, 32, 48, .. up to max_blocks blocks of keys; with `encoder_graphs` the encoder pass's too
    (encoder_graphs.py: the same streams and key blocks)."""
    n_blocks = max(1, max_bytes // block_bytes(flow))
    pool = KVPool(flow, n_blocks)
    if not graphs or not PagedGraphs.available(pool):
        return pool, None
    rows = (*(4**i for i in range(8) if 4**i < max_rows), max_rows)
    keys = sorted({k for i in range(3, 12) for k in (2**i, 3 * 2 ** (i - 1)) if k <= max_blocks} | {max_blocks})
    g = PagedGraphs(flow, pool, rows=rows, frames=(100, 200), key_blocks=tuple(keys), encoder=encoder_graphs)
    g.capture()
    return pool, g


class PagedGraphs(BucketGraphs):
    """The packed solve's graphs (bucket_graphs.py) and, in `encoder`, the encoder pass's (encoder_graphs.py)."""

    name = "paged flow"

    def __init__(self, flow: CausalFlow, pool: KVPool, *, rows: tuple[int, ...] = (1, 4, 16),
                 frames: tuple[int, ...] = (100, 200), key_blocks: tuple[int, ...] = (8, 12, 16, 24, 32),
                 encoder: bool = True) -> None:
        super().__init__(pool.device)
        self.flow, self.pool = flow, pool
        self.rows, self.frames, self.key_blocks = tuple(sorted(rows)), tuple(sorted(frames)), tuple(sorted(key_blocks))
        # rows, frames and key blocks are per stream; a bucket (S, S·frames, S·blocks·50) holds them in total
        self.encoder = EncoderGraphs(flow, pool, rows=rows, key_blocks=key_blocks) if encoder else None

    @staticmethod
    def available(pool: KVPool) -> bool:
        return pool.device.type == "cuda"

    def _static(self, key: tuple[int, ...]) -> PackedInputs:
        """Inputs of S padding streams (every write goes to the sink block and the padding tail slot)."""
        S, M, K = key
        return pack(self.flow, self.pool, [], [], [], [], streams=S, frames=M, keys=K)

    def _fn(self, inputs: PackedInputs) -> Tensor:
        return packed_solve(self.flow, self.pool, inputs)

    def _before_capture(self, keys: list[tuple[int, ...]]) -> None:
        self.flow.noise(1, self.pool.device, self.pool.dtype)  # the fixed noise on the device before any capture

    def capture(self, buckets: list[tuple[int, int, int]] | None = None) -> int:
        """Captures every (rows, frames, key blocks) bucket (all combinations by default whose keys
        hold the frames), then (by default) the encoder pass's buckets in their own memory pool, so the
        solve's keep the memory they had before; call before serving. Returns the number of solve graphs
        now held."""
        Bf = self.pool.block_frames
        todo = buckets or [(b, b * n, b * k * Bf) for b, n, k in itertools.product(self.rows, self.frames,
                                                                                    self.key_blocks) if n <= k * Bf]
        n = self._capture(todo)
        if self.encoder is not None and buckets is None:
            self.encoder.capture()
        return n

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
        return self._replay(key, inp)[0]
