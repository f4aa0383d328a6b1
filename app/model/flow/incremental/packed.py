"""The estimator solve of S streams' incremental hops over a `KVPool` (app/model/flow/incremental/paged.py), their new
frames packed in one row: no padding, static shapes (CUDA graphs: app/model/flow/incremental/paged_graphs.py).
Design notes: docs/model.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from app.model.flow.flow import CausalFlow, cosine_time_grid
from app.model.flow.incremental.paged import CFG_ROWS, PAD_BLOCK, PAD_TAIL, SINK_BLOCK, KVPool, PagedEstCall


@dataclass
class PackedInputs:
    """The static inputs of one packed solve (device tensors; S, M, K, G fix the shapes)."""

    x: Tensor  # [1, 80, M] each frame's noise (by its absolute index), flow dtype
    mu: Tensor  # [1, 80, M]
    cond: Tensor  # [1, 80, M]
    spk: Tensor  # [1, M, 80] each frame's stream's speaker vector
    index: Tensor  # int64: writes (M) | cols (3M) | tail_at (2S) | keys (K) | tail (S); pool rows are block·50 + offset
    seg: Tensor  # int32 [3, G + 1]: query starts | key starts | key lengths (each segment; the last column closes)
    S: int
    M: int
    K: int
    max_q: int  # the longest segment's queries: one chunk (CUDA launch bound)

    def parts(self) -> list[Tensor]:
        M, S, K = self.M, self.S, self.K
        return list(self.index.split([M, 3 * M, 2 * S, K, S]))

    def copy_(self, other: PackedInputs) -> None:
        for a, b in ((self.x, other.x), (self.mu, other.mu), (self.cond, other.cond), (self.spk, other.spk),
                     (self.index, other.index), (self.seg, other.seg)):
            a.copy_(b, non_blocking=True)


def _segments(c: PagedEstCall, chunk: int, left: int):
    """(q0, q1, k0) of each chunk segment of a call: queries q0..q1-1 see keys k0..q1-1 (block-causal as
    `chunk_mask`, `left` chunks of left context, -1: all)."""
    for ch in range(c.start // chunk, (c.end - 1) // chunk + 1):
        q1 = min(c.end, (ch + 1) * chunk)
        yield max(c.start, ch * chunk), q1, 0 if left < 0 else max(0, (ch - left) * chunk)


def segments_bound(streams: int, frames: int, chunk: int) -> int:
    """Segments a bucket provides: each stream's chunks (one more where a hop starts mid-chunk) and
    the padding frames' own (at most one chunk each)."""
    return 2 * streams + 2 * -(-frames // chunk) + 2


def pack(flow: CausalFlow, pool: KVPool, calls: list[PagedEstCall], mus: list[Tensor], conds: list[Tensor],
         spks: list[Tensor], *, streams: int | None = None, frames: int | None = None,
         keys: int | None = None) -> PackedInputs:
    """The static inputs of `calls` (mus, conds [1, 80, n_i], spks [1, 80]), padded to a bucket of
    (streams, frames, keys); None: the tightest."""
    e = flow.dims.estimator
    chunk, left, Bf = e.static_chunk_size, e.num_decoding_left_chunks, pool.block_frames
    S = streams or len(calls)
    n = [c.end - c.start for c in calls]
    M, K = frames or sum(n), keys or sum(c.end for c in calls)
    assert len(calls) <= S and sum(n) <= M and sum(c.end for c in calls) <= K, (S, M, K)
    G = segments_bound(S, M, chunk)
    write, cols = torch.arange(M) % Bf + SINK_BLOCK * Bf, torch.zeros(M, 3, dtype=torch.long)  # padding: the sink
    tail_at, tail = torch.zeros(S, 2, dtype=torch.long), torch.full((S,), PAD_TAIL, dtype=torch.long)
    read = torch.full((K,), PAD_BLOCK * Bf, dtype=torch.long)  # padding keys: zeros
    seg_q, seg_k, seg_n = [], [], []
    q, k = 0, 0  # packed offsets of the next stream's frames and keys
    for s, c in enumerate(calls):
        table = torch.tensor(c.state.table, dtype=torch.long)

        def ext(p: Tensor, s: int = s, q: int = q) -> Tensor:  # local position (-2, -1: tail) -> row in tails + frames
            return torch.where(p >= 0, 2 * S + q + p, 2 * s + 2 + p)

        pos = torch.arange(c.start, c.end)
        write[q : q + n[s]] = table[pos // Bf] * Bf + pos % Bf
        cols[q : q + n[s]] = ext(torch.arange(n[s])[:, None] + torch.arange(-2, 1))  # taps t-2, t-1, t
        tail_at[s] = ext(torch.arange(-2, 0) + (c.commit - c.start))  # the 2 frames before the commit
        tail[s] = c.state.tail_slot
        keys_s = torch.arange(c.end)
        read[k : k + c.end] = table[keys_s // Bf] * Bf + keys_s % Bf
        for q0, q1, k0 in _segments(c, chunk, left):
            seg_q.append(q + q0 - c.start)
            seg_k.append(k + k0)
            seg_n.append(q1 - k0)
        q, k = q + n[s], k + c.end
    pad_key = k if k < K else 0  # a zero key (PAD_BLOCK) when the bucket has one spare
    for p0 in range(q, M, chunk):  # padding frames: their own segments of one key each
        seg_q.append(p0)
        seg_k.append(pad_key)
        seg_n.append(1)
    assert len(seg_q) <= G, (len(seg_q), G)
    seg_q += [M] * (G + 1 - len(seg_q))  # empty segments up to the bucket's count; the last closes
    seg_k += [pad_key] * (G + 1 - len(seg_k))
    seg_n += [1] * (G + 1 - len(seg_n))
    dev, dt = pool.device, pool.dtype
    ix = torch.cat([write, cols.flatten(), tail_at.flatten(), read, tail]).to(dev, non_blocking=True)
    seg = torch.tensor([seg_q, seg_k, seg_n], dtype=torch.int32).to(dev, non_blocking=True)

    def row(xs: list[Tensor]) -> Tensor:  # [1, 80, n_i] each -> [1, 80, M], zeros past the frames
        out = torch.zeros(1, 80, M, dtype=dt, device=dev)
        if xs:
            out[..., : sum(n)] = torch.cat([x.to(dt) for x in xs], dim=2)
        return out

    noise = flow.noise(max((c.end for c in calls), default=1), dev, dt)[0]  # [80, end]
    x = row([noise[:, c.start : c.end][None] for c in calls])
    spk = torch.zeros(1, M, 80, dtype=dt, device=dev)
    if calls:
        spk[0, : sum(n)] = torch.cat([sp.to(dt).expand(m, -1) for sp, m in zip(spks, n, strict=True)])
    return PackedInputs(x, row(mus), row(conds), spk, ix, seg, S, M, K, chunk)


class PackedCall:
    """`conv3` / `attend` for the estimator's `forward_cached` on the packed
    row [2, M, C]; `begin(evaluation)` per Euler step, `flush()` at the end. Static shapes only."""

    def __init__(self, pool: KVPool, inp: PackedInputs) -> None:
        self.pool, self.inp = pool, inp
        self.write, self.cols, self.tail_at, self.read, self.tail = inp.parts()
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
        rows, S, M = h.shape[0], self.inp.S, self.inp.M
        assert h.shape[1:] == (M, C), (h.shape, M, C)
        tails = self._tails[:, :, o : o + C].permute(1, 0, 3, 2).reshape(rows, 2 * S, C)
        xx = torch.cat([tails, h], dim=1)  # [rows, 2S + M, C]: every stream's tail, then the packed frames
        self._new_tails[:, :, o : o + C] = xx.index_select(1, self.tail_at).view(rows, S, 2, C).permute(1, 0, 3, 2)
        return F.linear(xx.index_select(1, self.cols).view(rows, M, 3 * C), w, b)

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q, k, v [rows, H, M, d] of the packed frames -> [rows, H, M, d]; writes k, v into the pool."""
        layer = self._attn
        self._attn += 1
        rows, H, M, d = q.shape
        frames = self.pool.frames(self._slot, layer)  # [blocks·Bf, K/V, rows, H, d], a view
        frames.index_copy_(0, self.write, torch.stack([k, v]).permute(3, 0, 1, 2, 4))
        # every stream's keys [0, end), packed: [K, rows·H, d] each, contiguous
        keys, values = (frames[:, i].index_select(0, self.read).view(-1, rows * H, d) for i in (0, 1))
        out = _varlen(q.permute(2, 0, 1, 3).reshape(M, rows * H, d), keys, values, self.inp)
        return out.view(M, rows, H, d).permute(1, 2, 0, 3)


def _varlen(q: Tensor, k: Tensor, v: Tensor, inp: PackedInputs) -> Tensor:
    """Each segment's queries over its keys: q [M, heads, d], k/v [K, heads, d] -> [M, heads, d]."""
    seg = inp.seg
    if q.is_cuda:  # one kernel for every segment: the SDPA memory-efficient kernel with offsets and lengths
        return torch.ops.aten._efficient_attention_forward(
            q[None], k[None], v[None], None, seg[0], seg[1], inp.max_q, None, 0.0, 0,
            False, seqlen_k=seg[2, :-1])[0][0]
    out = torch.zeros_like(q)
    (sq, sk, sn) = seg.tolist()
    for g in range(len(sq) - 1):
        q0, q1, k0, k1 = sq[g], sq[g + 1], sk[g], sk[g] + sn[g]
        if q1 > q0:
            out[q0:q1] = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1),
                                                        v[k0:k1].transpose(0, 1)).transpose(0, 1)
    return out


def packed_solve(flow: CausalFlow, pool: KVPool, inp: PackedInputs) -> Tensor:
    """The 10-step CFG solve of the packed frames -> x [1, 80, M] (flow dtype); writes their keys/values
    and conv tails into the pool. Static shapes, no host sync on CUDA (capturable)."""
    return cfg_solve(flow, inp.x, inp.mu, inp.spk, inp.cond, PackedCall(pool, inp))


def visible_pairs(calls: list[PagedEstCall], chunk: int, left: int = -1) -> int:
    """(query, key) pairs the calls' block-causal attention computes."""
    return sum((q1 - q0) * (q1 - k0) for c in calls for q0, q1, k0 in _segments(c, chunk, left))


def cfg_solve(flow: CausalFlow, x: Tensor, mu: Tensor, spk: Tensor, cond: Tensor, call) -> Tensor:
    """The flow's 10-step Euler solve with classifier-free guidance over cached estimator state, for B
    rows: x, mu, cond [B, 80, N] (x the frames' noise), spk [B, 80] (or per frame [B, N, 80]); `call`
    (the `PackedCall`) gets `begin(evaluation)` per step and `flush()` at the end. Returns x [B, 80, N]
    in x's dtype."""
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
