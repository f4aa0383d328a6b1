"""The restructured estimator (`CausalConditionalDecoder.forward`: channels-last, fused GEMMs) equals
the official-structure computation (tests/estimator_reference.py: the modules' own forwards, as the
official `CausalConditionalDecoder.forward`) on random inputs, padded rows and chunk masks."""

from __future__ import annotations

import copy

import pytest
import torch
from estimator_reference import reference
from tolerances import BATCH_ATOL, INCREMENTAL_F64_ATOL, within

from app.model.flow import CausalFlow, load_flow
from app.model.flow.estimator import CausalConditionalDecoder
from app.model.hparams import load_hparams


@pytest.fixture(scope="module")
def flow(parity_model_dir) -> CausalFlow:
    return load_flow(parity_model_dir / "flow.pt", load_hparams(parity_model_dir).flow)


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


@pytest.mark.parametrize(("rows", "frames"), [(1, 1), (1, 7), (3, 1), (2, 50)])
def test_causal_conv_as_one_gemm(rows, frames):
    """The 3-tap im2col GEMM (an overlapping view of the padded input) is the causal Conv1d, one row and
    one frame included (fp64: only the summation order differs)."""
    from app.model.flow.fused import conv3, taps

    g = torch.Generator().manual_seed(rows * 100 + frames)
    w, b = torch.randn(5, 4, 3, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)
    x = torch.randn(rows, 4, frames, generator=g, dtype=torch.float64)
    ref = torch.nn.functional.conv1d(torch.nn.functional.pad(x, (2, 0)), w, b)
    assert within((conv3(x.transpose(1, 2), taps(w), b).transpose(1, 2) - ref).abs().max(), INCREMENTAL_F64_ATOL)
