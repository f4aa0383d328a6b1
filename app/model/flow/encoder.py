"""The flow's token encoder: a conformer with relative positions that upsamples 25 Hz tokens to 50 Hz.

Design notes: docs/model.md.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from app.model.hparams import EncoderDims

if TYPE_CHECKING:  # annotations only: encode_batch.py imports this module (through the flow)
    from app.model.flow.incremental.encode_batch import StaticCall

UPSAMPLE_STRIDE = 2  # mel frames per token
NORM_EPS = 1e-5  # embed / after_norm LayerNorms
BLOCK_NORM_EPS = 1e-12  # norm_mha / norm_ff inside each conformer block


def pad_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """lengths [B] -> bool [B, 1, max_len], True where the position holds data."""
    return (torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]).unsqueeze(1)


def chunk_mask(size: int, chunk_size: int, num_left_chunks: int = -1,
               device: torch.device | None = None) -> torch.Tensor:
    """Block-causal mask bool [size, size]: query i sees key j iff j < (i // chunk + 1) · chunk.

    With `num_left_chunks >= 0` keys before `(i // chunk - num_left_chunks) · chunk` are hidden too.
    """
    pos = torch.arange(size, device=device)
    block = pos // chunk_size
    mask = pos[None, :] < ((block + 1) * chunk_size)[:, None]
    if num_left_chunks >= 0:
        mask &= pos[None, :] >= ((block - num_left_chunks).clamp(min=0) * chunk_size)[:, None]
    return mask


def attention_mask(valid: torch.Tensor, chunk_size: int, num_left_chunks: int = -1) -> torch.Tensor:
    """valid bool [B, 1, T] -> bool [B, 1 or T, T]; chunk_size 0 means full attention (padding only)."""
    if chunk_size <= 0:
        return valid
    return valid & chunk_mask(valid.shape[-1], chunk_size, num_left_chunks, valid.device)[None]


def relative_positions(size: int, dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """ESPnet relative sin/cos table [1, 2·size-1, dim] for offsets size-1, size-2, ..., -(size-1)."""
    div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32, device=device) * -(math.log(10000.0) / dim))
    # positive offsets are built as pos·div and negative ones as -pos·div: same floats as the reference
    pos = torch.arange(size, dtype=torch.float32, device=device)[:, None]
    ang_pos, ang_neg = pos * div, -1 * pos * div  # [size, dim/2]
    pe_pos = torch.stack([ang_pos.sin(), ang_pos.cos()], dim=-1).flatten(1).flip(0)  # offsets size-1..0
    pe_neg = torch.stack([ang_neg.sin(), ang_neg.cos()], dim=-1).flatten(1)[1:]  # offsets -1..-(size-1)
    return torch.cat([pe_pos, pe_neg], dim=0)[None].to(dtype)


def position_rows(offsets: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of `relative_positions` for the given offsets (int [n]) -> [n, dim], the same floats
    (negative offsets are built as -(pos·div), as the table does), for the cached encoder path."""
    div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32, device=offsets.device) * -(math.log(10000.0) / dim))
    ang = offsets.abs().to(torch.float32)[:, None] * div  # [n, dim/2]
    ang = torch.where(offsets[:, None] < 0, -ang, ang)
    return torch.stack([ang.sin(), ang.cos()], dim=-1).flatten(1).to(dtype)


