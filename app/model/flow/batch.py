"""Several streams' incremental hops in one estimator call (cross-stream batching of
app/model/flow/incremental.py).

Each stream runs its own encoder pass (`prepare_hop`: token-rate work, a few % of the flow's), then
the 10-step CFG solve runs once for all of them: rows are stream-major, (conditional, unconditional)
per stream, so 2B rows for B streams; each stream's new frames are right-padded to the longest call
(N frames) and its keys to the longest key range (K = max end). Why the padded rows give each stream's
alone result: every conv is causal (right padding is never read by a valid frame), LayerNorms and
linears are per frame, and `BatchCall.bias` hides from stream i's queries every key at or after its
own end and every key the block-causal rule hides (the same MASK_BIAS as the alone path, so hidden
keys weigh exactly 0); padded queries keep at least one visible key (no empty softmax in fp16).
Numerically rows equal the alone call up to kernel rounding (GEMM/attention shapes differ; measured
in tests/test_incremental_batch.py).

Cost of the gather: per Euler evaluation every stream's committed keys/values (all layers) are copied
into one padded scratch buffer and the new ones copied back (`BatchCall`), i.e. one extra read of
the K/V the attention reads anyway, with a kernel count that does not grow with B inside a layer.
The scratch holds one evaluation's keys/values of all B streams: 1/10 of their states' bytes, padded
to the longest key range (not counted by the flow budget). The states keep their own storage.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from app.model.flow.cache import StageCall
from app.model.flow.estimator import MASK_BIAS, DenseCall
from app.model.flow.flow import CausalFlow
from app.model.flow.incremental import CFG_ROWS, FlowState, _solve_new, prepare_hop
from app.model.flow.packed import cfg_solve
from app.model.flow.paged_solve import solve_calls


class BatchCall(DenseCall):
    """The `StageCall` interface (begin / left_context / keys_values / bias) over B streams'
    estimator calls, for `CausalConditionalDecoder.forward_cached` on 2B stream-major rows.

    Kernel count does not grow with B inside a layer: `begin(slot)` gathers every stream's committed
    keys/values of that Euler evaluation, all layers at once, into one padded scratch buffer
    [2 (K/V), layers, 2B, H, T, d] (one copy per stream), each layer scatters its new keys/values
    into it (one op for all streams), and the next `begin` (or `flush`) writes each stream's new ones
    back into its own state (one copy per stream). Conv left contexts: one concatenation and one
    gather per conv for all streams.
    """

    def __init__(self, calls: list[StageCall], chunk: int, num_left_chunks: int = -1) -> None:
        self.calls = calls
        self.n = [c.end - c.start for c in calls]  # new frames per stream
        self.n_max, self.k_max = max(self.n), max(c.end for c in calls)
        kv = calls[0].state.kv.data  # [2, layers, slots, rows, heads, T, d]
        device = kv.device
        start = torch.tensor([c.start for c in calls], device=device)[:, None, None]  # [B, 1, 1]
        end = torch.tensor([c.end for c in calls], device=device)[:, None, None]
        q = start + torch.arange(self.n_max, device=device)[None, :, None]  # absolute query positions [B, N, 1]
        k = torch.arange(self.k_max, device=device)[None, None, :]  # [1, 1, K]
        block = q // chunk  # block-causal with full left context, as `chunk_mask`
        allowed = (k < (block + 1) * chunk) & (k < end)  # keys at or after a stream's end are padding
        if num_left_chunks >= 0:
            allowed &= k >= (block - num_left_chunks).clamp(min=0) * chunk
        self._allowed = allowed.repeat_interleave(CFG_ROWS, dim=0)[:, None]  # [2B, 1, N, K]
        self._bias: Tensor | None = None
        rows, heads, d = CFG_ROWS * len(calls), kv.shape[4], kv.shape[6]
        # scratch positions reach max(start) + N so padded new frames land past every stream's own end
        # (never on another's valid key: rows are separate, and within a row past `end` is hidden);
        # zeros: padded keys must be finite (their weight 0 times the value must stay 0)
        t_len = max(c.start for c in calls) + self.n_max
        self._kv = kv.new_zeros(2, kv.shape[1], rows, heads, t_len, d)
        self._where = q.repeat_interleave(CFG_ROWS, dim=0)[:, None].expand(rows, heads, self.n_max, d)  # [2B, H, N, d]
        off = torch.tensor([c.commit - c.start for c in calls], device=device).repeat_interleave(CFG_ROWS)
        self._tail_at = off[:, None, None]  # [2B, 1, 1]: where each row's new conv tail starts in xx
        self._slot: int | None = None
        self._attn = 0

    def _rows(self, i: int) -> slice:
        return slice(CFG_ROWS * i, CFG_ROWS * (i + 1))

    def begin(self, slot: int) -> None:
        self.flush()
        for i, c in enumerate(self.calls):
            c.begin(slot)
            if c.start:
                self._kv[:, :, self._rows(i), :, : c.start] = c.state.kv.data[:, :, slot, :, :, : c.start]
        self._slot, self._attn = slot, 0

    def flush(self) -> None:
        """Write each stream's new keys/values of the current evaluation into its own state."""
        if self._slot is None:
            return
        for i, c in enumerate(self.calls):
            c.state.kv.data[:, :, self._slot, :, :, c.start : c.end] = self._kv[:, :, self._rows(i), :, c.start : c.end]
        self._slot = None

    def left_context(self, x: Tensor, n_ctx: int) -> Tensor:
        """x [2B, C, N] -> [2B, C, n_ctx + N] with each stream's committed left context; stages each
        stream's tail at its own commit edge (as `StageCall.left_context` does per stream)."""
        tails = [c.committed_tail(x[self._rows(i)], n_ctx) for i, c in enumerate(self.calls)]
        xx = torch.cat([torch.cat(tails), x], dim=-1)
        at = self._tail_at + torch.arange(n_ctx, device=x.device)  # [2B, 1, n_ctx]
        new_tails = xx.gather(-1, at.expand(-1, xx.shape[1], -1))  # [2B, C, n_ctx], a fresh tensor
        for i, c in enumerate(self.calls):
            c.stage_tail(new_tails[self._rows(i)])
        return xx

    def keys_values(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v [2B, H, N, d] of the new frames -> padded keys/values [2B, H, K, d] (views of the
        scratch buffer)."""
        layer = self._attn
        self._attn += 1
        keys, values = self._kv[0, layer], self._kv[1, layer]  # [2B, H, T, d]
        keys.scatter_(2, self._where, k)
        values.scatter_(2, self._where, v)
        return keys[:, :, : self.k_max], values[:, :, : self.k_max]

    def bias(self, rows: int, dtype: torch.dtype) -> Tensor:
        """Additive attention bias [2B, 1, N, K]: 0 where allowed, MASK_BIAS else."""
        assert rows == self._allowed.shape[0], (rows, self._allowed.shape)
        if self._bias is None or self._bias.dtype != dtype:
            self._bias = (1.0 - self._allowed.to(dtype)) * MASK_BIAS
        return self._bias


def solve_batch(flow: CausalFlow, calls: list[StageCall], mus: list[Tensor], spks: list[Tensor],
                conds: list[Tensor]) -> list[Tensor]:
    """`incremental._solve_new` for B streams in one estimator call per Euler evaluation.

    mus, conds: [1, 80, n_i] of each stream's new frames; spks: [1, 80]. Returns fp32 [1, 80, n_i] each.
    """
    B, dims = len(calls), flow.dims
    e = dims.estimator
    batch = BatchCall(calls, e.static_chunk_size, e.num_decoding_left_chunks)
    N = batch.n_max
    dtype, device = mus[0].dtype, mus[0].device

    def pad(a: Tensor) -> Tensor:
        return F.pad(a, (0, N - a.shape[-1]))

    x = torch.cat([pad(flow.noise(c.end, device, dtype)[:, :, c.start:]) for c in calls])  # [B, 80, N]
    mu, cond, spk = torch.cat([pad(m) for m in mus]), torch.cat([pad(c) for c in conds]), torch.cat(spks)

    x = cfg_solve(flow, x, mu, spk, cond, batch)
    return [x[i : i + 1, :, : batch.n[i]].float() for i in range(B)]


@torch.inference_mode()
def incremental_batch(flow: CausalFlow, states: list[FlowState], tokens: list[Tensor], *,
                      finalize: list[bool], token_offsets: list[int], graphs=None,
                      work=None) -> list[Tensor | ValueError]:
    """`incremental_inference` of B streams (one call each, distinct states), the estimator batched.

    tokens[i]: [1, N_i] stream i's generated prefix; finalize/token_offsets: per stream. Returns per
    stream its fp32 mel [1, 80, T_i], or the ValueError that refused its call (its state unchanged;
    the other streams still run; `PoolFull` when a pooled state found no free blocks). Pooled states
    (app/model/flow/paged.py) solve together over the pool (`graphs`: a `PagedGraphs` to replay).
    `work`: a `FlowWork` (app/model/flow/work.py) told each solve's shape.
    """
    assert len({id(s) for s in states}) == len(states), "one call per stream state"
    out: list[Tensor | ValueError] = []
    hops = []
    for state, tok, fin, off in zip(states, tokens, finalize, token_offsets, strict=True):
        try:
            hops.append(prepare_hop(flow, state, tok, finalize=fin, token_offset=off))
            out.append(None)  # filled below
        except ValueError as e:
            out.append(e)
    if not hops:
        return out
    all_hops = list(hops)
    if work is not None and any(not h.state.paged for h in hops):  # unpaged: rows x the longest, its keys
        own = [h.est_call for h in hops if not h.state.paged]
        work.add(len(own), max(c.end - c.start for c in own), max(c.end for c in own),
                 sum(c.end - c.start for c in own))
    paged = [h for h in hops if h.state.paged]
    if paged:  # over the pool: one static-shape solve (replayed when a captured bucket fits)
        mels = solve_calls(flow, [h.est_call for h in paged], [h.mu for h in paged],
                           [h.state.spks for h in paged], [h.cond for h in paged], graphs, work)
        done = {id(h): m for h, m in zip(paged, mels, strict=True)}
        hops = [h for h in hops if not h.state.paged]
        mels = solve_batch(flow, [h.est_call for h in hops], [h.mu for h in hops],
                           [h.state.spks for h in hops], [h.cond for h in hops]) if len(hops) > 1 else \
            [_solve_new(flow, h.est_call, h.mu, h.state.spks, h.cond) for h in hops]
        done |= {id(h): m for h, m in zip(hops, mels, strict=True)}
        hops = all_hops
        mels = [done[id(h)] for h in hops]
    elif len(hops) == 1:  # one stream: its own keys/values in place, no gather (the alone path)
        h = hops[0]
        mels = [_solve_new(flow, h.est_call, h.mu, h.state.spks, h.cond)]
    else:
        mels = solve_batch(flow, [h.est_call for h in hops], [h.mu for h in hops],
                           [h.state.spks for h in hops], [h.cond for h in hops])
    done = iter(h.commit(m) for h, m in zip(hops, mels, strict=True))
    return [next(done) if o is None else o for o in out]
