"""The estimator solve of S streams' incremental hops over a `KVPool` with their new frames packed in
one row: no row padding, no frame padding, each query over exactly its own visible keys.

Layout: the M = Σ n_s new frames, stream after stream, are one row [1, 80, M] (two with the CFG
pair). A causal k=3 conv reads, per frame, [x(t-2), x(t-1), x(t)] of its own stream: the streams'
committed tails (2 frames each) sit in front of the packed frames, and one index gather builds the
conv's im2col columns [rows, M, 3C] for one GEMM. Attention: each stream's new frames split at chunk
edges into *segments*; a segment's queries see keys [lo, min(end, chunk end)) of its stream (block-
causal as `chunk_mask`), gathered from the pool into one packed key row, and one variable-length
attention call covers every segment (CUDA: the memory-efficient kernel with cumulative lengths, any
dtype; CPU: one SDPA per segment). CFG rows ride as heads: q [M, 2H, d], keys [ΣK, 2H, d].
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import Tensor

from app.model.flow.flow import CausalFlow, cosine_time_grid
from app.model.flow.paged import CFG_ROWS, KVPool, PagedEstCall


class PackedCall:
    """`conv3` / `attend` (estimator `DenseCall`'s interface) for `forward_cached` on the packed row
    [2, M, C]; `begin(evaluation)` per Euler step, `flush()` at the end (as the padded calls)."""

    def __init__(self, pool: KVPool, calls: list[PagedEstCall], chunk: int, num_left_chunks: int = -1) -> None:
        Bf, S = pool.block_frames, len(calls)
        self.pool, self.S = pool, S
        self.n = [c.end - c.start for c in calls]
        self.M = sum(self.n)
        w_block, w_off, q_pos, cols, tail_at, k_block, k_off = [], [], [], [], [], [], []
        cu_q, cu_k, self._segments = [0], [0], []
        off = 0

        def ext(s: int, p: Tensor) -> Tensor:  # local positions (may be -2, -1: the tail) -> packed-with-tails row
            return torch.where(p >= 0, 2 * S + off + p, 2 * s + 2 + p)

        for s, c in enumerate(calls):
            table = torch.tensor(c.state.table, dtype=torch.long)
            pos = torch.arange(c.start, c.end)
            w_block.append(table[pos // Bf])
            w_off.append(pos % Bf)
            q_pos.append(pos)
            p = torch.arange(c.end - c.start)
            cols.append(ext(s, p[:, None] + torch.arange(-2, 1)))  # [n, 3]: taps t-2, t-1, t
            tail_at.append(ext(s, torch.arange(-2, 0) + (c.commit - c.start)))  # the 2 frames before commit
            for ch in range(c.start // chunk, (c.end - 1) // chunk + 1):
                q0, q1 = max(c.start, ch * chunk), min(c.end, (ch + 1) * chunk)
                k0 = 0 if num_left_chunks < 0 else max(0, (ch - num_left_chunks) * chunk)
                keys = torch.arange(k0, q1)
                k_block.append(table[keys // Bf])
                k_off.append(keys % Bf)
                cu_q.append(cu_q[-1] + q1 - q0)
                cu_k.append(cu_k[-1] + q1 - k0)
            off += c.end - c.start
        dev = pool.device
        ix = torch.cat([torch.cat(w_block), torch.cat(w_off), torch.cat(q_pos), torch.cat(cols).flatten(),
                        torch.cat(tail_at), torch.cat(k_block), torch.cat(k_off),
                        torch.tensor([c.state.tail_slot for c in calls])]).to(dev, non_blocking=True)
        M, K = self.M, cu_k[-1]
        self.w_block, self.w_off, self.q_pos, self.cols, self.tail_at, self.k_block, self.k_off, self.tail = \
            ix.split([M, M, M, 3 * M, 2 * S, K, K, S])
        self.cu_q, self.cu_k = cu_q, cu_k  # host ints: segment boundaries in the packed queries / keys
        self._cu = torch.tensor([cu_q, cu_k], dtype=torch.int32).to(dev, non_blocking=True)  # [2, segments + 1]
        self.max_q = max(b - a for a, b in pairwise(cu_q))
        self.max_k = max(b - a for a, b in pairwise(cu_k))
        self.pairs = sum((q1 - q0) * (k1 - k0)  # visible (query, key) pairs
                         for (q0, q1), (k0, k1) in zip(pairwise(cu_q), pairwise(cu_k), strict=True))
        self._slot: int | None = None

    def begin(self, slot: int) -> None:
        self.flush()
        self._slot, self._conv, self._attn = slot, 0, 0
        self._tails = self.pool.tails[:, slot].index_select(0, self.tail)  # [S, rows, Σ C, 2], a copy
        self._new_tails = torch.empty_like(self._tails)

    def flush(self) -> None:
        """Writes the evaluation's new conv tails into the streams' tail slots."""
        if self._slot is not None:
            self.pool.tails[:, self._slot].index_copy_(0, self.tail, self._new_tails)
            self._slot = None

    def conv3(self, h: Tensor, w: Tensor, b: Tensor) -> Tensor:
        """Causal k=3 conv of the packed frames h [rows, M, C] -> [rows, M, out]; stages the new tails."""
        i = self._conv
        self._conv += 1
        o, C = self.pool.tail_offsets[i], self.pool.tail_channels[i]
        assert h.shape[2] == C, (h.shape, C)
        rows = h.shape[0]
        tails = self._tails[:, :, o : o + C].permute(1, 0, 3, 2).reshape(rows, 2 * self.S, C)
        xx = torch.cat([tails, h], dim=1)  # [rows, 2S + M, C]: every stream's tail, then the packed frames
        self._new_tails[:, :, o : o + C] = xx.index_select(1, self.tail_at).view(rows, self.S, 2, C).permute(1, 0, 3, 2)
        return F.linear(xx.index_select(1, self.cols).view(rows, self.M, 3 * C), w, b)

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q, k, v [rows, H, M, d] of the packed frames -> [rows, H, M, d]; writes k, v into the pool."""
        layer = self._attn
        self._attn += 1
        rows, H, M, d = q.shape
        pool = self.pool.kv[:, self._slot, layer].permute(0, 4, 1, 2, 3, 5)  # [blocks, Bf, K/V, rows, H, d], a view
        pool[self.w_block, self.w_off] = torch.stack([k, v]).permute(3, 0, 1, 2, 4)
        kv = pool[self.k_block, self.k_off]  # [ΣK, K/V, rows, H, d]: each segment's visible keys, packed
        keys, values = (kv[:, i].reshape(-1, rows * H, d) for i in (0, 1))
        qq = q.permute(2, 0, 1, 3).reshape(M, rows * H, d)
        out = _varlen(qq, keys, values, self)
        return out.view(M, rows, H, d).permute(1, 2, 0, 3)


def _varlen(q: Tensor, k: Tensor, v: Tensor, call: PackedCall) -> Tensor:
    """Attention of each segment's queries over its keys: q [M, heads, d], k/v [ΣK, heads, d] -> [M, heads, d]."""
    if q.is_cuda:  # one kernel over every segment (the SDPA memory-efficient kernel, cumulative lengths)
        cu = call._cu
        return torch.ops.aten._efficient_attention_forward(
            q[None], k.contiguous()[None], v.contiguous()[None], None, cu[0], cu[1], call.max_q, call.max_k,
            0.0, 0, False)[0][0]
    out = torch.empty_like(q)
    for (q0, q1), (k0, k1) in zip(pairwise(call.cu_q), pairwise(call.cu_k), strict=True):
        out[q0:q1] = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1),
                                                    v[k0:k1].transpose(0, 1)).transpose(0, 1)
    return out


