"""One encoder pass for several streams' incremental hops: their new tokens as rows of one batch, padded
to the longest, each stream's caches read and written through its own `StageCall`. Design notes:
docs/model.md.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from app.model.flow.encoder import UpsampleConformerEncoder
from app.model.flow.incremental.cache import StageCall


class BatchCall:
    """The `StageCall` interface of the encoder's layers over B streams' calls of one stage: rows of N (the
    most new positions) queries over E (the furthest end) keys. A row's padding queries see nothing (their
    outputs are never read: causal convs and masked keys keep them out of the real positions)."""

    def __init__(self, calls: list[StageCall], pad_row: int) -> None:
        """pad_row: a row of the stage's pool tensor that holds zeros (the pool's pad block)."""
        self.calls, self.table, self.kv, self._pos, self._attn = calls, calls[0].table, calls[0].kv, 0, 0
        assert all(c.table is self.table and c.kv is self.kv for c in calls), "streams of one pass share one pool"
        n = [c.end - c.start for c in calls]
        self.N, self.E = max(n), max(c.end for c in calls)
        device = calls[0].hidden.device
        # every stream's new positions in one write (rows of k [B·N] -> rows of the pool), every row's keys in
        # one read (zeros past its end: the pad block); built on the host, moved in one non-blocking copy
        new_rows = torch.cat([c.host_rows[c.start :] for c in calls])
        new_from = torch.cat([b * self.N + torch.arange(nb) for b, nb in enumerate(n)])
        read = torch.full((len(calls), self.E), pad_row, dtype=torch.long)
        for b, c in enumerate(calls):
            read[b, : c.end] = c.host_rows
        ix = torch.cat([new_rows, new_from, read.view(-1)]).to(device, non_blocking=True)
        self.new_rows, self.new_from, self.read_rows = ix.split([len(new_rows), len(new_from), read.numel()])
        hidden = torch.ones(len(calls), 1, self.N, self.E, dtype=torch.bool, device=device)
        cols = torch.zeros(len(calls), 1, self.N, self.E, dtype=torch.long, device=device)
        for b, (c, nb) in enumerate(zip(calls, n, strict=True)):
            hidden[b, 0, :nb, : c.end] = c.hidden
            # a row's position table is placed N - n_b columns on (`positions`), its columns with it
            cols[b, 0, :nb, : c.end] = c.position_columns[0, 0] + (self.N - nb)
        self.attention_hidden, self.position_columns = hidden, cols

    def left_context(self, x: Tensor, n_ctx: int) -> Tensor:
        """x [B, C, N'] -> [B, C, n_ctx + N']: each row behind its own stream's conv inputs before `start`;
        each stream stages its tail at its own commit."""
        tails = torch.cat([c.committed_tail(x[b : b + 1], n_ctx) for b, c in enumerate(self.calls)])
        xx = torch.cat([tails, x], dim=-1)
        for b, c in enumerate(self.calls):
            at = c.commit - c.start
            c.stage_tail(xx[b : b + 1, :, at : at + n_ctx].clone())
        return xx

    def keys_values(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v [B, H, N, d] -> every stream's keys/values [B, H, E, d] (zeros past a stream's end); each
        stream's new ones written to its blocks."""
        B, H, N, d = k.shape
        layer = self._attn
        self._attn += 1
        out = []
        for i, x in enumerate((k, v)):
            pool = self.kv[i, layer]  # [blocks·r, H, d]
            pool.index_copy_(0, self.new_rows, x.transpose(1, 2).reshape(B * N, H, d).index_select(0, self.new_from))
            out.append(pool.index_select(0, self.read_rows).view(B, self.E, H, d).transpose(1, 2))
        return out[0], out[1]

    def positions(self, linear_pos: nn.Linear, heads: int, d_head: int) -> Tensor:
        """Offsets -(N-1)..E-1 -> [1, H, N-1+E, d], one table for every row: row b's offsets -(n_b-1)..end_b-1
        sit at its columns N-n_b.. (`position_columns`), so column c is offset c-(N-1) in every row."""
        layer = self._pos
        self._pos += 1
        assert self.table.layers[layer] is linear_pos, "layers must call positions in the table's order"
        return self.table.rows(layer, self.N, self.E)


def forward_cached_batch(encoder: UpsampleConformerEncoder, xs: list[Tensor], aheads: list[Tensor | None],
                         tokens_calls: list[StageCall], frames_calls: list[StageCall],
                         pad_rows: tuple[int, int]) -> list[Tensor]:
    """`encoder.forward_cached` of B streams in one pass: xs [1, n_b, D_in], aheads [1, lookahead, D_in]
    or None (the end of the utterance) -> h [1, 2·n_b, D] each. pad_rows: a zero row of each stage's pool
    tensor."""
    L, n = encoder.lookahead, [x.shape[1] for x in xs]
    N = max(n)
    # each row: its new tokens, then its look-ahead, then zeros; the pre-look-ahead conv reads the row's first
    # N + L positions as (x, ahead), so a short row's look-ahead sits right after its own tokens
    rows = xs[0].new_zeros(len(xs), N + L, xs[0].shape[2])
    for b, (x, a) in enumerate(zip(xs, aheads, strict=True)):
        rows[b, : n[b]] = x[0]
        if a is not None:
            rows[b, n[b] : n[b] + L] = a[0]
    emb = encoder.embed.out(rows) * encoder.embed.xscale
    for b, a in enumerate(aheads):  # no look-ahead: the single path's zeros, not the embedding of a zero row
        if a is None:
            emb[b, n[b] : n[b] + L] = 0
    h = encoder.cached_layers(emb[:, :N], emb[:, N:], BatchCall(tokens_calls, pad_rows[0]),
                              BatchCall(frames_calls, pad_rows[1]))
    up = encoder.up_layer.stride
    return [h[b : b + 1, : up * nb] for b, nb in enumerate(n)]
