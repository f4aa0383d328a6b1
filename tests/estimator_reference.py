"""The official `CausalConditionalDecoder.forward`, op for op ([B, C, T] activations, every module's
own forward): the reference of tests/test_estimator_fused.py and bench/gpu/flow_graphs.py --reference."""

from __future__ import annotations

import torch

from app.model.flow.encoder import attention_mask
from app.model.flow.estimator import MASK_BIAS, CausalConditionalDecoder, time_embedding


def reference(est: CausalConditionalDecoder, x, mask, mu, t, spks, cond, *, streaming: bool) -> torch.Tensor:
    """The official forward, op for op: [B, C, T] activations, every module's own forward."""
    t_emb = est.time_mlp(time_embedding(t, est.dims.in_channels).to(t.dtype))
    h = torch.cat([x, mu, spks[:, :, None].expand(-1, -1, x.shape[2]), cond], dim=1)
    chunk = est.dims.static_chunk_size if streaming else 0
    allowed = attention_mask(mask.bool(), chunk, est.dims.num_decoding_left_chunks)
    bias = ((1.0 - allowed.to(h.dtype)) * MASK_BIAS).unsqueeze(1)

    def transformer(h, blocks):
        h = h.transpose(1, 2)
        for block in blocks:
            h = block(h, bias)
        return h.transpose(1, 2)

    (resnet, blocks, conv), = est.down_blocks
    h = transformer(resnet(h, mask, t_emb), blocks)
    skip = h
    h = conv(h * mask)
    for resnet, blocks in est.mid_blocks:
        h = transformer(resnet(h, mask, t_emb), blocks)
    (resnet, blocks, conv), = est.up_blocks
    h = transformer(resnet(torch.cat([h, skip], dim=1), mask, t_emb), blocks)
    h = conv(h * mask)
    h = est.final_block(h, mask)
    return est.final_proj(h * mask) * mask
