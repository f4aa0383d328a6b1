"""The incremental flow's encoder stages (app/model/flow/incremental/state.py): their committed length and conv
left context, and `StageCall`, the view of one stage's state that the encoder layers' `forward_cached` methods
use. Keys/values live in the stream's blocks of the pool (paged.py, encoder_rows.py); the relative-position
rows are one table for all streams (positions.py).
Design notes: docs/model.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from app.model.flow.incremental.positions import PositionTable


@dataclass
class StageState:
    """Committed state of one encoder stage: `length` positions, and the conv tails at it. Its keys/values
    live in the stream's pool blocks (encoder_rows.py), addressed by the estimator stage's block table."""

    length: int = 0
    tails: list[list[Tensor]] = field(default_factory=list)  # [slot][conv] -> [rows, C, k-1] inputs before `length`

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for slot in self.tails for t in slot)

    def share(self) -> StageState:
        return StageState(self.length, [list(slot) for slot in self.tails])  # tails are replaced, never written

    trimmed = share  # nothing past `length` is held here (the pool's `PagedStage.trimmed` gives blocks back)


class StageCall:
    """One call's view of a `StageState`: positions start..end-1 are new, start..commit-1 get committed.

    The layers call, in their fixed order: `left_context` (each causal conv), `keys_values` (each
    attention layer), `positions` (each relative-position attention layer); `begin(slot)` restarts
    the order for the next Euler evaluation. `finish()` commits; until then the state is unchanged
    (keys/values are written only at positions >= its length).
    """

    def __init__(self, state: StageState, start: int, end: int, commit: int, chunk: int, table: PositionTable,
                 kv: Tensor, host_rows: Tensor) -> None:
        """kv: the stage's pool tensor [2, layers, blocks·r, H, d]; host_rows: long [end] on the host, the rows of
        kv's axis 2 that hold this stream's positions 0..end-1 (`encoder_rows.flat_rows` of its block table)."""
        assert state.length == start <= commit <= end, (state.length, start, commit, end)
        self.state, self.start, self.end, self.commit, self.table = state, start, end, commit, table
        self.kv, self.host_rows = kv, host_rows
        self.chunk = chunk
        self._rows: Tensor | None = None  # on the device, when this call runs alone (a batched pass builds its own)
        self._tails: list[list[Tensor]] = [list(s) for s in state.tails]
        self.begin(0)

    @functools.cached_property
    def attention_hidden(self) -> Tensor:
        """bool [1, 1, n, end]: keys past the query's chunk (block-causal with full left context, as `chunk_mask`);
        made when this call runs alone (a batched pass computes its rows' own)."""
        q, k = self._positions()
        return (k >= (q // self.chunk + 1) * self.chunk)[None, None]

    @functools.cached_property
    def position_columns(self) -> Tensor:
        """long [1, 1, n, end]: query i / key j's relative position i - j is column (i - j) + n - 1 of `positions`."""
        q, k = self._positions()
        return (q - k + self.end - self.start - 1)[None, None]

    def _positions(self) -> tuple[Tensor, Tensor]:
        """Absolute query positions [n, 1] and key positions [1, end] on the device."""
        device = self.kv.device
        return torch.arange(self.start, self.end, device=device)[:, None], torch.arange(self.end, device=device)[None]

    def begin(self, slot: int) -> None:
        self.slot, self._conv, self._attn, self._pos = slot, 0, 0, 0
        while len(self._tails) <= slot:
            self._tails.append([])

    def flush(self) -> None:
        """Nothing to write back after an evaluation: keys/values went into the state in place, tails wait
        for `finish`."""

    def left_context(self, x: Tensor, n_ctx: int) -> Tensor:
        """x [rows, C, n] new inputs of the next causal conv -> [rows, C, n_ctx + n] with the inputs
        of the n_ctx positions before `start` (zeros at the sequence start); stages the new tail."""
        xx = torch.cat([self.committed_tail(x, n_ctx), x], dim=-1)
        c = self.commit - self.start  # the tail at `commit` is xx[..., c : c + n_ctx]
        self.stage_tail(xx[..., c : c + n_ctx].clone())  # clone: do not keep all of xx alive
        return xx

    def committed_tail(self, x: Tensor, n_ctx: int) -> Tensor:
        """The next causal conv's inputs at the n_ctx positions before `start`: [rows, C, n_ctx]
        (zeros at the sequence start; x [rows, C, n] gives rows, channels and dtype)."""
        committed = self.state.tails[self.slot] if self.slot < len(self.state.tails) else []
        i = self._conv
        return committed[i] if i < len(committed) else x.new_zeros(*x.shape[:-1], n_ctx)

    def stage_tail(self, new_tail: Tensor) -> None:
        """The next causal conv's inputs at the n_ctx positions before `commit`; moves to the next conv."""
        staged, i = self._tails[self.slot], self._conv
        if i < len(staged):
            staged[i] = new_tail
        else:
            staged.append(new_tail)
        self._conv += 1

    def keys_values(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v [1, H, n, d] of the new positions -> all keys/values [1, H, end, d] (the new ones written to
        the stream's blocks at positions >= its length, the committed ones read from them)."""
        layer = self._attn
        self._attn += 1
        if self._rows is None:
            self._rows = self.host_rows.to(self.kv.device, non_blocking=True)
        rows = self._rows
        self.kv[0, layer].index_copy_(0, rows[self.start :], k[0].transpose(0, 1))  # [n, H, d]
        self.kv[1, layer].index_copy_(0, rows[self.start :], v[0].transpose(0, 1))
        return (self.kv[0, layer].index_select(0, rows).transpose(0, 1)[None],
                self.kv[1, layer].index_select(0, rows).transpose(0, 1)[None])

    def positions(self, linear_pos: nn.Linear, heads: int, d_head: int) -> Tensor:
        """linear_pos of the relative positions -(n-1)..end-1 -> [1, H, n-1+end, d] (column c is
        offset c-(n-1)): a view of the stage's shared table (the layer's own `linear_pos` built it)."""
        layer = self._pos
        self._pos += 1
        assert self.table.layers[layer] is linear_pos, "layers must call positions in the table's order"
        return self.table.rows(layer, self.end - self.start, self.end)

    def finish(self) -> None:
        """Commit: positions < `commit` and the conv tails at `commit` become the state."""
        self.state.tails = self._tails
        self.state.length = self.commit
