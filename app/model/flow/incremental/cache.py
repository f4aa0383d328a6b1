"""Storage for the incremental flow's encoder stages (app/model/flow/incremental/state.py): growable K/V
buffers, conv left context, and `StageCall`, the view of one stage's state that the encoder layers'
`forward_cached` methods use (the estimator's state is paged: app/model/flow/incremental/paged.py; the
relative-position rows are one table for all streams: app/model/flow/incremental/positions.py).
Design notes: docs/model.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from app.model.flow.incremental.positions import PositionTable

GROWTH = 0.25  # a full buffer grows by a quarter of its capacity (at least what the call needs)


def next_capacity(capacity: int, n: int, quantum: int, growth: float = GROWTH) -> int:
    """Capacity after a reserve of n positions: unchanged if n fits, else max(n, capacity·(1+growth))
    rounded up to whole `quantum`s (chunks). growth=1.0 is capacity doubling (the earlier rule: up to
    2x the committed positions held; 0.25 holds at most 1.25x + one chunk)."""
    if n <= capacity:
        return capacity
    want = max(n, capacity + int(capacity * growth))
    return -(-want // quantum) * quantum


class Growable:
    """A tensor `data` [*lead, capacity, d] that grows along dim -2 (`next_capacity`: +25 % in whole chunks).

    `length` counts the valid positions. A buffer made by `share()` aliases another's data
    (`shared`): it is copied before its first write (copy-on-extend), so the original, e.g. a
    voice prefix that many streams read, is never mutated.
    """

    def __init__(self, lead: tuple[int, ...], d: int, dtype: torch.dtype, device: torch.device,
                 quantum: int = 1) -> None:
        self.data = torch.empty(*lead, 0, d, dtype=dtype, device=device)
        self.length = 0
        self.shared = False
        self.quantum = quantum  # capacity is a multiple of this (the stage's chunk)

    @property
    def capacity(self) -> int:
        return self.data.shape[-2]

    @property
    def nbytes(self) -> int:
        """Bytes this buffer owns (0 while it only aliases another's data)."""
        return 0 if self.shared else self.data.numel() * self.data.element_size()

    def reserve(self, n: int) -> None:
        """Room for positions 0..n-1 in data this buffer owns (keeps 0..length-1)."""
        if n <= self.capacity and not self.shared:
            return
        cap = next_capacity(0 if self.shared else self.capacity, n, self.quantum)
        data = self.data.new_empty(*self.data.shape[:-2], cap, self.data.shape[-1])
        data[..., : self.length, :] = self.data[..., : self.length, :]
        self.data, self.shared = data, False

    def _alias(self, data: Tensor, shared: bool) -> Growable:
        other = Growable.__new__(Growable)
        other.data, other.length, other.shared, other.quantum = data, self.length, shared, self.quantum
        return other

    def share(self) -> Growable:
        """A read-only-until-written alias of this buffer's valid part."""
        return self._alias(self.data, True)

    def trimmed(self) -> Growable:
        """A copy holding exactly the valid positions (capacity = length)."""
        return self._alias(self.data[..., : self.length, :].clone(), False)


@dataclass
class StageState:
    """Committed state of one stage (see the module docstring)."""

    kv: Growable  # [2 (K, V), layers, slots, rows, heads, T, d_head]
    tails: list[list[Tensor]] = field(default_factory=list)  # [slot][conv] -> [rows, C, k-1] inputs before `length`

    @property
    def length(self) -> int:
        return self.kv.length

    @property
    def nbytes(self) -> int:
        tails = sum(t.numel() * t.element_size() for slot in self.tails for t in slot)
        return self.kv.nbytes + tails

    def share(self) -> StageState:
        return StageState(self.kv.share(), [list(slot) for slot in self.tails])  # tails are replaced, never written

    def trimmed(self) -> StageState:
        return StageState(self.kv.trimmed(), [list(slot) for slot in self.tails])


def new_stage(layers: int, slots: int, rows: int, heads: int, d_head: int, dtype: torch.dtype,
              device: torch.device, *, chunk: int = 1) -> StageState:
    return StageState(Growable((2, layers, slots, rows, heads), d_head, dtype, device, chunk))


class StageCall:
    """One call's view of a `StageState`: positions start..end-1 are new, start..commit-1 get committed.

    The layers call, in their fixed order: `left_context` (each causal conv), `keys_values` (each
    attention layer), `positions` (each relative-position attention layer); `begin(slot)` restarts
    the order for the next Euler evaluation. `finish()` commits; until then the state is unchanged
    (keys/values are written only at positions >= its length).
    """

    def __init__(self, state: StageState, start: int, end: int, commit: int, chunk: int,
                 table: PositionTable) -> None:
        assert state.length == start <= commit <= end, (state.length, start, commit, end)
        self.state, self.start, self.end, self.commit, self.table = state, start, end, commit, table
        state.kv.reserve(end)  # copy-on-extend happens here
        device = state.kv.data.device
        q = torch.arange(start, end, device=device)[:, None]  # absolute query positions [n, 1]
        k = torch.arange(end, device=device)[None, :]  # absolute key positions [1, end]
        block = q // chunk  # block-causal with full left context, as `chunk_mask`
        self.hidden = k >= (block + 1) * chunk  # bool [n, end]: keys past the query's chunk
        self.attention_hidden = self.hidden[None, None]  # [1, 1, n, end], as the encoder's attention reads it
        n = end - start
        # relative position of (query i, key j) is i - j; column (i - j) + n - 1 of `positions`
        self.position_columns = (q - k + n - 1)[None, None]  # [1, 1, n, end]
        self._tails: list[list[Tensor]] = [list(s) for s in state.tails]
        self.begin(0)

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
        """k, v [rows, H, n, d] of the new positions -> all keys/values [rows, H, end, d] (views)."""
        data = self.state.kv.data
        layer = self._attn
        self._attn += 1
        data[0, layer, self.slot, :, :, self.start : self.end] = k
        data[1, layer, self.slot, :, :, self.start : self.end] = v
        return data[0, layer, self.slot, :, :, : self.end], data[1, layer, self.slot, :, :, : self.end]

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
        self.state.kv.length = self.commit
