"""The flow-matching velocity estimator (official `CausalConditionalDecoder`, a 1-D U-Net without
any actual down/up-sampling).

Input channels are `[x, mu, spks broadcast over time, cond]` (4 × 80). A sinusoidal embedding of
the flow time t goes through `time_mlp` and is added inside every resnet block. Layout:
down (resnet in→C, n_blocks transformer blocks, causal conv; skip saved before the conv),
mid (num_mid_blocks × (resnet C→C + n_blocks blocks)), up (concat skip → resnet 2C→C, blocks,
causal conv), `final_block`, `final_proj`. Convs are causal (left padding), so streaming chunks
only need the chunk attention mask. Parameter names match the official checkpoint.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from app.model.flow.encoder import attention_mask
from app.model.hparams import EstimatorDims

if TYPE_CHECKING:  # annotations only: cache.py imports this module
    from app.model.flow.cache import StageCall

TIME_SCALE = 1000.0  # t in [0, 1] is scaled before the sinusoidal embedding
MASK_BIAS = -1.0e10  # additive attention bias at hidden keys


def time_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t [B] -> [B, dim]: [sin(1000·t·f_i), cos(1000·t·f_i)], f_i = 10000^(-i/(dim/2-1))."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    ang = TIME_SCALE * t.reshape(-1, 1) * freqs[None, :]
    return torch.cat([ang.sin(), ang.cos()], dim=-1)


class CausalConv1d(nn.Conv1d):
    """Conv1d (stride 1) that pads kernel_size-1 zeros on the left: output t sees inputs ≤ t."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))

    def forward_cached(self, x: torch.Tensor, cache: StageCall) -> torch.Tensor:
        # x: [B, C, n] new frames; the kernel_size-1 frames before them come from `cache` (a
        # `StageCall`, app/model/flow/cache.py) instead of zeros
        return super().forward(cache.left_context(x, self.kernel_size[0] - 1))


