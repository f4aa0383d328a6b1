"""The estimator's restructured forward: weights derived from the official parameters (q/k/v as one
GEMM, each k=3 causal conv as one GEMM over im2col columns, every resnet's time projection as one).
Design notes: docs/model.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # annotations only: built from the estimator's layers
    from app.model.flow.estimator import CausalConditionalDecoder, TransformerBlock
    from app.model.flow.incremental.packed import PackedCall


def taps(w: torch.Tensor) -> torch.Tensor:
    """Conv1d weight [out, in, k] -> GEMM weight [out, k·in] over the im2col columns of `conv3`."""
    return w.permute(0, 2, 1).reshape(w.shape[0], -1)


def gemm3(xp: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """k=3 conv of xp [B, 2 + T, C] (2 frames of left context) -> [B, T, out]: the columns
    [x(t-2), x(t-1), x(t)] [B, T, 3C] times the `taps` weight, one GEMM."""
    xp = xp.contiguous()
    (B, T, C), s = xp.shape, xp.stride(0)
    # row t of the columns is xp[t : t + 3] flattened: an overlapping view, copied once (2-D: one GEMM)
    cols = xp.as_strided((B, T - 2, 3 * C), (s, C, 1), xp.storage_offset()).reshape(-1, 3 * C)
    return F.linear(cols, w, b).view(B, T - 2, -1)


def conv3(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Causal k=3 conv channels-last: x [B, T, C], zeros before frame 0."""
    return gemm3(F.pad(x, (0, 0, 2, 0)), w, b)


def norm_mish(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    return F.mish(norm(x))  # eager LayerNorm and Mish (no fused approximations)


def fused_block(block: TransformerBlock, w_qkv: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
           cache: PackedCall | None = None) -> torch.Tensor:
    """`TransformerBlock.forward` (or `forward_cached` with `cache`) with q/k/v as one GEMM: x [B, T, C]."""
    attn, (B, T, _) = block.attn1, x.shape
    qkv = F.linear(block.norm1(x), w_qkv).view(B, T, 3, attn.n_heads, attn.d_head)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, T, d_head]
    # with a cache: over the earlier frames' keys/values too
    out = cache.attend(q, k, v) if cache is not None else F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    x = x + attn.to_out[0](out.transpose(1, 2).reshape(B, T, -1))
    return x + block.ff(block.norm3(x))


class FusedWeights:
    """Weights of the restructured `forward`, derived (concatenated, reshaped) from the parameters."""

    @torch.no_grad()
    def __init__(self, est: CausalConditionalDecoder, key: tuple) -> None:
        self.key, self.channels = key, est.dims.channels[0]
        res = est.resnets()
        self.t_weight = torch.cat([r.mlp[1].weight for r in res])  # [n_res·C, 4C]
        self.t_bias = torch.cat([r.mlp[1].bias for r in res])
        self.norms = [(r.block1.block[2], r.block2.block[2]) for r in res]
        self.block1, self.block2 = [], []
        for r in res:  # block1's conv and res_conv (on the last tap: x(t)) as one GEMM [2C, 3·in]
            c1, c2, rc = r.block1.block[0], r.block2.block[0], r.res_conv
            w_res = F.pad(rc.weight, (2, 0))  # [C, in, 3]: zero on taps t-2, t-1
            self.block1.append((taps(torch.cat([c1.weight, w_res])), torch.cat([c1.bias, rc.bias])))
            self.block2.append((taps(c2.weight), c2.bias))
        blocks = [b for s in (est.down_blocks, est.mid_blocks, est.up_blocks) for m in s for b in m[1]]
        self.qkv = [torch.cat([b.attn1.to_q.weight, b.attn1.to_k.weight, b.attn1.to_v.weight]) for b in blocks]
        convs = (est.down_blocks[0][2], est.up_blocks[0][2], est.final_block.block[0])
        self.convs = [(taps(c.weight), c.bias) for c in convs]
        self.proj = (est.final_proj.weight[:, :, 0], est.final_proj.bias)

    def resnet(self, i: int, x: torch.Tensor, m: torch.Tensor, t_res: torch.Tensor) -> torch.Tensor:
        """`CausalResnetBlock1D.forward` channels-last: x [B, T, in], m [B, T, 1] -> [B, T, C]."""
        (n1, n2), C = self.norms[i], self.channels
        a, r = conv3(x * m, *self.block1[i]).split(C, dim=2)
        h = (norm_mish(a, n1) + t_res) * m  # block1's own output mask is implied by this one
        return norm_mish(conv3(h, *self.block2[i]), n2) * m + r