def solve_packed(flow: CausalFlow, calls: list[PagedEstCall], mus: list[Tensor], spks: list[Tensor],
                 conds: list[Tensor], work=None) -> list[Tensor]:
    """`incremental._solve_new` for S paged streams in one packed call: mus, conds [1, 80, n_i], spks
    [1, 80] -> fp32 [1, 80, n_i] each. `work`: a `FlowWork` told the frames and visible keys computed."""
    pool = calls[0].state.pool
    e = flow.dims.estimator
    call = PackedCall(pool, calls, e.static_chunk_size, e.num_decoding_left_chunks)
    dtype = pool.dtype
    noise = flow.noise(max(c.end for c in calls), pool.device, dtype)[0]  # [80, K]: by absolute frame
    x = noise[:, call.q_pos][None]  # [1, 80, M]
    mu = torch.cat([m.to(dtype) for m in mus], dim=2)
    cond = torch.cat([c.to(dtype) for c in conds], dim=2)
    spk = torch.cat([s.to(dtype).expand(n, -1) for s, n in zip(spks, call.n, strict=True)])[None]  # [1, M, 80]
    if work is not None:  # one row of M frames; attention counted by its visible (query, key) pairs
        work.add(1, call.M, call.pairs / call.M, call.M)
    x = cfg_solve(flow, x, mu, spk, cond, call)[0].float()  # [80, M]
    return [m[None] for m in x.split(call.n, dim=1)]


def cfg_solve(flow: CausalFlow, x: Tensor, mu: Tensor, spk: Tensor, cond: Tensor, call) -> Tensor:
    """The flow's 10-step Euler solve with classifier-free guidance over cached estimator state, for B
    padded streams at once: x, mu, cond [B, 80, N] (x the frames' noise), spk [B, 80]; `call` (a
    batched or paged cached-attention view) gets `begin(evaluation)` per step and `flush()` at the end.
    Returns x [B, 80, N] in x's dtype."""
    B, w = x.shape[0], flow.dims.inference_cfg_rate

    def pair(a: Tensor) -> Tensor:  # [B, ...] -> [2B, ...]: (row, zeros) per stream, as the CFG pair
        return torch.stack([a, torch.zeros_like(a)], dim=1).flatten(0, 1)

    mu2, spks2, cond2 = pair(mu), pair(spk), pair(cond)
    estimator = flow.decoder["estimator"]
    t_grid = cosine_time_grid(flow.dims.n_timesteps, x.dtype, x.device)
    t, dt = t_grid[0:1], t_grid[1] - t_grid[0]  # same accumulation as `_solve`
    for step in range(1, len(t_grid)):
        call.begin(step - 1)
        v = estimator.forward_cached(x.repeat_interleave(CFG_ROWS, dim=0), mu2, t.expand(CFG_ROWS * B), spks2,
                                     cond2, call)
        v = v.view(B, CFG_ROWS, *v.shape[1:])  # [B, (cond, uncond), 80, N]
        x = x + dt * ((1.0 + w) * v[:, 0] - w * v[:, 1])
        t = t + dt
        if step < len(t_grid) - 1:
            dt = t_grid[step + 1] - t
    call.flush()
    return x
