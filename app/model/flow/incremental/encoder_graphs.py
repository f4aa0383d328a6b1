"""CUDA graphs of the paged hops' encoder pass (`encode_rows`, app/model/flow/incremental/encode_batch.py), one per
(streams, new tokens, token keys) bucket, captured at warm-up only and replayed while serving (bucket_graphs.py).

Eagerly the pass is ~5,500 small kernels at 16 streams (10 conformer layers, each a few dozen ops), so on a GPU
its time is the host's launches, not the device's work; one replay launches them all. Design notes: docs/model.md.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from app.model.flow.flow import CausalFlow
from app.model.flow.incremental.bucket_graphs import BucketGraphs
from app.model.flow.incremental.encode_batch import EncoderInputs, encode_rows, encoder_inputs

TOKENS = (50, 100, 125)  # new tokens per row: the official schedule's hops end on chunk edges (a first hop from a
# voice prefix 50 or 75, then 50, 100, 100, ..); an unaligned hop (fast.toml) adds up to 24 uncommitted tokens
MIN_FREE_BYTES = 2 << 30  # captured after the solve's graphs, and only while this stays free: the largest bucket's
# pass takes ~2 GB (64 rows, 125 tokens over 800; fp16), and serving needs room of its own (an exact final's re-solve)


class EncoderGraphs(BucketGraphs):
    """Buckets (B, N, E): B rows of N new tokens over E token keys (`key_blocks` pool blocks of keys)."""

    name = "flow encoder"

    def __init__(self, flow: CausalFlow, pool, *, rows: tuple[int, ...] = (1, 4, 16),
                 tokens: tuple[int, ...] = TOKENS, key_blocks: tuple[int, ...] = (8, 12, 16, 24, 32)) -> None:
        super().__init__(pool.device, min_free_bytes=MIN_FREE_BYTES)
        self.flow, self.rows_pool = flow, pool.encoder
        per_block = self.rows_pool.rows[0]  # tokens per pool block
        self.keys = tuple(sorted(k * per_block for k in key_blocks))
        self.todo = [(b, n, e) for b, n, e in itertools.product(sorted(rows), sorted(tokens), self.keys) if n <= e]
        self._tables: list[Tensor] = []  # the position tables the graphs read (held: a later growth swaps them)

    def _static(self, key: tuple[int, ...]) -> EncoderInputs:
        """Inputs of B padding rows (every write goes to the sink block, every read to the pad block)."""
        B, N, E = key
        return encoder_inputs(self.flow, self.rows_pool, [], streams=B, tokens=N, keys=E)

    def _fn(self, inputs: EncoderInputs) -> tuple[Tensor, Tensor, Tensor]:
        return encode_rows(self.flow, self.rows_pool, inputs)

    def _before_capture(self, keys: list[tuple[int, ...]]) -> None:
        """Grows both stages' position tables to the largest bucket now: a growth inside a capture would be
        replayed, into memory the graphs' pool gives to others."""
        N, E = max(k[1] for k in keys), max(k[2] for k in keys)
        up = self.flow.encoder.up_layer.stride
        for table, scale in zip(self.rows_pool.positions, (1, up), strict=True):
            table.rows(0, scale * N, scale * E)
            self._tables.append(table.snapshot)

    def capture(self, buckets: list[tuple[int, int, int]] | None = None) -> int:
        """Captures the given buckets (default: every one); call before serving -> graphs now held."""
        return self._capture(buckets or self.todo)

    def bucket(self, plans: list) -> tuple[int, int, int] | None:
        """The captured bucket with the least work that holds the plans (state.py's `_Plan`s), or None."""
        B = len(plans)
        N = max(p.tok_call.end - p.tok_call.start for p in plans)
        E = max(p.tok_call.end for p in plans)
        fits = [k for k in self._graphs if k[0] >= B and k[1] >= N and k[2] >= E]
        return min(fits, key=lambda k: (k[0] * k[1] * k[2], k)) if fits else None

    @torch.inference_mode()
    def run(self, plans: list) -> tuple[Tensor, Tensor, Tensor] | None:
        """`encode_rows` of the plans by a captured graph (fresh tensors, rows past the plans' are padding), or
        None (no bucket holds them: the caller runs the pass eagerly)."""
        key = self.bucket(plans)
        if key is None:
            self.misses += 1
            return None
        inp = encoder_inputs(self.flow, self.rows_pool, plans, streams=key[0], tokens=key[1], keys=key[2])
        return self._replay(key, inp)
