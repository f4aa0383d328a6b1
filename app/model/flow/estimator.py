"""The flow-matching velocity estimator (official `CausalConditionalDecoder`, a 1-D U-Net without
any actual down/up-sampling). Design notes: docs/model.md.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from app.model.flow.encoder import attention_mask
from app.model.flow.fused import FusedWeights, conv3, fused_block, norm_mish
from app.model.hparams import EstimatorDims

if TYPE_CHECKING:  # annotations only: the packed call is built on this module's layers
    from app.model.flow.incremental.packed import PackedCall

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
        self._fused: FusedWeights | None = None  # derived weights (not parameters: the state dict is official)

    def resnets(self) -> list[CausalResnetBlock1D]:
        """The resnets in evaluation order (down, mid..., up)."""
        return [self.down_blocks[0][0], *(m[0] for m in self.mid_blocks), self.up_blocks[0][0]]

    def fused(self) -> FusedWeights:
        """The derived weights of `forward`, rebuilt after a load, a move or a dtype change (hooks
        below) or when a sentinel parameter changed; after other in-place edits call `unfuse()`."""
        if self._fused is not None and torch.compiler.is_compiling():
            return self._fused  # traced: built by an eager call before (the ids and versions are host state)
        first, last = self.time_mlp.linear_1.weight, self.final_proj.weight
        key = tuple((id(p), -1 if p.is_inference() else p._version, p.data_ptr(), p.dtype, p.device)
                    for p in (first, last))  # (inference tensors keep no version counter)
        if self._fused is None or self._fused.key != key:
            self._fused = FusedWeights(self, key)
        return self._fused

    def unfuse(self) -> None:
        self._fused = None

    def _apply(self, fn, recurse: bool = True):  # .to() / .half() / .cuda() replace the parameters
        self._fused = None
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        self._fused = None
        super()._load_from_state_dict(*args, **kwargs)

    def _inputs(self, fz: FusedWeights, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> every resnet's time term [B or 1, n_res, 1, C] and the input [B, T, 320] channels-last."""
        if t.dim() == 1 and t.shape[0] > 1 and t.stride(0) == 0:
            t = t[:1]  # one time for all rows (the solver's t.expand): its MLPs once, broadcast
        t_emb = self.time_mlp(time_embedding(t, self.dims.in_channels).to(t.dtype))  # [B or 1, 4C]
        t_res = F.linear(F.mish(t_emb), fz.t_weight, fz.t_bias).unflatten(1, (-1, 1, fz.channels))
        T = x.shape[2]
        spks = spks if spks.dim() == 3 else spks[:, None, :].expand(-1, T, -1)  # per frame [B, T, 80] (packed)
        h = torch.cat([x.transpose(1, 2), mu.transpose(1, 2), spks, cond.transpose(1, 2)], dim=2)
        return t_res, h

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                spks: torch.Tensor, cond: torch.Tensor, *, streaming: bool) -> torch.Tensor:
        """One velocity evaluation.

        x, mu, cond: [B, 80, T]; mask: [B, 1, T] (1 = valid frame); t: [B] flow time in [0, 1];
        spks: [B, 80]; streaming: block-causal attention in chunks of `static_chunk_size` frames
        (full left context), else full attention. Returns the velocity [B, 80, T] (× mask; a view).

        The official computation restructured (equal to rounding; tests/test_estimator_fused.py):
        activations [B, T, C]; each causal k=3 conv is one GEMM over its 3 taps (fp32 GEMMs, no
        cuDNN TF32); resnet: res_conv rides block1's GEMM, its 14 time MLPs are one GEMM; q/k/v one
        GEMM. Mask multiplies dropped only where exact: block1's output (block2 masks its input:
        (a·m + c)·m = (a + c)·m for m in {0, 1}) and final_proj's input (already × mask).
        """
        fz = self.fused()
        t_res, h = self._inputs(fz, x, mu, t, spks, cond)
        m = mask.transpose(1, 2)  # [B, T, 1]
        chunk = self.dims.static_chunk_size if streaming else 0
        allowed = attention_mask(mask.bool(), chunk, self.dims.num_decoding_left_chunks)
        bias = ((1.0 - allowed.to(h.dtype)) * MASK_BIAS).unsqueeze(1)  # [B, 1, T or 1, T]
        qkv = iter(fz.qkv)

        def stack(h: torch.Tensor, i: int, blocks: nn.ModuleList) -> torch.Tensor:
            h = fz.resnet(i, h, m, t_res[:, i])  # t_res[:, i]: [B or 1, 1, C]
            for block in blocks:
                h = fused_block(block, next(qkv), h, bias)
            return h

        (_, blocks, _), = self.down_blocks
        skip = h = stack(h, 0, blocks)
        h = conv3(h * m, *fz.convs[0])
        for i, (_, blocks) in enumerate(self.mid_blocks, 1):
            h = stack(h, i, blocks)
        (_, blocks, _), = self.up_blocks
        h = stack(torch.cat([h, skip], dim=2), len(self.mid_blocks) + 1, blocks)
        h = conv3(h * m, *fz.convs[1])
        h = norm_mish(conv3(h * m, *fz.convs[2]), self.final_block.block[2]) * m
        return (F.linear(h, *fz.proj) * m).transpose(1, 2)

    def forward_cached(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                       cond: torch.Tensor, cache: PackedCall) -> torch.Tensor:
        """`forward(streaming=True)` for new frames only, all valid (no mask).

        x, mu, cond: [B, 80, n], the new frames of `cache` (the packed call at one Euler evaluation:
        the attention keys/values and conv left context of the earlier frames live in its pool);
        t: [B]; spks: [B, 80] (or per frame [B, n, 80]). Returns the velocity of the new frames
        [B, 80, n] (a view). The same restructured computation as `forward`; each causal conv is
        `cache.conv3` and each attention `cache.attend`.
        """
        fz = self.fused()
        t_res, h = self._inputs(fz, x, mu, t, spks, cond)
        qkv = iter(fz.qkv)
        conv = cache.conv3

        def stack(h: torch.Tensor, i: int, blocks: nn.ModuleList) -> torch.Tensor:
            a, r = conv(h, *fz.block1[i]).split(fz.channels, dim=2)
            n1, n2 = fz.norms[i]
            h = norm_mish(conv(norm_mish(a, n1) + t_res[:, i], *fz.block2[i]), n2) + r
            for block in blocks:
                h = fused_block(block, next(qkv), h, None, cache)
            return h

        skip = h = stack(h, 0, self.down_blocks[0][1])
        h = conv(h, *fz.convs[0])
        for i, (_, blocks) in enumerate(self.mid_blocks, 1):
            h = stack(h, i, blocks)
        h = stack(torch.cat([h, skip], dim=2), len(self.mid_blocks) + 1, self.up_blocks[0][1])
        h = norm_mish(conv(conv(h, *fz.convs[1]), *fz.convs[2]), self.final_block.block[2])
        return F.linear(h, *fz.proj).transpose(1, 2)
