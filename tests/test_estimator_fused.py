"""The restructured estimator (`CausalConditionalDecoder.forward`: channels-last, fused GEMMs) equals
the official-structure computation (`reference`, below: the modules' own forwards, as the official
`CausalConditionalDecoder.forward`) on random inputs, padded rows and chunk masks."""

from __future__ import annotations

import copy

import pytest
import torch
from tolerances import BATCH_ATOL, INCREMENTAL_F64_ATOL, within

from app.model.flow import CausalFlow, load_flow
from app.model.flow.encoder import attention_mask
from app.model.flow.estimator import MASK_BIAS, CausalConditionalDecoder, time_embedding
from app.model.hparams import load_hparams


@pytest.fixture(scope="module")
def flow(parity_model_dir) -> CausalFlow:
    return load_flow(parity_model_dir / "flow.pt", load_hparams(parity_model_dir).flow)


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


def _inputs(est: CausalConditionalDecoder, lengths: list[int], dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    mask = (torch.arange(T)[None, None, :] < torch.tensor(lengths)[:, None, None]).to(dtype)  # right padding
    x, mu, cond = (torch.randn(B, 80, T, generator=g, dtype=dtype) for _ in range(3))
    spks = torch.randn(B, 80, generator=g, dtype=dtype)
    t = torch.rand(B, generator=g, dtype=dtype)  # a different time per row
    return x, mask, mu * mask, t, spks, cond


@pytest.mark.parametrize("streaming", [True, False])
@torch.inference_mode()
def test_restructured_equals_official_structure(flow, streaming):
    est = flow.decoder["estimator"]
    chunk = est.dims.static_chunk_size
    args = _inputs(est, [3 * chunk + 7, chunk, 2 * chunk + 1], torch.float32)  # partial chunks, padding
    ref = reference(est, *args, streaming=streaming)
    got = est(*args, streaming=streaming)
    assert got.shape == ref.shape
    assert within((got - ref).abs().max(), BATCH_ATOL, "fp32")
    assert float(got.pow(2).mean().sqrt()) > 0.1  # a real velocity, not zeros
    # fp64: the same math, only the summation order differs
    est64 = copy.deepcopy(est).double()
    args64 = tuple(a.double() for a in args)
    d64 = (est64(*args64, streaming=streaming) - reference(est64, *args64, streaming=streaming)).abs().max()
    assert within(d64, INCREMENTAL_F64_ATOL, "fp64")


@torch.inference_mode()
def test_shared_time_rows_and_padded_frames_are_zero(flow):
    """The solver's t.expand (one time, computed once and broadcast) equals per-row times; the output is
    zero on padded frames, as the official `* mask`."""
    est = flow.decoder["estimator"]
    x, mask, mu, _, spks, cond = _inputs(est, [90, 64], torch.float32, seed=1)
    t = torch.tensor([0.37])
    shared = est(x, mask, mu, t.expand(2), spks, cond, streaming=True)
    rows = est(x, mask, mu, t.repeat(2), spks, cond, streaming=True)
    assert within((shared - rows).abs().max(), BATCH_ATOL)
    assert within((shared - reference(est, x, mask, mu, t.repeat(2), spks, cond, streaming=True)).abs().max(),
                  BATCH_ATOL)
    assert torch.equal(shared[1, :, 64:], torch.zeros_like(shared[1, :, 64:]))


@torch.inference_mode()
def test_fused_weights_follow_the_parameters(flow):
    """Derived weights are rebuilt after a load_state_dict, a dtype change and `unfuse()`; the state dict
    keeps the official names (nothing derived is saved)."""
    est = copy.deepcopy(flow.decoder["estimator"])
    keys = set(est.state_dict())
    args = _inputs(est, [70, 50], torch.float32, seed=2)
    before = est(*args, streaming=True)
    assert set(est.state_dict()) == keys
    other = {k: v * 1.01 if k.endswith("to_v.weight") else v for k, v in est.state_dict().items()}
    est.load_state_dict(other, strict=True)
    after = est(*args, streaming=True)
    assert not torch.allclose(before, after)
    assert within((after - reference(est, *args, streaming=True)).abs().max(), BATCH_ATOL)
    est.double()
    got = est(*(a.double() for a in args), streaming=True)
    assert got.dtype == torch.float64
    with torch.no_grad():
        est.down_blocks[0][0].res_conv.weight.mul_(0.5)  # an in-place edit the sentinels do not see
    est.unfuse()
    args64 = tuple(a.double() for a in args)
    assert within((est(*args64, streaming=True) - reference(est, *args64, streaming=True)).abs().max(),
                  INCREMENTAL_F64_ATOL)
