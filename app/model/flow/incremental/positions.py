"""The incremental encoder's relative-position rows, one table per stage shared by every stream of a flow
(app/model/flow/incremental/state.py). Design notes: docs/model.md.

A rel-pos attention layer reads `linear_pos` of the sin/cos rows of offsets -(n-1)..end-1 (n new positions
over `end` keys). Those rows depend on the offset and the layer only, never on the stream, so one table holds
them for all streams: a call's rows are a view of it, with no kernel and no per-stream copy.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor, nn

from app.model.flow.encoder import UpsampleConformerEncoder, position_rows

BLOCK = 256  # offsets per computed block: every block is one GEMM of the same shape, so a row's bytes never
# depend on which call grew the table (a stream reads the same rows alone and under load)


class PositionTable:
    """`linear_pos(position_rows(offset))` of every layer of one stage, as [layers, heads, columns, d_head]:
    column c holds offset c - neg. Grows on either side in whole `BLOCK`s (thread-safe); readers take a
    snapshot, so a growth by another thread never changes rows they hold."""

    def __init__(self, layers: list[nn.Linear], heads: int, d_head: int) -> None:
        w = layers[0].weight
        self.layers, self.heads, self.d_head = layers, heads, d_head
        self._table = (w.new_empty(len(layers), heads, 0, d_head), 0)  # (data, neg): swapped as one
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        data = self._table[0]
        return data.numel() * data.element_size()

    @property
    def snapshot(self) -> Tensor:
        """The table now ([layers, H, columns, d_head]); a later growth replaces it, never writes it."""
        return self._table[0]

    def rows(self, layer: int, n: int, end: int) -> Tensor:
        """Offsets -(n-1)..end-1 of `layer` -> [1, H, n-1+end, d_head] (a view: column c is offset c-(n-1))."""
        data, neg = self._table
        if n - 1 > neg or end > data.shape[2] - neg:
            data, neg = self._grow(n - 1, end)
        return data[layer, :, neg - (n - 1) : neg + end][None]

    def _grow(self, want_neg: int, want_pos: int) -> tuple[Tensor, int]:
        with self._lock, torch.no_grad():
            data, neg = self._table
            pos = data.shape[2] - neg
            new_neg = max(neg, -(-want_neg // BLOCK) * BLOCK)
            new_pos = max(pos, -(-want_pos // BLOCK) * BLOCK)
            if (new_neg, new_pos) == (neg, pos):
                return self._table
            before = [self._block(-b - BLOCK) for b in range(new_neg - BLOCK, neg - 1, -BLOCK)]
            after = [self._block(b) for b in range(pos, new_pos, BLOCK)]
            self._table = (torch.cat([*before, data, *after], dim=2), new_neg)
            return self._table

    def _block(self, first: int) -> Tensor:
        """Rows of offsets first..first+BLOCK-1 for every layer -> [layers, H, BLOCK, d_head]."""
        w = self.layers[0].weight
        sincos = position_rows(torch.arange(first, first + BLOCK, device=w.device), w.shape[1], w.dtype)
        return torch.stack([lin(sincos).view(BLOCK, self.heads, self.d_head).transpose(0, 1)
                            for lin in self.layers])


def stage_tables(encoder: UpsampleConformerEncoder) -> tuple[PositionTable, PositionTable]:
    """The (token-rate, frame-rate) stages' tables of an encoder, empty until a call reads them."""
    def table(blocks: nn.ModuleList) -> PositionTable:
        attn = [b.self_attn for b in blocks]
        return PositionTable([a.linear_pos for a in attn], attn[0].n_heads, attn[0].d_head)
    return table(encoder.encoders), table(encoder.up_encoders)
