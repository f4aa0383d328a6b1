"""4-bit LM layers on CPUs whose vLLM build has no W4A16 GEMM: a torch dequantize-then-matmul kernel.
Design notes: docs/design.md."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

try:  # importable where vLLM is not installed (then nothing is installed)
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import (
        MPLinearKernel,
        MPLinearLayerConfig,
    )
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32
    from vllm.scalar_type import scalar_types
except ImportError:  # pragma: no cover - torch-only installs
    MPLinearKernel = object  # type: ignore[misc,assignment]
    MPLinearLayerConfig = Any  # type: ignore[misc,assignment]

BITS = 4
PACK = 32 // BITS  # 4-bit values per int32 word
_SHIFTS = torch.arange(PACK, dtype=torch.int32) * BITS  # [8]: bit offset of value i in a word


def cpu_gemm_available() -> bool:
    """True when the loaded vLLM CPU kernel library registers the W4A16 GEMM."""
    try:
        torch.ops._C.cpu_gemm_wna16  # noqa: B018 - the lookup raises when the op is not registered
    except (AttributeError, RuntimeError):
        return False
    return True


def unpack_input_packed(packed: Tensor) -> Tensor:
    """`[out, in/8]` int32 words -> `[out, in]` int32 values 0..15 (value i of word c is input 8c+i)."""
    vals = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF  # [out, in/8, 8]
    return vals.reshape(packed.shape[0], -1)


class TorchW4A16LinearKernel(MPLinearKernel):
    """vLLM mixed-precision kernel: 4-bit weights (uint4 with zero points, or uint4b8), fp32 math."""

    @classmethod
    def get_min_capability(cls) -> int:
        return -1

    @classmethod
    def can_implement(cls, c: MPLinearLayerConfig) -> tuple[bool, str | None]:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False, "only for vLLM's CPU platform"
        if cpu_gemm_available():
            return False, "this CPU has vLLM's own W4A16 GEMM"
        if c.weight_type not in (scalar_types.uint4, scalar_types.uint4b8):
            return False, f"quant type {c.weight_type} is not 4-bit uint4/uint4b8"
        k = c.partition_weight_shape[0]
        if k % PACK or (c.group_size != -1 and k % c.group_size):
            return False, f"{k} inputs do not split into words of {PACK} and groups of {c.group_size}"
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        w_q, _, _ = self._get_weight_params(layer)
        if not (w_q.input_dim == w_q.packed_dim == 1):
            raise ValueError("TorchW4A16LinearKernel reads compressed-tensors weights packed along the input")
        # scales: [out, groups] as loaded (GroupQuantScaleParameter) or [out] per channel
        self._transform_param(layer, self.w_s_name, lambda s: (s.data if s.dim() == 2 else s.data[:, None]).float())
        if self.config.zero_points:
            # [out/8, groups] int32 packed along the output -> [out, groups] uint8
            self._transform_param(layer, self.w_zp_name, lambda z: unpack_quantized_values_into_int32(
                z.data, self.config.weight_type, 0).to(torch.uint8))

    def dequantized(self, layer: torch.nn.Module) -> Tensor:
        """`[out, in]` float32 weights: (q - zero) * scale per group (zero 8 for uint4b8)."""
        w_q, w_s, w_zp = self._get_weight_params(layer)
        q = unpack_input_packed(w_q.data).float()  # [out, in]
        out, k = q.shape
        groups = w_s.shape[1]
        q = q.view(out, groups, k // groups)
        zero = w_zp.float()[:, :, None] if w_zp is not None else float(self.config.weight_type.bias or 0)
        return ((q - zero) * w_s[:, :, None]).view(out, k)

    def apply_weights(self, layer: torch.nn.Module, x: Tensor, bias: Tensor | None = None) -> Tensor:
        y = torch.nn.functional.linear(x.float(), self.dequantized(layer), None if bias is None else bias.float())
        return y.to(x.dtype)


def install_if_needed() -> bool:
    """Put the torch kernel first among vLLM's CPU W4A16 kernels when the CPU build lacks the GEMM.
    Idempotent; True when installed (now or before). Must run before the model is built."""
    try:
        from vllm.model_executor.kernels.linear import _POSSIBLE_KERNELS
        from vllm.platforms import PlatformEnum, current_platform
    except ImportError:
        return False
    if not current_platform.is_cpu() or cpu_gemm_available():
        return False
    kernels = _POSSIBLE_KERNELS.setdefault(PlatformEnum.CPU, [])
    if TorchW4A16LinearKernel not in kernels:
        kernels.insert(0, TorchW4A16LinearKernel)
        log.warning("this CPU's vLLM build has no W4A16 GEMM (no AVX-512): 4-bit LM layers run through "
                    "a torch dequantize-then-matmul kernel (same weights, slower steps)")
    return True