class LinearEmbed(nn.Module):
    """`out` = Linear + LayerNorm; the result is scaled by √D (the rel-pos encoding's x-scale)."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.out = nn.Sequential(nn.Linear(in_dim, dim), nn.LayerNorm(dim, eps=NORM_EPS))
        self.xscale = math.sqrt(dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [B, T, in] -> ([B, T, D], pos_emb [1, 2T-1, D])
        x = self.out(x) * self.xscale
        return x, relative_positions(x.shape[1], x.shape[2], x.device, x.dtype)


class RelPosSelfAttention(nn.Module):
    """Multi-head self-attention with Transformer-XL style relative positions (ESPnet 'new' variant)."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads, self.d_head = n_heads, dim // n_heads
        self.linear_q = nn.Linear(dim, dim)
        self.linear_k = nn.Linear(dim, dim)
        self.linear_v = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(n_heads, self.d_head))
        self.pos_bias_v = nn.Parameter(torch.zeros(n_heads, self.d_head))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos_emb: torch.Tensor) -> torch.Tensor:
        # x: [B, T, D]; mask: bool [B, 1 or T, T]; pos_emb: [1, 2T-1, D]
        B, T, _ = x.shape
        H, Dh = self.n_heads, self.d_head
        q = self.linear_q(x).view(B, T, H, Dh)
        k = self.linear_k(x).view(B, T, H, Dh).transpose(1, 2)  # [B, H, T, Dh]
        v = self.linear_v(x).view(B, T, H, Dh).transpose(1, 2)
        p = self.linear_pos(pos_emb).view(1, -1, H, Dh).transpose(1, 2)  # [1, H, 2T-1, Dh]
        ac = (q + self.pos_bias_u).transpose(1, 2) @ k.transpose(-2, -1)  # [B, H, T, T]
        bd = (q + self.pos_bias_v).transpose(1, 2) @ p.transpose(-2, -1)  # [B, H, T, 2T-1]
        # column c of bd is offset T-1-c; query i / key j needs offset i-j, i.e. column T-1-i+j
        i = torch.arange(T, device=x.device)
        cols = (T - 1 - i[:, None] + i[None, :]).expand(B, H, T, T)
        scores = (ac + bd.gather(-1, cols)) / math.sqrt(Dh)
        hidden = ~mask.unsqueeze(1)  # [B, 1, 1 or T, T]
        attn = scores.masked_fill(hidden, -math.inf).softmax(dim=-1).masked_fill(hidden, 0.0)
        return self.linear_out((attn @ v).transpose(1, 2).reshape(B, T, H * Dh))

    def forward_cached(self, x: torch.Tensor, cache: StaticCall) -> torch.Tensor:
        """`forward` for the new positions only: x [B, n, D] at each row's absolute positions start..end-1 of
        `cache` (B streams' `StaticCall`, app/model/flow/incremental/encode_batch.py), whose keys/values hold the
        earlier ones."""
        B, n, _ = x.shape
        H, Dh = self.n_heads, self.d_head
        q = self.linear_q(x).view(B, n, H, Dh)
        k = self.linear_k(x).view(B, n, H, Dh).transpose(1, 2)  # [B, H, n, Dh]
        v = self.linear_v(x).view(B, n, H, Dh).transpose(1, 2)
        k, v = cache.keys_values(k, v)  # [B, H, end, Dh]: committed keys + these
        p = cache.positions(self.linear_pos, H, Dh)  # [1, H, n-1+end, Dh]: column c is offset c-(n-1)
        ac = (q + self.pos_bias_u).transpose(1, 2) @ k.transpose(-2, -1)  # [B, H, n, end]
        bd = (q + self.pos_bias_v).transpose(1, 2) @ p.transpose(-2, -1)  # [B, H, n, n-1+end]
        scores = (ac + bd.gather(-1, cache.position_columns.expand(B, H, -1, -1))) / math.sqrt(Dh)
        hidden = cache.attention_hidden  # bool [1 or B, 1, n, end]
        attn = scores.masked_fill(hidden, -math.inf).softmax(dim=-1).masked_fill(hidden, 0.0)
        return self.linear_out((attn @ v).transpose(1, 2).reshape(B, n, H * Dh))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w_1 = nn.Linear(dim, hidden)
        self.w_2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerBlock(nn.Module):
    """Pre-norm block: x + MHA(norm_mha(x)); x + FFN(norm_ff(x))."""

    def __init__(self, dim: int, n_heads: int, hidden: int):
        super().__init__()
        self.self_attn = RelPosSelfAttention(dim, n_heads)
        self.feed_forward = FeedForward(dim, hidden)
        self.norm_mha = nn.LayerNorm(dim, eps=BLOCK_NORM_EPS)
        self.norm_ff = nn.LayerNorm(dim, eps=BLOCK_NORM_EPS)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos_emb: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm_mha(x), mask, pos_emb)
        return x + self.feed_forward(self.norm_ff(x))

    def forward_cached(self, x: torch.Tensor, cache: StaticCall) -> torch.Tensor:
        x = x + self.self_attn.forward_cached(self.norm_mha(x), cache)
        return x + self.feed_forward(self.norm_ff(x))


class PreLookahead(nn.Module):
    """Residual conv pair: conv1 (k = lookahead+1) reads frames t..t+lookahead, conv2 (k=3) is causal."""

    def __init__(self, dim: int, lookahead: int):
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(dim, dim, lookahead + 1)
        self.conv2 = nn.Conv1d(dim, dim, 3)

    def forward(self, x: torch.Tensor, ahead: torch.Tensor) -> torch.Tensor:
        # x: [B, T, D]; ahead: [B, lookahead, D], the frames right after each row's last one
        # (embedded context tokens, or zeros at the end of the utterance)
        h = torch.cat([x, ahead], dim=1).transpose(1, 2)  # [B, D, T+lookahead]
        h = F.leaky_relu(self.conv1(h), 0.01)  # [B, D, T]
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))
        return h.transpose(1, 2) + x

    def forward_cached(self, x: torch.Tensor, ahead: torch.Tensor, cache: StaticCall) -> torch.Tensor:
        # x: [B, n, D] new tokens; ahead: [B, lookahead, D]; conv2's 2 earlier conv1 outputs come
        # from `cache` (conv1 itself looks only ahead)
        h = F.leaky_relu(self.conv1(torch.cat([x, ahead], dim=1).transpose(1, 2)), 0.01)  # [B, D, n]
        h = self.conv2(cache.left_context(h, self.conv2.kernel_size[0] - 1))
        return h.transpose(1, 2) + x


