"""A paged pool for the incremental flow's state (app/model/flow/incremental/state.py): the estimator's keys/values
and conv tails, and in the same blocks the encoder's keys/values (encoder_rows.py).

Design notes: docs/model.md.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import Tensor

from app.model.flow.estimator import CausalConv1d
from app.model.flow.flow import CausalFlow
from app.model.flow.incremental.encoder_rows import EncoderRows, encoder_block_bytes

PAD_BLOCK, SINK_BLOCK = 0, 1  # reserved block ids (see the module docstring)
PAD_TAIL = 0  # reserved tail slot
RESERVED_BLOCKS = 2
CFG_ROWS = 2  # every Euler evaluation runs a conditional and an unconditional row


class PoolFull(ValueError):
    """The pool has no room for a call's new blocks (or no free tail slot): the caller re-solves."""


def conv_channels(flow: CausalFlow) -> list[int]:
    """Input channels of the estimator's causal convs, in the order `forward_cached` calls them."""
    convs = [m for m in flow.decoder["estimator"].modules() if isinstance(m, CausalConv1d)]
    assert all(c.kernel_size[0] == 3 for c in convs), "tail slots assume kernel 3 (2 frames of context)"
    return [c.in_channels for c in convs]


def block_bytes(flow: CausalFlow, dtype: torch.dtype | None = None) -> int:
    """Bytes of one block: the estimator's chunk of frames × evaluations × layers × K/V × rows × heads × d_head,
    and the encoder stages' keys/values of the same chunk (encoder_rows.py)."""
    e = flow.dims.estimator
    size = torch.empty(0, dtype=dtype or next(flow.parameters()).dtype).element_size()
    layers = e.n_blocks * (e.num_mid_blocks + 2)
    return (e.static_chunk_size * flow.dims.n_timesteps * layers * 2 * CFG_ROWS * e.num_heads
            * e.attention_head_dim * size) + encoder_block_bytes(flow, size)


def bytes_per_frame(flow: CausalFlow, dtype: torch.dtype | None = None) -> float:
    """Estimator and encoder K/V bytes per committed mel frame in the pool (a frame of a shared prefix counts once
    per voice, not per stream)."""
    return block_bytes(flow, dtype) / flow.dims.estimator.static_chunk_size


class KVPool:
    """The preallocated block pool and tail slots (module docstring), and in the same blocks the encoder's
    keys/values with its position tables (`encoder`, encoder_rows.py): what all streams of one flow share.
    Thread-safe bookkeeping; the tensors are written only by the call that holds the blocks."""

    def __init__(self, flow: CausalFlow, n_blocks: int, n_streams: int | None = None) -> None:
        if n_blocks < 1:
            raise ValueError("a KVPool needs at least one block")
        e = flow.dims.estimator
        w = next(flow.parameters())
        self.dtype, self.device = w.dtype, w.device
        self.block_frames = e.static_chunk_size
        self.n_slots, self.n_layers = flow.dims.n_timesteps, e.n_blocks * (e.num_mid_blocks + 2)
        self.heads, self.d_head = e.num_heads, e.attention_head_dim
        n_streams = n_blocks if n_streams is None else n_streams
        # empty: a block is zeroed when taken (`allocate`), so untouched memory is never committed (CPU)
        # and a new block's unwritten positions, read with weight 0 behind the mask, are finite
        self.kv = torch.empty(self.n_slots, self.n_layers, n_blocks + RESERVED_BLOCKS, self.block_frames, 2, CFG_ROWS,
                              self.heads, self.d_head, dtype=self.dtype, device=self.device)
        self.kv[:, :, PAD_BLOCK].zero_()
        self.kv[:, :, SINK_BLOCK].zero_()
        channels = conv_channels(flow)
        self.tail_offsets = [sum(channels[:i]) for i in range(len(channels))]
        self.tail_channels = channels
        self.tails = torch.empty(n_streams + 1, self.n_slots, CFG_ROWS, sum(channels), 2, dtype=self.dtype,
                                 device=self.device)  # a slot is zeroed (or copied) when taken
        self.tails[PAD_TAIL].zero_()
        self._refs = [0] * (n_blocks + RESERVED_BLOCKS)
        self._free = list(range(n_blocks + RESERVED_BLOCKS - 1, RESERVED_BLOCKS - 1, -1))  # pop() gives low ids first
        self._free_tails = list(range(n_streams, 0, -1))
        self._lock = threading.Lock()
        self.refused = 0  # reserve calls that found the pool full
        self.encoder = EncoderRows(flow, n_blocks + RESERVED_BLOCKS, PAD_BLOCK, SINK_BLOCK)

    @property
    def n_blocks(self) -> int:
        return len(self._refs) - RESERVED_BLOCKS

    @property
    def free_blocks(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.n_blocks - self.free_blocks

    @property
    def block_bytes(self) -> int:
        return self.kv[:, :, 0].numel() * self.kv.element_size() + self.encoder.block_bytes

    @property
    def tail_bytes(self) -> int:
        return self.tails[0].numel() * self.tails.element_size()

    @property
    def nbytes(self) -> int:
        return (self.kv.numel() * self.kv.element_size() + self.tails.numel() * self.tails.element_size()
                + self.encoder.nbytes)

    def frames(self, slot: int, layer: int) -> Tensor:
        """Evaluation `slot`, layer `layer`: [blocks·50, 2 (K/V), rows, heads, d], row block·50 + offset (a view)."""
        return self.kv[slot, layer].view(-1, 2, CFG_ROWS, self.heads, self.d_head)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """n free blocks (one reference each), all or none: `PoolFull` when fewer are free."""
        with self._lock:
            if n > len(self._free):
                self.refused += 1
                raise PoolFull(f"the flow state pool has {len(self._free)} free blocks, a call needs {n}")
            ids = [self._free.pop() for _ in range(n)]
            for i in ids:
                self._refs[i] = 1
        # on the caller's stream, before the call that writes them; one kernel for all of them
        if ids:
            self.kv.index_fill_(2, torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True), 0)
        return ids

    def retain(self, table: list[int], n: int) -> list[int]:
        """One more reference on the first n blocks of another stage's live `table` -> their ids;
        `PoolFull` if that stage was released meanwhile (a prompt cache eviction racing a new stream)."""
        with self._lock:
            if len(table) < n:
                raise PoolFull("the voice prefix was evicted from the flow state pool")
            ids = table[:n]
            for i in ids:
                assert self._refs[i] > 0, f"block {i} is free"
                self._refs[i] += 1
            return ids

    def release(self, table: list[int]) -> None:
        """Drops one reference on each block of `table` and empties it (in place, under the lock)."""
        with self._lock:
            for i in table:
                assert self._refs[i] > 0, f"block {i} released twice"
                self._refs[i] -= 1
                if self._refs[i] == 0:
                    self._free.append(i)
            table.clear()

    def acquire_tail(self) -> int:
        with self._lock:
            if not self._free_tails:
                self.refused += 1
                raise PoolFull("the flow state pool has no free stream slot")
            return self._free_tails.pop()

    def release_tail(self, slot: int) -> None:
        with self._lock:
            assert slot != PAD_TAIL and slot not in self._free_tails, f"tail slot {slot} released twice"
            self._free_tails.append(slot)


