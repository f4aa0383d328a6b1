"""HiFT vocoder (CosyVoice2 `HiFTGenerator`): mel [B, 80, T] -> 24 kHz waveform [B, 480 T].

Design notes: docs/model.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from app.model.hift_source import F0Predictor, HarmonicSource
from app.model.hparams import HiftDims

_WN = "parametrizations.weight.original"  # + "0" (g) / "1" (v)
_GAN_PREFIX = "generator."


def normalize_hift_state_dict(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Map any official `hift.pt` layout to our keys: drop a `generator.` prefix and rename
    pre-torch-2.1 weight norm `X.weight_g`/`X.weight_v` to `X.parametrizations.weight.original0/1`."""
    out: dict[str, Tensor] = {}
    for key, value in sd.items():
        if key.startswith(_GAN_PREFIX):
            key = key[len(_GAN_PREFIX):]
        if key.endswith(".weight_g"):
            key = key[: -len("weight_g")] + _WN + "0"
        elif key.endswith(".weight_v"):
            key = key[: -len("weight_v")] + _WN + "1"
        out[key] = value
    return out


class Snake(nn.Module):
    """x + sin²(αx)/α with a per-channel linear-scale α (BigVGAN Snake, alpha_logscale=False)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:
        a = self.alpha[None, :, None]  # [1, C, 1]
        return x + (1.0 / (a + 1e-9)) * torch.sin(x * a).pow(2)


class ResBlock(nn.Module):
    """Per dilation d: x += conv_1(snake(conv_d(snake(x)))), both convs 'same' padded."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()

        def conv(d: int) -> nn.Module:
            pad = (kernel_size * d - d) // 2
            return weight_norm(nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=pad))

        self.convs1 = nn.ModuleList(conv(d) for d in dilations)
        self.convs2 = nn.ModuleList(conv(1) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: Tensor) -> Tensor:
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2, strict=True):
            x = x + c2(a2(c1(a1(x))))
        return x