class Upsample(nn.Module):
    """Nearest-neighbour ×stride along time, then a causal Conv1d(k = 2·stride+1)."""

    def __init__(self, dim: int, stride: int = UPSAMPLE_STRIDE):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(dim, dim, 2 * stride + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, D, T] -> [B, D, stride·T]
        x = x.repeat_interleave(self.stride, dim=2)
        return self.conv(F.pad(x, (2 * self.stride, 0)))

    def forward_cached(self, x: torch.Tensor, cache: StaticCall) -> torch.Tensor:
        # x: [B, D, n] new tokens -> [B, D, stride·n]; the 2·stride earlier upsampled frames from `cache`
        # (nearest repeat by expand: no host sync, so a CUDA graph can capture it)
        x = x[..., None].expand(-1, -1, -1, self.stride).flatten(2)
        return self.conv(cache.left_context(x, 2 * self.stride))


class UpsampleConformerEncoder(nn.Module):
    """Token embeddings [B, N, D_in] -> hidden states [B, 2N, D] at the mel frame rate."""

    def __init__(self, dims: EncoderDims, lookahead: int):
        super().__init__()
        D = dims.output_size
        self.dims, self.lookahead = dims, lookahead
        self.embed = LinearEmbed(dims.input_size, D)
        self.pre_lookahead_layer = PreLookahead(D, lookahead)
        self.encoders = nn.ModuleList(
            ConformerBlock(D, dims.attention_heads, dims.linear_units) for _ in range(dims.num_blocks))
        self.up_layer = Upsample(D)
        self.up_embed = LinearEmbed(dims.input_size, D)
        self.up_encoders = nn.ModuleList(
            ConformerBlock(D, dims.attention_heads, dims.linear_units) for _ in range(dims.num_up_blocks))
        self.after_norm = nn.LayerNorm(D, eps=NORM_EPS)

    def forward(self, xs: torch.Tensor, lengths: torch.Tensor, context: torch.Tensor | None = None,
                *, streaming: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode token embeddings.

        xs: [B, N, D_in] (rows padded to N); lengths: [B] valid tokens per row;
        context: [B, lookahead, D_in] embeddings of the tokens right after each row (held back on
        non-final chunks) or None (the look-ahead then reads zeros);
        streaming: block-causal attention (chunks of `static_chunk_size` tokens, then ×2 frames).
        Returns (h [B, 2N, D] after `after_norm`, lengths [B] in frames).
        """
        B, N, _ = xs.shape
        valid = pad_mask(lengths, N)  # [B, 1, N]
        x, pos_emb = self.embed(xs)
        x = x * valid.transpose(1, 2)  # padded frames -> 0, as the look-ahead of an unpadded row sees
        ahead = x.new_zeros(B, self.lookahead, x.shape[2])
        if context is not None:
            ctx, _ = self.embed(context)
            # each row's context goes right after its last token (beyond N for full rows)
            x = torch.cat([x, ahead], dim=1)
            idx = lengths[:, None] + torch.arange(self.lookahead, device=x.device)
            x = x.scatter(1, idx[..., None].expand(-1, -1, x.shape[2]), ctx)
            x, ahead = x[:, :N], x[:, N:]
        chunk = self.dims.static_chunk_size if streaming else 0
        x = self.pre_lookahead_layer(x, ahead)
        mask = attention_mask(valid, chunk)
        for block in self.encoders:
            x = block(x, mask, pos_emb)

        x = self.up_layer(x.transpose(1, 2)).transpose(1, 2)  # [B, 2N, D]
        lengths = lengths * self.up_layer.stride
        valid = pad_mask(lengths, x.shape[1])
        x, pos_emb = self.up_embed(x)
        mask = attention_mask(valid, chunk * self.up_layer.stride)
        for block in self.up_encoders:
            x = block(x, mask, pos_emb)
        return self.after_norm(x), lengths

    def cached_layers(self, x: torch.Tensor, ahead: torch.Tensor, tokens_cache, frames_cache) -> torch.Tensor:
        """`forward(streaming=True)` for B rows of new tokens only, after the embedding: x [B, n, D], ahead
        [B, lookahead, D] -> h [B, 2n, D]; the caches are the token and frame stages' `StaticCall`s
        (app/model/flow/incremental/encode_batch.py), which hold the earlier positions."""
        x = self.pre_lookahead_layer.forward_cached(x, ahead, tokens_cache)
        for block in self.encoders:
            x = block.forward_cached(x, tokens_cache)
        x = self.up_layer.forward_cached(x.transpose(1, 2), frames_cache).transpose(1, 2)  # [B, 2n, D]
        x = self.up_embed.out(x) * self.up_embed.xscale
        for block in self.up_encoders:
            x = block.forward_cached(x, frames_cache)
        return self.after_norm(x)
