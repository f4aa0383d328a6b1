"""Band-limited resampling: torchaudio's default sinc resampler in plain torch (no torchaudio beside vLLM's CPU torch).

Design notes: docs/design.md.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

MAX_RESAMPLE_KERNEL = 4_000_000  # elements of `_sinc_kernel` (16 MB of float32)

# torchaudio.functional.resample defaults (sinc_interp_hann)
RESAMPLE_LOWPASS_WIDTH = 6  # zero crossings of the sinc on each side
RESAMPLE_ROLLOFF = 0.99  # cut-off as a fraction of the lower Nyquist


def resample_kernel_size(orig_sr: int, new_sr: int) -> int:
    """Elements of the polyphase kernel `resample(orig_sr -> new_sr)` builds (0 when the rates are equal)."""
    if orig_sr == new_sr:
        return 0
    g = math.gcd(int(orig_sr), int(new_sr))
    orig, new = int(orig_sr) // g, int(new_sr) // g
    width = math.ceil(RESAMPLE_LOWPASS_WIDTH * orig / (min(orig, new) * RESAMPLE_ROLLOFF))
    return new * (2 * width + orig)


@functools.lru_cache(maxsize=32)
def _sinc_kernel(orig: int, new: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """Polyphase windowed-sinc kernel for gcd-reduced rates -> (kernel [new, 1, 2*width+orig], width).

    Output phase i (time i/new) takes input samples j at offsets (j/orig - i/new), low-passed at
    `rolloff * min(orig, new)` and windowed by cos² (Hann) over ±lowpass_width zero crossings.
    """
    lpw = RESAMPLE_LOWPASS_WIDTH
    base = min(orig, new) * RESAMPLE_ROLLOFF  # cut-off in reduced-rate units
    width = math.ceil(lpw * orig / base)  # input taps on each side
    idx = torch.arange(-width, width + orig, dtype=torch.float64) / orig  # [K] input positions
    # torchaudio builds the output phases in float32 before mixing with the float64 positions
    phase = (torch.arange(0, -new, -1, dtype=torch.float32) / new).double()  # [new]
    t = ((phase[:, None] + idx[None, :]) * base).clamp(-lpw, lpw)  # [new, K] in zero crossings
    window = torch.cos(t * math.pi / lpw / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / t)
    kernel = (sinc * window * (base / orig)).to(dtype)
    return kernel[:, None, :], width


def resample(wave: torch.Tensor, orig_sr: int, new_sr: int) -> torch.Tensor:
    """Band-limited resampling `[..., N] -> [..., ceil(N * new_sr / orig_sr)]`.

    Reproduces `torchaudio.functional.resample` defaults (sinc_interp_hann, width 6, rolloff 0.99).
    """
    if orig_sr <= 0 or new_sr <= 0 or int(orig_sr) != orig_sr or int(new_sr) != new_sr:
        raise ValueError(f"sample rates must be positive integers, got {orig_sr} -> {new_sr}")
    if orig_sr == new_sr:
        return wave
    if not wave.is_floating_point():
        raise TypeError(f"resample needs a float waveform, got {wave.dtype}")
    g = math.gcd(int(orig_sr), int(new_sr))
    orig, new = int(orig_sr) // g, int(new_sr) // g
    kernel, width = _sinc_kernel(orig, new, wave.dtype)
    shape = wave.shape
    x = wave.reshape(-1, shape[-1])  # [B, N]
    n_in = x.shape[-1]
    x = F.pad(x, (width, width + orig))
    y = F.conv1d(x[:, None], kernel.to(wave.device), stride=orig)  # [B, new, frames]
    y = y.transpose(1, 2).reshape(x.shape[0], -1)  # interleave phases -> [B, frames * new]
    n_out = -(-new * n_in // orig)  # ceil
    return y[:, :n_out].reshape(*shape[:-1], n_out)
