"""Frontend features of CosyVoice2, in pure torch (CPU or CUDA, float32).

Design notes: docs/model.md.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from app.audio import PROMPT_SAMPLE_RATE_HZ
from app.model.hparams import FeatDims

# Whisper log-mel (whisper/audio.py): 25 ms Hann frames every 10 ms at 16 kHz
WHISPER_N_FFT = 400
WHISPER_HOP = 160

# Kaldi fbank defaults (torchaudio.compliance.kaldi.fbank) at 16 kHz
KALDI_FRAME_LEN = 400  # 25 ms
KALDI_FRAME_SHIFT = 160  # 10 ms
KALDI_FFT = 512  # frame zero-padded to the next power of two
KALDI_PREEMPH = 0.97
KALDI_POVEY_POWER = 0.85  # povey window = symmetric Hann ** 0.85
KALDI_LOW_HZ = 20.0  # high cut-off = Nyquist
FLOAT32_EPS = torch.finfo(torch.float32).eps  # Kaldi's log floor

# Matcha mel: magnitude floor inside the sqrt and log floor
MATCHA_MAG_EPS = 1e-9
MATCHA_LOG_FLOOR = 1e-5


# --- filterbanks ----------------------------------------------------------------------------


def _hz_to_slaney_mel(hz: torch.Tensor) -> torch.Tensor:
    """Slaney mel scale (librosa htk=False): linear below 1 kHz, logarithmic above."""
    f_sp = 200.0 / 3  # Hz per mel in the linear part
    min_log_mel = 1000.0 / f_sp
    logstep = math.log(6.4) / 27.0
    lin = hz / f_sp
    log = min_log_mel + torch.log(torch.clamp(hz, min=1e-10) / 1000.0) / logstep
    return torch.where(hz >= 1000.0, log, lin)


def _slaney_mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    f_sp = 200.0 / 3
    min_log_mel = 1000.0 / f_sp
    logstep = math.log(6.4) / 27.0
    return torch.where(mel >= min_log_mel, 1000.0 * torch.exp(logstep * (mel - min_log_mel)), f_sp * mel)


@functools.lru_cache(maxsize=16)
def _slaney_mel_filters_cpu(sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> torch.Tensor:
    """librosa.filters.mel(sr, n_fft, n_mels, fmin, fmax) (Slaney, area norm) -> [n_mels, n_fft//2+1].

    Triangles between consecutive mel-spaced edges, evaluated at the FFT bin frequencies in float64,
    each scaled by 2 / (upper edge - lower edge) so all have equal area; cast to float32 like librosa.
    """
    fft_hz = torch.linspace(0.0, sr / 2, n_fft // 2 + 1, dtype=torch.float64)  # [F]
    lo, hi = _hz_to_slaney_mel(torch.tensor([float(fmin), float(fmax)], dtype=torch.float64))
    edges_hz = _slaney_mel_to_hz(torch.linspace(float(lo), float(hi), n_mels + 2, dtype=torch.float64))
    widths = edges_hz[1:] - edges_hz[:-1]  # [n_mels + 1]
    ramps = edges_hz[:, None] - fft_hz[None, :]  # [n_mels + 2, F]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    weights = torch.clamp(torch.minimum(rising, falling), min=0.0)  # [n_mels, F]
    weights = weights * (2.0 / (edges_hz[2:] - edges_hz[:-2]))[:, None]
    return weights.float()


@functools.lru_cache(maxsize=16)
def _slaney_mel_filters(sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float,
                        device: torch.device) -> torch.Tensor:
    return _slaney_mel_filters_cpu(sr, n_fft, n_mels, fmin, fmax).to(device)


@functools.lru_cache(maxsize=8)
def _kaldi_mel_banks(n_mels: int, n_fft: int, sr: float, low_hz: float, device: torch.device) -> torch.Tensor:
    """Kaldi mel banks -> [n_mels, n_fft//2 + 1] (last column, the Nyquist bin, is zero).

    Kaldi mel scale is 1127 ln(1 + f/700); triangles are linear in mel between equally spaced
    edges from `low_hz` to Nyquist, evaluated at bin frequencies k * sr / n_fft, k < n_fft/2.
    Edges are float64 scalars, the grid float32 tensors: the precision torchaudio computes them in,
    which matters for near-silent frames (float64 banks move their log energies by up to 1e-4).
    """
    lo, hi = (1127.0 * math.log1p(f / 700.0) for f in (low_hz, sr / 2))
    delta = (hi - lo) / (n_mels + 1)
    b = torch.arange(n_mels)[:, None]  # int64 grid; float32 after mixing with the scalars
    left, center, right = lo + b * delta, lo + (b + 1.0) * delta, lo + (b + 2.0) * delta  # [n_mels, 1]
    bin_mel = 1127.0 * (1.0 + sr / n_fft * torch.arange(n_fft // 2) / 700.0).log()  # [n_fft/2]
    up = (bin_mel[None] - left) / (center - left)
    down = (right - bin_mel[None]) / (right - center)
    banks = torch.clamp(torch.minimum(up, down), min=0.0)  # [n_mels, n_fft/2] float32
    return F.pad(banks, (0, 1)).to(device)


@functools.lru_cache(maxsize=16)
def _window(kind: str, size: int, device: torch.device) -> torch.Tensor:
    if kind == "hann":  # periodic, as torch.hann_window's default
        return torch.hann_window(size, periodic=True, device=device)
    if kind == "povey":
        # float32 throughout, as Kaldi/torchaudio: a float64 window moves quiet frames by up to 7e-4
        return torch.hann_window(size, periodic=False, device=device).pow(KALDI_POVEY_POWER)
    raise ValueError(kind)


def _as_batch(wave: torch.Tensor, name: str) -> torch.Tensor:
    """Accept [N] or [1, N] float audio -> [1, N] float32."""
    if wave.dim() == 1:
        wave = wave[None]
    if wave.dim() != 2 or wave.shape[0] != 1:
        raise ValueError(f"{name} expects mono audio [1, N], got shape {tuple(wave.shape)}")
    return wave.float()


# --- features -------------------------------------------------------------------------------


def whisper_log_mel(wave_16k: torch.Tensor, n_mels: int = 128) -> torch.Tensor:
    """Whisper log-mel of 16 kHz audio `[1, N]` -> `[1, n_mels, N // 160]` (100 frames/s).

    Power STFT (n_fft 400, hop 160, periodic Hann, centred with reflect padding, last frame dropped),
    Slaney mel filterbank, log10 floored at 1e-10 and at (max - 8), then (x + 4) / 4.
    """
    x = _as_batch(wave_16k, "whisper_log_mel")
    spec = torch.stft(x, WHISPER_N_FFT, WHISPER_HOP, window=_window("hann", WHISPER_N_FFT, x.device),
                      center=True, pad_mode="reflect", return_complex=True)  # [1, 201, T+1]
    power = spec[..., :-1].abs() ** 2  # [1, 201, T]
    filters = _slaney_mel_filters(PROMPT_SAMPLE_RATE_HZ, WHISPER_N_FFT, n_mels, 0.0,
                                  PROMPT_SAMPLE_RATE_HZ / 2, x.device)  # [n_mels, 201]
    log_spec = torch.clamp(filters @ power, min=1e-10).log10()  # [1, n_mels, T]
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)  # 80 dB dynamic range
    return (log_spec + 4.0) / 4.0


def kaldi_fbank(wave_16k: torch.Tensor, num_mel_bins: int = 80) -> torch.Tensor:
    """Kaldi log-mel filterbank of 16 kHz audio `[1, N]` (float in [-1, 1]) -> `[T, num_mel_bins]`.

    `T = 1 + (N - 400) // 160` (snip_edges). Per frame: remove DC, pre-emphasis 0.97 (first sample
    against itself), povey window, zero-pad to 512, power spectrum, Kaldi mel banks (20 Hz..8 kHz),
    natural log floored at float32 epsilon. No dither, no energy column.
    """
    x = _as_batch(wave_16k, "kaldi_fbank")[0]  # [N]
    if x.shape[0] < KALDI_FRAME_LEN:
        raise ValueError(f"kaldi_fbank needs at least {KALDI_FRAME_LEN} samples (25 ms), got {x.shape[0]}")
    frames = x.unfold(0, KALDI_FRAME_LEN, KALDI_FRAME_SHIFT)  # [T, 400]
    frames = frames - frames.mean(dim=1, keepdim=True)
    prev = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)  # x[j-1], with x[-1] := x[0]
    frames = (frames - KALDI_PREEMPH * prev) * _window("povey", KALDI_FRAME_LEN, x.device)
    frames = F.pad(frames, (0, KALDI_FFT - KALDI_FRAME_LEN))  # [T, 512]
    power = torch.fft.rfft(frames).abs().pow(2.0)  # [T, 257]
    banks = _kaldi_mel_banks(num_mel_bins, KALDI_FFT, float(PROMPT_SAMPLE_RATE_HZ), KALDI_LOW_HZ, x.device)
    mel = power @ banks.T  # [T, num_mel_bins]
    return torch.clamp(mel, min=FLOAT32_EPS).log()


def cmn(fbank: torch.Tensor) -> torch.Tensor:
    """Cepstral mean normalisation: `[T, C]` minus its mean over time."""
    return fbank - fbank.mean(dim=0, keepdim=True)


def prompt_mel(wave_24k: torch.Tensor, feat: FeatDims) -> torch.Tensor:
    """Matcha mel spectrogram of the prompt `[1, N]` at `feat.sampling_rate` -> `[1, T, num_mels]`.

    Reflect-pad (n_fft - hop) / 2 on both sides, STFT (periodic Hann of win_size, `feat.center`),
    magnitude sqrt(re² + im² + 1e-9), Slaney mel basis (fmin..fmax), natural log floored at 1e-5.
    With n_fft 1920 / hop 480: T = N // 480 (50 frames/s).
    """
    x = _as_batch(wave_24k, "prompt_mel")
    pad = (feat.n_fft - feat.hop_size) // 2
    x = F.pad(x[:, None], (pad, pad), mode="reflect")[:, 0]  # [1, N + 2 pad]
    spec = torch.stft(x, feat.n_fft, hop_length=feat.hop_size, win_length=feat.win_size,
                      window=_window("hann", feat.win_size, x.device), center=feat.center,
                      pad_mode="reflect", normalized=False, onesided=True, return_complex=True)
    mag = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + MATCHA_MAG_EPS)  # [1, n_fft/2+1, T]
    fmax = feat.fmax if feat.fmax is not None else feat.sampling_rate / 2
    basis = _slaney_mel_filters(feat.sampling_rate, feat.n_fft, feat.num_mels, float(feat.fmin), float(fmax),
                                x.device)  # [num_mels, n_fft/2+1]
    mel = torch.clamp(basis @ mag, min=MATCHA_LOG_FLOOR).log()  # [1, num_mels, T]
    return mel.transpose(1, 2)
