"""The estimator solve of B streams' incremental hops over a `KVPool` (app/model/flow/paged.py) with
static shapes, so one (streams, new frames, key blocks) bucket can be captured as a CUDA graph once
and replayed (`PagedGraphs`).

Every per-stream choice is an index tensor (`PagedInputs`, built on the CPU, copied in one go):
block tables [B, nb] (padding: `PAD_BLOCK`), the block and offset each new frame's keys/values go to
[B, N] (padded frames: `SINK_BLOCK`), the absolute query positions [B, N], each stream's key end [B],
tail slot [B] and the offset of its new conv tail (commit - start) [B]. Streams padded up to the
bucket's B have a table of `PAD_BLOCK`s, key end 1 (a visible key, so no empty softmax in fp16) and
tail slot `PAD_TAIL`. Why padding changes no valid frame: convs are causal (right padding is never
read), norms and linears are per frame, and the attention bias hides every key at or after a stream's
end, every key of a later chunk and every padded position (MASK_BIAS: weight exactly 0; the keys there
are finite: zeros, or values an earlier call computed).

Per evaluation and layer: the new keys/values are written into the pool by (block, offset) (one
index_put), then the stream's keys/values [2B, H, nb·50, d] are gathered by block table (one
index_select and one copy). Conv tails: gathered per evaluation (one index), each conv's new tail
picked at the stream's commit offset, written back after the evaluation (one index_put); a call writes
tails and keys/values only at positions past its streams' committed edges, so the `Hop.commit` that
follows only moves lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from app.model.flow.estimator import MASK_BIAS, DenseCall
from app.model.flow.flow import CausalFlow
from app.model.flow.packed import cfg_solve, solve_packed
from app.model.flow.paged import CFG_ROWS, PAD_TAIL, SINK_BLOCK, KVPool, PagedEstCall, table_tensor


def bucket_up(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= n, or None."""
    return next((b for b in sorted(buckets) if b >= n), None)


@dataclass
class PagedInputs:
    """The static inputs of one solve (device tensors; shapes fix the bucket)."""

    mu: Tensor  # [B, 80, N] flow dtype
    cond: Tensor  # [B, 80, N]
    spks: Tensor  # [B, 80]
    index: Tensor  # [B, 3N + nb + 3] int64: w_block | w_offset | q_pos (each N) | table (nb) | end, tail, tail_at
    n_frames: int  # N
    n_blocks: int  # nb

    def parts(self) -> tuple[Tensor, ...]:
        N, nb = self.n_frames, self.n_blocks
        ix = self.index
        return (ix[:, :N], ix[:, N : 2 * N], ix[:, 2 * N : 3 * N], ix[:, 3 * N : 3 * N + nb],
                ix[:, 3 * N + nb], ix[:, 3 * N + nb + 1], ix[:, 3 * N + nb + 2])

    def copy_(self, other: PagedInputs) -> None:
        for a, b in ((self.mu, other.mu), (self.cond, other.cond), (self.spks, other.spks),
                     (self.index, other.index)):
            a.copy_(b, non_blocking=True)


