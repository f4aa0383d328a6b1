"""One encoder pass for several streams' incremental hops (app/model/flow/incremental/state.py) at static shapes:
B rows of N new tokens over E token keys (the frame stage: up·N over up·E), every index and length a device tensor
built on the host. The same pass runs eagerly at a call's tight shape and as a CUDA graph at a bucket's
(encoder_graphs.py). Design notes: docs/model.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from app.model.flow.flow import CausalFlow
from app.model.flow.incremental.encoder_rows import EncoderRows

META = 5  # per row: start, new tokens n, end, commit, final (0/1); a padding row is all zeros


@dataclass
class EncoderInputs:
    """The static inputs of one pass (device tensors; B, N, E and the encoder fix the shapes)."""

    index: Tensor  # int64: ids B·(N+L) | meta 5·B | token writes B·N | reads B·E | frame writes B·up·N | reads B·up·E
    tails: tuple[Tensor, Tensor]  # conv inputs before each row's start: token stage [B, D, 2], frames [B, D, 2·up]
    B: int
    N: int
    E: int

    def parts(self, lookahead: int, up: int) -> list[Tensor]:
        B, N, E = self.B, self.N, self.E
        return list(self.index.split([B * (N + lookahead), META * B, B * N, B * E, B * up * N, B * up * E]))

    def copy_(self, other: EncoderInputs) -> None:
        for a, b in ((self.index, other.index), *zip(self.tails, other.tails, strict=True)):
            a.copy_(b, non_blocking=True)


def encoder_inputs(flow: CausalFlow, rows: EncoderRows, plans: list, *, streams: int | None = None,
                   tokens: int | None = None, keys: int | None = None) -> EncoderInputs:
    """The inputs of `plans` (state.py's `_Plan`s: host token ids, the two `StageCall`s) as rows of one pass:
    `streams` rows (padding rows write to the sink and read the pad block), `tokens` new tokens and `keys` token
    keys per row (default: the plans' tight shape)."""
    enc = flow.encoder
    L, up = enc.lookahead, enc.up_layer.stride
    B = streams or len(plans)
    N = tokens or max(p.tok_call.end - p.tok_call.start for p in plans)
    E = keys or max(p.tok_call.end for p in plans)
    (sink_t, sink_f), (pad_t, pad_f) = rows.sink_rows, rows.pad_rows
    ids, meta = torch.zeros(B, N + L, dtype=torch.long), torch.zeros(META, B, dtype=torch.long)
    tw, tr = torch.full((B, N), sink_t), torch.full((B, E), pad_t)
    fw, fr = torch.full((B, up * N), sink_f), torch.full((B, up * E), pad_f)
    for b, p in enumerate(plans):
        t, f = p.tok_call, p.frm_call
        n = t.end - t.start
        assert n <= N and t.end <= E, "the plans exceed the pass's shape"
        ids[b, : p.ids.shape[0]] = p.ids  # new tokens, then the look-ahead (none at the end of the utterance)
        meta[:, b] = torch.tensor([t.start, n, t.end, t.commit, int(p.finalize)])
        tw[b, :n], tr[b, : t.end] = t.host_rows[t.start :], t.host_rows
        fw[b, : up * n], fr[b, : f.end] = f.host_rows[f.start :], f.host_rows
    device = rows.kv[0].device
    index = torch.cat([x.view(-1) for x in (ids, meta, tw, tr, fw, fr)]).to(device, non_blocking=True)
    D = enc.dims.output_size
    tails = []
    convs = (enc.pre_lookahead_layer.conv2, enc.up_layer.conv)  # each stage's one causal conv
    for call, conv in zip(("tok_call", "frm_call"), convs, strict=True):
        n_ctx = conv.kernel_size[0] - 1
        zeros = rows.kv[0].new_zeros(1, D, n_ctx)
        held = [getattr(p, call).committed_tail(zeros) for p in plans]
        tails.append(torch.cat(held + [zeros] * (B - len(plans))))
    return EncoderInputs(index, (tails[0], tails[1]), B, N, E)


class StaticCall:
    """What the encoder's layers call over one stage of a pass (`left_context` per causal conv, `keys_values` and
    `positions` per attention layer, in their fixed order): B rows of N queries over E keys; a row's padding
    queries see nothing (their outputs are never read: causal convs and masked keys keep them out of the real
    positions), its padding keys read the pad block's zeros."""

    def __init__(self, kv: Tensor, table, writes: Tensor, reads: Tensor, meta: Tensor, tail: Tensor, *,
                 scale: int, chunk: int, N: int, E: int) -> None:
        """kv: the stage's pool tensor [2, layers, rows, H, d]; writes [B·N] / reads [B·E]: its rows of each row's
        new positions / keys; meta [5, B] in tokens (`scale` positions per token); tail [B, D, k-1]."""
        self.kv, self.table, self.writes, self.reads, self.tail, self.N, self.E = kv, table, writes, reads, tail, N, E
        start, n, end, commit = (m * scale for m in meta[:4])
        i, k = torch.arange(N, device=kv.device), torch.arange(E, device=kv.device)
        q = start[:, None] + i  # [B, N] absolute query positions
        real = (i < n[:, None])[:, :, None] & (k < end[:, None])[:, None, :]  # [B, N, E]
        hidden = ~real | (k >= (q // chunk + 1)[..., None] * chunk)  # block-causal, full left context
        self.attention_hidden = hidden[:, None]  # [B, 1, N, E]
        # row b's offsets q - k sit at column q - k + N - 1 of the one table (`positions`)
        self.position_columns = torch.where(real, q[..., None] - k + N - 1, 0)[:, None]  # [B, 1, N, E]
        self.at = commit - start  # [B]: the tail at the row's commit starts here in the conv's input
        self.staged: Tensor | None = None
        self._attn = self._pos = 0

    def left_context(self, x: Tensor, n_ctx: int) -> Tensor:
        """x [B, C, N'] -> [B, C, n_ctx + N'] behind each row's committed inputs; stages each row's tail at its
        commit (`staged`, [B, C, n_ctx]). One causal conv per stage."""
        assert self.staged is None and self.tail.shape[2] == n_ctx, "one causal conv per stage"
        xx = torch.cat([self.tail, x], dim=-1)
        at = (self.at[:, None] + torch.arange(n_ctx, device=x.device))[:, None].expand(-1, x.shape[1], -1)
        self.staged = xx.gather(-1, at)
        return xx

    def keys_values(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v [B, H, N, d] -> every row's keys/values [B, H, E, d]; the new ones written to the rows' blocks
        (padding positions to the sink block) in one write, the keys read in one gather, per layer."""
        B, H, N, d = k.shape
        layer = self._attn
        self._attn += 1
        out = []
        for i, x in enumerate((k, v)):
            pool = self.kv[i, layer]  # [rows, H, d]
            pool.index_copy_(0, self.writes, x.transpose(1, 2).reshape(B * N, H, d))
            out.append(pool.index_select(0, self.reads).view(B, self.E, H, d).transpose(1, 2))
        return out[0], out[1]

    def positions(self, linear_pos: nn.Linear, heads: int, d_head: int) -> Tensor:
        """Offsets -(N-1)..E-1 -> [1, H, N-1+E, d], one table for every row (column c is offset c-(N-1))."""
        layer = self._pos
        self._pos += 1
        assert self.table.layers[layer] is linear_pos, "layers must call positions in the table's order"
        return self.table.rows(layer, self.N, self.E)


def encode_rows(flow: CausalFlow, rows: EncoderRows, inp: EncoderInputs) -> tuple[Tensor, Tensor, Tensor]:
    """The pass: -> (mu [B, up·N, 80] of each row's new frames, the rows' conv tails at their commits: tokens
    [B, D, 2], frames [B, D, 2·up]); the new keys/values written to the pool. No host sync (CUDA graphs)."""
    enc = flow.encoder
    L, up = enc.lookahead, enc.up_layer.stride
    B, N, E, chunk = inp.B, inp.N, inp.E, enc.dims.static_chunk_size
    ids, meta, tw, tr, fw, fr = inp.parts(L, up)
    meta = meta.view(META, B)
    n, final = meta[1], meta[4]
    j = torch.arange(N + L, device=ids.device)
    # each row: its new tokens, then its look-ahead; at the end of the utterance the look-ahead reads zeros
    no_ahead = (j >= n[:, None]) & (j < n[:, None] + L) & (final[:, None] > 0)  # [B, N+L]
    emb = enc.embed.out(flow.input_embedding(ids.view(B, N + L))) * enc.embed.xscale
    emb = emb.masked_fill(no_ahead[..., None], 0.0)
    tokens = StaticCall(rows.kv[0], rows.positions[0], tw, tr, meta, inp.tails[0], scale=1, chunk=chunk, N=N, E=E)
    frames = StaticCall(rows.kv[1], rows.positions[1], fw, fr, meta, inp.tails[1], scale=up, chunk=up * chunk,
                        N=up * N, E=up * E)
    h = enc.cached_layers(emb[:, :N], emb[:, N:], tokens, frames)  # [B, up·N, D]
    return flow.encoder_proj(h), tokens.staged, frames.staged


def encoder_pass(flow: CausalFlow, plans: list, graphs=None) -> list[Tensor]:
    """The encoder pass of B streams' planned hops (`graphs`: an `EncoderGraphs` replays a captured bucket when
    one fits, else the pass runs eagerly at the plans' tight shape) -> mu [1, 80, up·n_b] each; each stream's
    conv tails staged in its `StageCall`s (committed by `finish`)."""
    rows = plans[0].state.est.pool.encoder
    out = graphs.run(plans) if graphs is not None else None
    if out is None:
        out = encode_rows(flow, rows, encoder_inputs(flow, rows, plans))
    mu, tok_tails, frm_tails = out
    up = flow.encoder.up_layer.stride
    for b, p in enumerate(plans):
        p.tok_call.stage_tail(tok_tails[b : b + 1])
        p.frm_call.stage_tail(frm_tails[b : b + 1])
    return [mu[b : b + 1, : up * (p.tok_call.end - p.tok_call.start)].transpose(1, 2) for b, p in enumerate(plans)]
