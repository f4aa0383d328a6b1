"""HiFT's excitation side: the mel -> F0 predictor and the harmonic-plus-noise (NSF) source.

Design notes: docs/model.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.parametrizations import weight_norm


class F0Predictor(nn.Module):
    """`ConvRNNF0Predictor`: 5 x (weight-normed Conv1d k3 + ELU), Linear -> |.|; mel -> f0 in Hz."""

    def __init__(self, in_channels: int, cond_channels: int, n_layers: int = 5) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(n_layers):
            conv = nn.Conv1d(in_channels if i == 0 else cond_channels, cond_channels, 3, padding=1)
            layers += [weight_norm(conv), nn.ELU()]  # convs at even indices, as in hift.pt
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, 1)

    def forward(self, mel: Tensor) -> Tensor:
        """mel [B, 80, T] -> f0 [B, T] (Hz, >= 0)."""
        h = self.condnet(mel)  # [B, C, T]
        return self.classifier(h.transpose(1, 2)).squeeze(-1).abs()


def harmonic_phase(f0: Tensor, n_harmonics: int, sampling_rate: int, upsample: int) -> Tensor:
    """SineGen2's instantaneous phase (radians) of every harmonic.

    f0 [B, T] (Hz, one value per mel frame) -> phase [B, n_harmonics, T * upsample].

    The official code works at the sample rate: nearest-upsampled f0 -> cycles/sample
    `rad = (k·f0 / sr) mod 1` -> linear resample by 1/upsample (align_corners=False reads samples
    upsample·t + upsample/2 - 1/2, i.e. two equal samples of frame t, so it returns rad of frame t
    exactly) -> cumsum·2π -> ·upsample -> linear resample by `upsample`. We start from the frame
    values directly; every float op on them is the same, in the same order. The official random
    initial phase is added to sample 0 only, which that down-sampling never reads, so it cannot
    reach the output and is not drawn here.
    Runs in at least fp32: the phase reaches ~1e5 rad, far beyond half precision.
    """
    work = torch.promote_types(f0.dtype, torch.float32)
    f0 = f0.to(work)
    k = torch.arange(1, n_harmonics + 1, device=f0.device, dtype=work)
    rad = (f0[:, None, :] * k[None, :, None] / sampling_rate) % 1  # [B, H, T] cycles per sample
    # phase at the centre of frame t after advancing `upsample` samples per frame
    phase = torch.cumsum(rad, dim=-1) * 2 * math.pi * upsample  # [B, H, T]
    # linear interpolation between frame centres (clamped at both ends) -> [B, H, T * upsample]
    return F.interpolate(phase, scale_factor=upsample, mode="linear")


def _fresh_generator(device: torch.device) -> torch.Generator:
    """An OS-entropy seeded generator: never touches (or depends on) the global RNG."""
    g = torch.Generator(device=device)
    g.seed()
    return g


class HarmonicSource(nn.Module):
    """`SourceModuleHnNSF2` with `SineGen2`: f0 [B, T] -> excitation [B, 1, T * upsample] in (-1, 1)."""

    def __init__(
        self,
        *,
        sampling_rate: int,
        upsample: int,
        nb_harmonics: int,
        sine_amp: float,
        noise_std: float,
        voiced_threshold: float,
    ) -> None:
        super().__init__()
        self.sampling_rate = sampling_rate
        self.upsample = upsample  # output samples per mel frame (480)
        self.n_harmonics = nb_harmonics + 1  # fundamental + overtones (9)
        self.sine_amp = sine_amp  # 0.1
        self.noise_std = noise_std  # voiced-frame noise std (0.003)
        self.voiced_threshold = voiced_threshold  # Hz; f0 <= this is unvoiced (10)
        self.l_linear = nn.Linear(self.n_harmonics, 1)  # merges the harmonics into one excitation

    def draw_noise(self, n_rows: int, n_frames: int, generator: torch.Generator | None,
                   device: torch.device) -> Tensor:
        """The Gaussian draws `forward` makes for f0 [n_rows, n_frames]: [n_rows, H, n_frames * upsample]
        float32 on `device`. Drawn ahead of time they let a batch of streams use each stream's own
        generator (app/model/hift_batch.py), and keep the draw out of a captured CUDA graph."""
        g = generator if generator is not None else _fresh_generator(device)
        eps = torch.randn((n_rows, self.n_harmonics, n_frames * self.upsample), generator=g, device=g.device,
                          dtype=torch.float32)
        return eps.to(device)

    def forward(self, f0: Tensor, *, noise: bool = True, generator: torch.Generator | None = None,
                eps: Tensor | None = None) -> Tensor:
        """f0 [B, T] Hz -> source [B, 1, T * upsample].

        noise=False sets the additive noise to zero (the parity fixture's deterministic patch).
        With noise, the Gaussian draws are `eps` [B, H, T * upsample] if given (`draw_noise`), else drawn
        from `generator` (a fresh OS-seeded one if None; a CPU generator gives the same audio on every
        device).
        """
        phase = harmonic_phase(f0, self.n_harmonics, self.sampling_rate, self.upsample)  # [B, H, L]
        sines = torch.sin(phase) * self.sine_amp
        uv = (f0 > self.voiced_threshold).to(phase.dtype)  # [B, T] 1 = voiced
        uv = uv.repeat_interleave(self.upsample, dim=-1)[:, None, :]  # [B, 1, L]
        x = sines * uv  # unvoiced samples carry noise only
        if noise:
            if eps is None:
                eps = self.draw_noise(x.shape[0], f0.shape[-1], generator, f0.device)
            amp = uv * self.noise_std + (1 - uv) * (self.sine_amp / 3)  # unvoiced noise peaks ~sine_amp
            x = x + amp * eps.to(device=x.device, dtype=x.dtype)
        w = self.l_linear.weight
        merged = torch.tanh(self.l_linear(x.transpose(1, 2).to(w.dtype)))  # [B, L, 1]
        return merged.transpose(1, 2)  # [B, 1, L]