def make_inputs(pool: KVPool, calls: list[PagedEstCall], mus: list[Tensor], conds: list[Tensor],
                spks: list[Tensor], *, rows: int | None = None, n_frames: int | None = None,
                n_blocks: int | None = None) -> PagedInputs:
    """The static inputs of `calls` (each stream's new frames mu/cond [1, 80, n_i], spks [1, 80]),
    padded to (rows streams, n_frames new frames, n_blocks key blocks); None: the tightest."""
    Bf = pool.block_frames
    B = len(calls)
    rows = rows or B
    N = n_frames or max(c.end - c.start for c in calls)
    nb = n_blocks or max(-(-max(c.end, c.start + N) // Bf) for c in calls)
    assert rows >= B and all(c.end - c.start <= N and c.start + N <= nb * Bf for c in calls), (rows, N, nb)
    j = torch.arange(N)
    ix = torch.zeros(rows, 3 * N + nb + 3, dtype=torch.long)
    ix[:, 3 * N + nb] = 1  # padded streams: key 0 visible
    ix[:, : N] = SINK_BLOCK
    ix[:, 2 * N : 3 * N] = j
    ix[:B, 3 * N : 3 * N + nb] = table_tensor([c.state for c in calls], nb)
    for i, c in enumerate(calls):
        n = c.end - c.start
        pos = c.start + j
        table = torch.tensor(c.state.table, dtype=torch.long)
        ix[i, :n] = table[pos[:n] // Bf]
        ix[i, N : 2 * N] = pos % Bf
        ix[i, 2 * N : 3 * N] = pos
        ix[i, 3 * N + nb :] = torch.tensor([c.end, c.state.tail_slot, c.commit - c.start])
    ix[B:, 3 * N + nb + 1] = PAD_TAIL
    device, dtype = pool.device, pool.dtype

    def pad(xs: list[Tensor]) -> Tensor:
        out = torch.zeros(rows, *xs[0].shape[1:-1], N, dtype=dtype, device=device)
        for i, x in enumerate(xs):
            out[i, ..., : x.shape[-1]] = x[0]
        return out

    spk = torch.zeros(rows, spks[0].shape[-1], dtype=dtype, device=device)
    spk[:B] = torch.cat(spks).to(dtype)
    return PagedInputs(pad(mus), pad(conds), spk, ix.to(device, non_blocking=True), N, nb)


class PagedCall(DenseCall):
    """The `StageCall` interface (begin / left_context / keys_values / bias) over a `PagedInputs`, for
    `CausalConditionalDecoder.forward_cached` on 2B stream-major rows; static shapes only."""

    def __init__(self, pool: KVPool, inp: PagedInputs, chunk: int, num_left_chunks: int = -1) -> None:
        self.pool = pool
        w_block, w_off, q_pos, table, end, tail, tail_at = inp.parts()
        B, N, nb = table.shape[0], inp.n_frames, inp.n_blocks
        self.B, self.N, self.nb = B, N, nb
        self.w_block, self.w_off, self.table_flat, self.tail = w_block, w_off, table.reshape(-1), tail
        k = torch.arange(nb * pool.block_frames, device=table.device)[None, None]  # [1, 1, K]
        q = q_pos[:, :, None]  # [B, N, 1]
        block = q // chunk  # block-causal with full left context, as `chunk_mask`
        allowed = (k < (block + 1) * chunk) & (k < end[:, None, None])
        if num_left_chunks >= 0:
            allowed &= k >= (block - num_left_chunks).clamp(min=0) * chunk
        self._allowed = allowed.repeat_interleave(CFG_ROWS, dim=0)[:, None]  # [2B, 1, N, K]
        self._bias: Tensor | None = None
        self._tail_at = (tail_at.repeat_interleave(CFG_ROWS)[:, None, None]
                         + torch.arange(2, device=table.device))  # [2B, 1, 2]
        self._slot: int | None = None

    def begin(self, slot: int) -> None:
        self.flush()
        self._slot, self._conv, self._attn = slot, 0, 0
        tails = self.pool.tails[:, slot].index_select(0, self.tail)  # [B, rows, Σ C, 2], a copy
        self._tails = tails.flatten(0, 1)  # [2B, Σ C, 2]
        self._new_tails = torch.empty_like(self._tails)

    def flush(self) -> None:
        """Writes the evaluation's new conv tails into the streams' tail slots."""
        if self._slot is not None:
            self.pool.tails[:, self._slot].index_copy_(0, self.tail, self._new_tails.view(self.B, CFG_ROWS,
                                                                                            *self._tails.shape[1:]))
            self._slot = None

    def left_context(self, x: Tensor, n_ctx: int) -> Tensor:
        """x [2B, C, N] -> [2B, C, 2 + N] with each stream's committed left context; stages the tail
        at each stream's commit offset."""
        i = self._conv
        self._conv += 1
        o, C = self.pool.tail_offsets[i], self.pool.tail_channels[i]
        assert n_ctx == 2 and x.shape[1] == C, (n_ctx, C, x.shape)
        xx = torch.cat([self._tails[:, o : o + C], x], dim=-1)
        self._new_tails[:, o : o + C] = xx.gather(-1, self._tail_at.expand(-1, C, -1))
        return xx

    def keys_values(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v [2B, H, N, d] of the new frames -> the streams' keys/values [2B, H, nb·50, d]."""
        layer = self._attn
        self._attn += 1
        B, H, d = self.B, k.shape[1], k.shape[3]
        pool = self.pool.kv[:, self._slot, layer]  # [blocks, 2, rows, H, Bf, d], a view
        new = torch.stack([k, v]).view(2, B, CFG_ROWS, H, self.N, d).permute(1, 4, 0, 2, 3, 5)  # [B, N, 2, rows, H, d]
        pool.permute(0, 4, 1, 2, 3, 5)[self.w_block, self.w_off] = new
        kv = pool.index_select(0, self.table_flat).view(B, self.nb, 2, CFG_ROWS, H, -1, d)
        kv = kv.permute(2, 0, 3, 4, 1, 5, 6).reshape(2, B * CFG_ROWS, H, -1, d)  # [2, 2B, H, K, d]
        return kv[0], kv[1]

    def bias(self, rows: int, dtype: torch.dtype) -> Tensor:
        """Additive attention bias [2B, 1, N, K]: 0 where allowed, MASK_BIAS else."""
        assert rows == self._allowed.shape[0], (rows, self._allowed.shape)
        if self._bias is None or self._bias.dtype != dtype:
            self._bias = (1.0 - self._allowed.to(dtype)) * MASK_BIAS
        return self._bias


def paged_solve(flow: CausalFlow, pool: KVPool, inp: PagedInputs) -> Tensor:
    """The 10-step CFG solve of the padded streams' new frames -> x [B, 80, N] (flow dtype); writes
    their new keys/values and conv tails into the pool. Static shapes, no host sync (capturable)."""
    dims = flow.dims
    e = dims.estimator
    call = PagedCall(pool, inp, e.static_chunk_size, e.num_decoding_left_chunks)
    q_pos = inp.parts()[2]
    noise = flow.noise(inp.n_blocks * pool.block_frames, pool.device, inp.mu.dtype)  # [1, 80, K]
    x = noise[0][:, q_pos].permute(1, 0, 2)  # [B, 80, N]: each frame's noise by its absolute index

    return cfg_solve(flow, x, inp.mu, inp.spks, inp.cond, call)


def solve_calls(flow: CausalFlow, calls: list[PagedEstCall], mus: list[Tensor], spks: list[Tensor],
                conds: list[Tensor], graphs=None, work=None) -> list[Tensor]:
    """`incremental._solve_new` for B paged streams in one call: mus, conds [1, 80, n_i], spks [1, 80]
    -> fp32 [1, 80, n_i] each. `graphs`: a `PagedGraphs` (app/model/flow/paged_graphs.py) replays a
    captured bucket when one fits, else the packed call (app/model/flow/packed.py) runs eagerly.
    `work`: a `FlowWork` (app/model/flow/work.py) told the shape computed."""
    pool = calls[0].state.pool
    if graphs is not None:
        x = graphs.run(calls, mus, conds, spks)
        if x is not None:
            if work is not None:  # the bucket's rows x new frames, over its key blocks
                work.add(x.shape[0], x.shape[2], graphs.bucket(calls)[2] * pool.block_frames,
                         sum(c.end - c.start for c in calls))
            return [x[i : i + 1, :, : c.end - c.start].float() for i, c in enumerate(calls)]
    return solve_packed(flow, calls, mus, spks, conds, work)