class _Transpose(nn.Module):
    """[B, C, T] <-> [B, T, C]; a placeholder that keeps the official `block.{0,2}` indices."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


class CausalBlock1D(nn.Module):
    """mask → causal conv k3 → LayerNorm over channels → Mish → mask."""

    def __init__(self, dim: int, dim_out: int):
        super().__init__()
        self.block = nn.Sequential(CausalConv1d(dim, dim_out, 3), _Transpose(), nn.LayerNorm(dim_out),
                                   _Transpose(), nn.Mish())

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.block(x * mask) * mask

    def forward_cached(self, x: torch.Tensor, cache: StageCall) -> torch.Tensor:
        # every new frame is valid (mask 1): the masking is the identity
        conv, *rest = self.block
        x = conv.forward_cached(x, cache)
        for layer in rest:
            x = layer(x)
        return x


class CausalResnetBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, dim_out))
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        # x: [B, dim, T]; mask: [B, 1, T]; t_emb: [B, time_dim]
        h = self.block1(x, mask) + self.mlp(t_emb).unsqueeze(-1)
        return self.block2(h, mask) + self.res_conv(x * mask)

    def forward_cached(self, x: torch.Tensor, t_emb: torch.Tensor, cache: StageCall) -> torch.Tensor:
        h = self.block1.forward_cached(x, cache) + self.mlp(t_emb).unsqueeze(-1)
        return self.block2.forward_cached(h, cache) + self.res_conv(x)


class SelfAttention(nn.Module):
    """q/k/v without bias, `to_out.0` with bias (diffusers `Attention` names)."""

    def __init__(self, dim: int, n_heads: int, d_head: int):
        super().__init__()
        self.n_heads, self.d_head = n_heads, d_head
        inner = n_heads * d_head
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Dropout(0.0)])

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        # x: [B, T, dim]; bias: [B, 1, T or 1, T] additive (0 or MASK_BIAS)
        B, T, _ = x.shape
        q, k, v = (lin(x).view(B, T, self.n_heads, self.d_head).transpose(1, 2)
                   for lin in (self.to_q, self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # [B, H, T, d_head]
        return self.to_out[0](out.transpose(1, 2).reshape(B, T, -1))

    def forward_cached(self, x: torch.Tensor, cache: StageCall) -> torch.Tensor:
        # x: [B, n, dim] new frames; keys/values of the earlier frames come from `cache`
        B, n, _ = x.shape
        q, k, v = (lin(x).view(B, n, self.n_heads, self.d_head).transpose(1, 2)
                   for lin in (self.to_q, self.to_k, self.to_v))
        k, v = cache.keys_values(k, v)  # [B, H, end, d_head]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.bias(B, x.dtype))  # [B, H, n, d_head]
        return self.to_out[0](out.transpose(1, 2).reshape(B, n, -1))


class _GeluProj(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj = nn.Linear(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 4):
        super().__init__()
        self.net = nn.Sequential(_GeluProj(dim, dim * mult), nn.Dropout(0.0), nn.Linear(dim * mult, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TransformerBlock(nn.Module):
    """x + attn1(norm1(x)); x + ff(norm3(x)). No cross-attention; t is not used here."""

    def __init__(self, dim: int, n_heads: int, d_head: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = SelfAttention(dim, n_heads, d_head)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x), bias)
        return x + self.ff(self.norm3(x))

    def forward_cached(self, x: torch.Tensor, cache: StageCall) -> torch.Tensor:
        x = x + self.attn1.forward_cached(self.norm1(x), cache)
        return x + self.ff(self.norm3(x))


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int, time_dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(dim, time_dim)
        self.linear_2 = nn.Linear(time_dim, time_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class CausalConditionalDecoder(nn.Module):
    """Velocity field v(x, t | mu, spks, cond); see the module docstring for the layout."""

    def __init__(self, dims: EstimatorDims):
        super().__init__()
        if len(dims.channels) != 1:
            raise ValueError(f"estimator channels {dims.channels}: only one U-Net level is supported "
                             "(CosyVoice2 uses one; deeper levels would need strided down/up-sampling)")
        C, time_dim = dims.channels[0], dims.channels[0] * 4
        self.dims = dims

        def blocks() -> nn.ModuleList:
            return nn.ModuleList(TransformerBlock(C, dims.num_heads, dims.attention_head_dim)
                                 for _ in range(dims.n_blocks))

        self.time_mlp = TimestepEmbedding(dims.in_channels, time_dim)
        self.down_blocks = nn.ModuleList([nn.ModuleList(
            [CausalResnetBlock1D(dims.in_channels, C, time_dim), blocks(), CausalConv1d(C, C, 3)])])
        self.mid_blocks = nn.ModuleList(nn.ModuleList([CausalResnetBlock1D(C, C, time_dim), blocks()])
                                        for _ in range(dims.num_mid_blocks))
        self.up_blocks = nn.ModuleList([nn.ModuleList(
            [CausalResnetBlock1D(2 * C, C, time_dim), blocks(), CausalConv1d(C, C, 3)])])
        self.final_block = CausalBlock1D(C, C)
        self.final_proj = nn.Conv1d(C, dims.out_channels, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                spks: torch.Tensor, cond: torch.Tensor, *, streaming: bool) -> torch.Tensor:
        """One velocity evaluation.

        x, mu, cond: [B, 80, T]; mask: [B, 1, T] (1 = valid frame); t: [B] flow time in [0, 1];
        spks: [B, 80]; streaming: block-causal attention in chunks of `static_chunk_size` frames
        (full left context), else full attention. Returns the velocity [B, 80, T] (× mask).
        """
        t_emb = self.time_mlp(time_embedding(t, self.dims.in_channels).to(t.dtype))  # [B, 4C]
        h = torch.cat([x, mu, spks[:, :, None].expand(-1, -1, x.shape[2]), cond], dim=1)
        chunk = self.dims.static_chunk_size if streaming else 0
        allowed = attention_mask(mask.bool(), chunk, self.dims.num_decoding_left_chunks)
        bias = ((1.0 - allowed.to(h.dtype)) * MASK_BIAS).unsqueeze(1)  # [B, 1, T or 1, T]

        def transformer(h: torch.Tensor, blocks: nn.ModuleList) -> torch.Tensor:
            h = h.transpose(1, 2)  # [B, T, C]
            for block in blocks:
                h = block(h, bias)
            return h.transpose(1, 2)

        (resnet, blocks, conv), = self.down_blocks
        h = transformer(resnet(h, mask, t_emb), blocks)
        skip = h
        h = conv(h * mask)
        for resnet, blocks in self.mid_blocks:
            h = transformer(resnet(h, mask, t_emb), blocks)
        (resnet, blocks, conv), = self.up_blocks
        h = transformer(resnet(torch.cat([h, skip], dim=1), mask, t_emb), blocks)
        h = conv(h * mask)
        h = self.final_block(h, mask)
        return self.final_proj(h * mask) * mask

    def forward_cached(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                       cond: torch.Tensor, cache: StageCall) -> torch.Tensor:
        """`forward(streaming=True)` for new frames only, all valid (no mask).

        x, mu, cond: [B, 80, n], frames start..end-1 of `cache` (a `StageCall` at one Euler
        evaluation: the B rows' attention keys/values and conv left context of the earlier frames);
        t: [B]; spks: [B, 80]. Returns the velocity of the new frames [B, 80, n].
        """
        t_emb = self.time_mlp(time_embedding(t, self.dims.in_channels).to(t.dtype))  # [B, 4C]
        h = torch.cat([x, mu, spks[:, :, None].expand(-1, -1, x.shape[2]), cond], dim=1)

        def transformer(h: torch.Tensor, blocks: nn.ModuleList) -> torch.Tensor:
            h = h.transpose(1, 2)  # [B, n, C]
            for block in blocks:
                h = block.forward_cached(h, cache)
            return h.transpose(1, 2)

        (resnet, blocks, conv), = self.down_blocks
        h = transformer(resnet.forward_cached(h, t_emb, cache), blocks)
        skip = h
        h = conv.forward_cached(h, cache)
        for resnet, blocks in self.mid_blocks:
            h = transformer(resnet.forward_cached(h, t_emb, cache), blocks)
        (resnet, blocks, conv), = self.up_blocks
        h = transformer(resnet.forward_cached(torch.cat([h, skip], dim=1), t_emb, cache), blocks)
        h = conv.forward_cached(h, cache)
        return self.final_proj(self.final_block.forward_cached(h, cache))
