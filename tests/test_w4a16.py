"""The torch W4A16 kernel for CPUs whose vLLM build has no 4-bit GEMM (app/vllm_lm/w4a16.py).

The kernel reads layers in the layout vLLM loads a compressed-tensors folder into; it must give
x @ ((q - zero) * scale)^T for both 4-bit types. Whether the whole engine serves a 4-bit folder
through it (on an AVX2-only CPU) or through vLLM's own GEMM (AVX-512) is tested end to end in
test_quantize.py and test_quantize_rtn.py, on whichever CPU runs them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from vllm.model_executor.layers.quantization.utils.quant_utils import pack_quantized_values_into_int32
from vllm.scalar_type import scalar_types

from app.vllm_lm import w4a16 as vllm_w4a16
from app.vllm_lm.w4a16 import TorchW4A16LinearKernel, unpack_input_packed

OUT, IN, GROUP = 64, 256, 128


def param(data: torch.Tensor, **dims: int) -> nn.Parameter:
    """A loaded weight with vLLM's layout attributes (vLLM's own parameter classes need a TP group)."""
    p = nn.Parameter(data, requires_grad=False)
    for k, v in dims.items():
        setattr(p, k, v)
    return p


def ct_layer(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, wtype) -> nn.Module:
    """A layer as vLLM's CompressedTensorsWNA16 leaves it after loading: q [out, in] values 0..15,
    scale [out, groups], zero [out, groups] or None."""
    layer = nn.Module()
    layer.register_parameter("weight_packed", param(
        pack_quantized_values_into_int32(q, wtype, 1), input_dim=1, output_dim=0, packed_dim=1))
    layer.register_parameter("weight_scale", param(scale.to(torch.bfloat16), input_dim=1, output_dim=0))
    if zero is not None:
        layer.register_parameter("weight_zero_point", param(
            pack_quantized_values_into_int32(zero, wtype, 0), input_dim=1, output_dim=0, packed_dim=0))
    return layer


def kernel_for(wtype, zero_points: bool) -> TorchW4A16LinearKernel:
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearLayerConfig

    c = MPLinearLayerConfig(full_weight_shape=(IN, OUT), partition_weight_shape=(IN, OUT), weight_type=wtype,
                            act_type=torch.bfloat16, group_size=GROUP, zero_points=zero_points)
    return TorchW4A16LinearKernel(c, "weight_packed", "weight_scale", "weight_zero_point" if zero_points else None)


def test_unpack_reads_values_in_input_order():
    q = torch.randint(0, 16, (OUT, IN), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = pack_quantized_values_into_int32(q, scalar_types.uint4, 1)  # [out, in/8], as vLLM packs
    assert packed.shape == (OUT, IN // 8)
    assert torch.equal(unpack_input_packed(packed), q)


@pytest.mark.parametrize("wtype,zero_points", [(scalar_types.uint4, True), (scalar_types.uint4b8, False)])
def test_matmul_is_the_dequantized_weights(wtype, zero_points):
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (OUT, IN), generator=g, dtype=torch.int32)
    zero = torch.randint(0, 16, (OUT, IN // GROUP), generator=g, dtype=torch.int32) if zero_points else None
    scale = (torch.rand(OUT, IN // GROUP, generator=g) * 0.02 + 0.001).to(torch.bfloat16).float()
    layer = ct_layer(q, scale, zero, wtype)
    kernel = kernel_for(wtype, zero_points)
    kernel.process_weights_after_loading(layer)

    z = (zero if zero is not None else torch.full_like(scale, 8, dtype=torch.int32)).repeat_interleave(GROUP, 1)
    w_ref = (q - z).float() * scale.repeat_interleave(GROUP, 1)  # [out, in] fp32
    assert torch.equal(kernel.dequantized(layer), w_ref)
    x = torch.randn(5, IN, generator=g).to(torch.bfloat16)
    bias = torch.randn(OUT, generator=g).to(torch.bfloat16)
    got = kernel.apply_weights(layer, x, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (5, OUT)
    ref = (x.float() @ w_ref.T + bias.float()).to(torch.bfloat16)
    assert torch.equal(got, ref)
    # the engine keeps 4-bit weights: the packed words, bf16->fp32 group scales, one byte per zero point
    held = sum(p.numel() * p.element_size() for p in layer.parameters())
    assert held < OUT * IN * 2 / 3


def test_installed_exactly_when_the_cpu_build_lacks_the_gemm():
    from vllm.model_executor.kernels.linear import _POSSIBLE_KERNELS
    from vllm.platforms import PlatformEnum

    before = list(_POSSIBLE_KERNELS[PlatformEnum.CPU])
    try:
        installed = vllm_w4a16.install_if_needed()
        assert installed == (not vllm_w4a16.cpu_gemm_available())
        assert (_POSSIBLE_KERNELS[PlatformEnum.CPU][0] is TorchW4A16LinearKernel) == installed
        assert vllm_w4a16.install_if_needed() == installed  # idempotent
        assert _POSSIBLE_KERNELS[PlatformEnum.CPU].count(TorchW4A16LinearKernel) == int(installed)
        ok, why = TorchW4A16LinearKernel.can_implement(kernel_for(scalar_types.uint4, True).config)
        assert ok == installed, why
    finally:
        _POSSIBLE_KERNELS[PlatformEnum.CPU][:] = before