def _spectral_dtype(t: Tensor) -> torch.dtype:
    """torch.stft/istft need fp32 or fp64; half-precision activations are lifted to fp32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class HiFTGenerator(nn.Module):
    """CosyVoice2 HiFT vocoder.

    Responsibilities: mel -> f0 (`f0`), f0 -> NSF excitation (`source`), mel + excitation ->
    waveform (`decode`), and the official `inference` that chains them with the streaming source
    cache. `nsf_noise=False` zeroes the NSF additive noise (deterministic output, as in the parity
    fixture); otherwise noise comes from the `generator` passed in, never the global RNG.
    Works on a batch of B rows; dtype follows the weights except the source phase and the
    STFT/iSTFT, which always run in at least fp32.
    """

    def __init__(self, dims: HiftDims, *, nsf_noise: bool = True) -> None:
        super().__init__()
        self.dims = dims
        self.nsf_noise = nsf_noise
        self.n_fft = dims.istft_n_fft
        self.hop = dims.istft_hop_len
        self.upsample_factor = dims.upsample_factor  # output samples per mel frame (480)
        base = dims.base_channels
        rates, kernels = dims.upsample_rates, dims.upsample_kernel_sizes
        n_stages = len(rates)
        spec_channels = self.n_fft + 2  # real + imag of n_fft//2+1 bins

        self.f0_predictor = F0Predictor(dims.in_channels, dims.f0_cond_channels)
        self.m_source = HarmonicSource(
            sampling_rate=dims.sampling_rate, upsample=self.upsample_factor,
            nb_harmonics=dims.nb_harmonics, sine_amp=dims.nsf_alpha, noise_std=dims.nsf_sigma,
            voiced_threshold=dims.nsf_voiced_threshold,
        )
        self.conv_pre = weight_norm(nn.Conv1d(dims.in_channels, base, 7, padding=3))
        self.ups = nn.ModuleList(
            weight_norm(nn.ConvTranspose1d(base >> i, base >> (i + 1), k, u, padding=(k - u) // 2))
            for i, (u, k) in enumerate(zip(rates, kernels, strict=True))
        )
        # stage i runs at prod(rates[:i+1]) x mel rate; the source STFT runs at prod(rates) x mel
        # rate, so stage i takes it down by prod(rates[i+1:]) (15, 3, 1 for rates 8, 5, 3)
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i in range(n_stages):
            ch, down = base >> (i + 1), 1
            for r in rates[i + 1:]:
                down *= r
            if down == 1:
                self.source_downs.append(nn.Conv1d(spec_channels, ch, 1))
            else:
                self.source_downs.append(nn.Conv1d(spec_channels, ch, down * 2, down, padding=down // 2))
            self.source_resblocks.append(ResBlock(
                ch, dims.source_resblock_kernel_sizes[i], dims.source_resblock_dilation_sizes[i]))
        self.n_kernels = len(dims.resblock_kernel_sizes)
        self.resblocks = nn.ModuleList(
            ResBlock(base >> (i + 1), k, d)
            for i in range(n_stages)
            for k, d in zip(dims.resblock_kernel_sizes, dims.resblock_dilation_sizes, strict=True)
        )
        self.conv_post = weight_norm(nn.Conv1d(base >> n_stages, spec_channels, 7, padding=3))

    # --- pieces -------------------------------------------------------------------------------

    def _check_mel(self, mel: Tensor) -> None:
        if mel.ndim != 3 or mel.shape[1] != self.dims.in_channels:
            raise ValueError(f"mel must be [B, {self.dims.in_channels}, T], got {tuple(mel.shape)}")

    def f0(self, mel: Tensor) -> Tensor:
        """mel [B, 80, T] -> f0 [B, T] in Hz."""
        self._check_mel(mel)
        # the f0 head stays fp32 whatever the rest runs in: a few Hz of half-precision error drift
        # the NSF phase and change the waveform (measured: bf16 f0 -> wav max error 1.4)
        dtype = self.f0_predictor.classifier.weight.dtype
        return self.f0_predictor(mel.to(dtype)).float()

    def source(self, f0: Tensor, generator: torch.Generator | None = None, eps: Tensor | None = None) -> Tensor:
        """f0 [B, T] Hz -> NSF excitation [B, 1, 480 T] (noise per `nsf_noise`: `eps` [B, 9, 480 T] if
        given, else drawn from `generator`)."""
        return self.m_source(f0, noise=self.nsf_noise, generator=generator, eps=eps)

    def _window(self, like: Tensor) -> Tensor:
        """Periodic Hann (= scipy get_window('hann', n_fft, fftbins=True)), made in fp64 and rounded.

        Built per call (n_fft values) rather than kept as a buffer: hift.pt has none, and a model
        built on the meta device then loaded with assign=True needs nothing re-materialised."""
        w = torch.hann_window(self.n_fft, periodic=True, dtype=torch.float64, device=like.device)
        return w.to(like.dtype)

    def _stft(self, x: Tensor) -> Tensor:
        """x [B, L] -> [B, n_fft + 2, L / hop + 1]: real bins then imaginary bins (centre, reflect)."""
        dt = _spectral_dtype(x)
        x = x.to(dt)
        # [B, n_fft//2+1, frames]
        spec = torch.stft(x, self.n_fft, self.hop, self.n_fft, window=self._window(x), return_complex=True)
        return torch.cat([spec.real, spec.imag], dim=1)

    def _istft(self, magnitude: Tensor, phase: Tensor) -> Tensor:
        """magnitude, phase [B, n_fft//2+1, F] -> waveform [B, hop (F - 1)]."""
        dt = _spectral_dtype(magnitude)
        magnitude, phase = magnitude.to(dt).clamp(max=1e2), phase.to(dt)
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        return torch.istft(spec, self.n_fft, self.hop, self.n_fft, window=self._window(magnitude))

    def decode(self, mel: Tensor, source: Tensor) -> Tensor:
        """mel [B, 80, T] + excitation [B, 1, 480 T] -> waveform [B, 480 T] clamped to ±audio_limit."""
        return self.spec_to_wave(self.decode_spec(mel, source))

    def decode_spec(self, mel: Tensor, source: Tensor) -> Tensor:
        """`decode` up to its iSTFT: conv_post's output [B, n_fft + 2, 120 T + 1] (log-magnitudes, then
        pre-sine phases). Split off because torch.istft checks its window envelope on the host, which a
        CUDA graph cannot capture (app/model/hift_batch.py graphs this part only)."""
        self._check_mel(mel)
        expected = mel.shape[-1] * self.upsample_factor
        if source.ndim != 3 or source.shape[1] != 1 or source.shape[-1] != expected:
            raise ValueError(f"source must be [B, 1, {expected}] for {mel.shape[-1]} mel frames, "
                             f"got {tuple(source.shape)}")
        mel = mel.to(self.conv_pre.weight.dtype)  # the decoder may run in fp16/bf16 (f0 stays fp32)
        spec = self._stft(source[:, 0]).to(mel.dtype)  # [B, n_fft+2, 120 T + 1]
        n_stages = len(self.ups)
        x = self.conv_pre(mel)  # [B, base, T]
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, self.dims.lrelu_slope))
            if i == n_stages - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # 120 T -> 120 T + 1 = STFT frames
            x = x + self.source_resblocks[i](self.source_downs[i](spec))
            acc = self.resblocks[i * self.n_kernels](x)
            for j in range(1, self.n_kernels):
                acc = acc + self.resblocks[i * self.n_kernels + j](x)
            x = acc / self.n_kernels
        return self.conv_post(F.leaky_relu(x))  # default slope 0.01 here (official quirk)

    def spec_to_wave(self, x: Tensor) -> Tensor:
        """conv_post output [B, n_fft + 2, F] -> waveform [B, hop (F - 1)] clamped to ±audio_limit."""
        n_bins = self.n_fft // 2 + 1
        # phase = sin(.) as in the official code (a redundant squashing kept for parity)
        wav = self._istft(torch.exp(x[:, :n_bins]), torch.sin(x[:, n_bins:]))  # [B, 480 T]
        return wav.clamp(-self.dims.audio_limit, self.dims.audio_limit)

    # --- entry points -------------------------------------------------------------------------

    @torch.inference_mode()
    def inference(
        self,
        mel: Tensor,
        cache_source: Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """mel [B, 80, T] -> (waveform [B, 480 T], excitation [B, 1, 480 T]).

        cache_source [B or 1, 1, S] (S <= 480 T) overwrites the first S excitation samples: the
        streaming caller passes the previous chunk's excitation tail so phase stays continuous.
        The returned excitation includes that overwrite (slice its tail for the next chunk).
        """
        s = self.source(self.f0(mel), generator)
        if cache_source is not None and cache_source.shape[-1] > 0:
            n = cache_source.shape[-1]
            if cache_source.ndim != 3 or cache_source.shape[1] != 1 or n > s.shape[-1]:
                raise ValueError(f"cache_source must be [B, 1, S] with S <= {s.shape[-1]}, "
                                 f"got {tuple(cache_source.shape)}")
            s[:, :, :n] = cache_source.to(s)
        return self.decode(mel, s), s

    def remove_weight_norm(self) -> HiFTGenerator:
        """Fold every weight-norm parametrisation into a plain `weight` (same outputs, faster).

        Afterwards the state dict has `X.weight` keys instead of the hift.pt names: load first.
        Fold a freshly built model, never a `copy.deepcopy` of one still in use: torch shares the
        parametrised module classes between copies, and folding deletes their `weight` property."""
        for m in self.modules():
            if parametrize.is_parametrized(m, "weight"):
                parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)
        return self