def _release(pool: KVPool, table: list[int], tail: list[int]) -> None:
    # shared by `PagedStage.release` and its finalizer (a state dropped without release): idempotent
    if table:
        pool.release(table)
    if tail:
        pool.release_tail(tail.pop())


class PagedStage:
    """One stream's estimator state in a `KVPool`: a block table, the committed frames and a tail slot
    (`length`, `nbytes`, `share`, `trimmed` as the encoder stages' `StageState`). The `n_shared` blocks at
    the head of the table belong to a voice prefix (counted once per voice, not in `nbytes`).
    """

    def __init__(self, pool: KVPool, source: PagedStage | None = None) -> None:
        self.pool, self.length = pool, 0 if source is None else source.length
        self.table: list[int] = []
        self._tail: list[int] = [pool.acquire_tail()]
        try:
            if source is not None:
                n = self.length // pool.block_frames
                assert n * pool.block_frames == self.length, "a shared stage ends on a block edge"
                self.table = pool.retain(source.table, n)
            tail_from = None if source is None else source.tail_slot
            if tail_from is not None:
                pool.tails[self._tail[0]] = pool.tails[tail_from]
            else:
                pool.tails[self._tail[0]].zero_()
        except BaseException:
            _release(pool, self.table, self._tail)
            raise
        self.n_shared = len(self.table)
        self._finalizer = weakref.finalize(self, _release, pool, self.table, self._tail)

    @property
    def tail_slot(self) -> int:
        if not self._tail:
            raise PoolFull("the voice prefix was evicted from the flow state pool")
        return self._tail[0]

    @property
    def nbytes(self) -> int:
        """Bytes this stream holds alone: its own blocks and its tail slot."""
        return (len(self.table) - self.n_shared) * self.pool.block_bytes + (self.pool.tail_bytes if self._tail else 0)

    def reserve(self, n_frames: int) -> None:
        """Blocks for frames 0..n_frames-1 (`PoolFull`, and nothing taken, when the pool is short)."""
        need = -(-n_frames // self.pool.block_frames) - len(self.table)
        if need > 0:
            self.table.extend(self.pool.allocate(need))

    def share(self) -> PagedStage:
        """A new stream's stage starting from this one's committed blocks (read only) and tails."""
        return PagedStage(self.pool, self)

    def trimmed(self) -> PagedStage:
        """Gives back blocks past the committed length (a prefix keeps exactly its chunks)."""
        keep = -(-self.length // self.pool.block_frames)
        if len(self.table) > keep:
            extra = self.table[keep:]
            del self.table[keep:]
            self.pool.release(extra)
        return self

    def release(self) -> None:
        """Gives every block reference and the tail slot back (idempotent)."""
        self._finalizer()


class PagedEstCall:
    """The estimator's part of one incremental call on a `PagedStage`: frames start..end-1 are
    computed, start..commit-1 committed by `finish`. Reserves the blocks up to `end` (`PoolFull`)."""

    def __init__(self, stage: PagedStage, start: int, end: int, commit: int) -> None:
        assert stage.length == start <= commit <= end, (stage.length, start, commit, end)
        assert start % stage.pool.block_frames == 0, "calls start on a chunk edge"
        stage.reserve(end)
        self.state, self.start, self.end, self.commit = stage, start, end, commit

    def finish(self) -> None:
        self.state.length = self.commit


def blocks_needed(pool: KVPool, state, n_tokens: int) -> int:
    """New blocks a hop that encodes up to `n_tokens` (prompt + generated) tokens takes from `pool`
    for `state` (a `FlowState`, or None before its first hop: counted as if it started empty, an
    upper bound when it will start from a shared prefix)."""
    have = len(state.est.table) if state is not None else 0
    return max(0, -(-2 * n_tokens // pool.block_frames) - have)
