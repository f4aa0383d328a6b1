"""Audio units and DSP helpers shared by every layer.

Units are named constants (whisper/audio.py style) so shapes can be derived, never guessed:
speech tokens run at 25 Hz, each token is 2 mel frames (50 Hz), each mel frame is 480 samples
at the 24 kHz output rate.

Below the constants: audio loading (mono, resampled like the official `load_wav`), torchaudio-
compatible resampling and fixed-scale int16 / WAV encoding for the UI and API.
"""

from __future__ import annotations

import functools
import io
import math
import wave as _wave
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

OUTPUT_SAMPLE_RATE_HZ = 24_000  # HiFT output and prompt-mel rate
PROMPT_SAMPLE_RATE_HZ = 16_000  # speech tokenizer and CAM++ rate
TOKEN_RATE_HZ = 25  # speech tokens per second
MEL_FRAMES_PER_TOKEN = 2  # token_mel_ratio
MEL_RATE_HZ = TOKEN_RATE_HZ * MEL_FRAMES_PER_TOKEN  # 50 mel frames per second
SAMPLES_PER_MEL_FRAME = OUTPUT_SAMPLE_RATE_HZ // MEL_RATE_HZ  # 480
SAMPLES_PER_TOKEN = SAMPLES_PER_MEL_FRAME * MEL_FRAMES_PER_TOKEN  # 960
N_MELS = 80  # prompt mel / flow output channels
MAX_PROMPT_SECONDS = 30.0  # the speech tokenizer refuses longer prompts
MIN_PROMPT_SECONDS = 0.2  # below this there is no usable token, fbank frame or mel frame

# torchaudio.functional.resample defaults (sinc_interp_hann)
RESAMPLE_LOWPASS_WIDTH = 6  # zero crossings of the sinc on each side
RESAMPLE_ROLLOFF = 0.99  # cut-off as a fraction of the lower Nyquist
INT16_SCALE = 32767  # fixed float -> int16 scale (never peak-normalised)

# Containers libsndfile cannot decode; PyAV (ffmpeg) is needed for them.
_FFMPEG_ONLY = {".webm": "WebM", ".m4a": "M4A/AAC", ".mp4": "MP4", ".aac": "AAC", ".opus": "Opus",
                ".wma": "WMA", ".amr": "AMR", ".3gp": "3GP"}


class AudioError(ValueError):
    """An audio input is missing, empty, corrupt or in a format we cannot decode; the message names it."""


def _sniff_container(head: bytes, suffix: str) -> str | None:
    """Name an ffmpeg-only container from its magic bytes or file suffix, else None."""
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "WebM/Matroska"
    if head[4:8] == b"ftyp":
        return "MP4/M4A"
    if len(head) >= 2 and head[0] == 0xFF and (head[1] & 0xF6) == 0xF0:
        return "AAC (ADTS)"
    return _FFMPEG_ONLY.get(suffix.lower())


def _av_frame_to_float(frame) -> np.ndarray:
    """A decoded PyAV audio frame -> [C, n] float32 in [-1, 1] (int formats scaled like libsndfile)."""
    arr = frame.to_ndarray()
    if not frame.format.is_planar:  # packed: [1, n * C] interleaved
        arr = arr.reshape(-1, len(frame.layout.channels)).T
    kind = frame.format.name.rstrip("p")  # s16p -> s16
    if kind == "u8":
        return (arr.astype(np.float32) - 128.0) / 128.0
    if kind in ("s16", "s32", "s64"):
        return (arr.astype(np.float64) / 2.0 ** (int(kind[1:]) - 1)).astype(np.float32)
    return arr.astype(np.float32)  # flt / dbl


def _decode_with_av(data: bytes, name: str) -> tuple[np.ndarray, int]:
    """Decode with PyAV (imported lazily) -> ([C, N] float32, sample_rate)."""
    import av  # optional dependency; only reached for formats libsndfile cannot read
    from av.error import FFmpegError

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.audio:
                raise AudioError(f"{name}: no audio stream")
            stream = container.streams.audio[0]
            chunks = [_av_frame_to_float(f) for f in container.decode(stream)]
            sr = int(stream.codec_context.sample_rate)
    except FFmpegError as e:
        raise AudioError(f"{name}: cannot decode audio ({e})") from e
    if not chunks:
        raise AudioError(f"{name}: the audio stream holds no samples")
    return np.concatenate(chunks, axis=1), sr


def _read_any(src: str | Path | bytes) -> tuple[torch.Tensor, int]:
    """Read a file or its bytes -> ([C, N] float32 in [-1, 1], sample_rate)."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        data, name, suffix = bytes(src), "audio bytes", ""
    else:
        path = Path(src)
        name, suffix = str(path), path.suffix
        if not path.is_file():
            raise AudioError(f"audio file not found: {path}")
        try:
            data = path.read_bytes()
        except OSError as e:
            raise AudioError(f"cannot read audio file {path}: {e}") from e
    if not data:
        raise AudioError(f"{name} is empty (0 bytes)")
    import soundfile as sf  # lazily: only prompt decoding needs libsndfile

    try:
        # soundfile's float read of int PCM is int/32768 (16 bit), as torchaudio's loader gives it
        samples, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)  # [N, C]
        chans = torch.from_numpy(np.ascontiguousarray(samples.T))
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        container = _sniff_container(data[:16], suffix)
        try:
            import av  # noqa: F401
        except ImportError:
            if container:
                raise AudioError(
                    f"{name}: {container} audio is not supported without ffmpeg; install PyAV "
                    "(`pip install av`) or convert it to WAV/FLAC/OGG/MP3") from e
            reason = str(e).rsplit(": ", 1)[-1]  # drop soundfile's "Error opening <BytesIO ...>"
            raise AudioError(f"{name}: not a readable audio file ({reason})") from e
        arr, sr = _decode_with_av(data, name)
        chans = torch.from_numpy(arr)
    if chans.shape[-1] == 0:
        raise AudioError(f"{name} holds no samples")
    if not torch.isfinite(chans).all():
        raise AudioError(f"{name} holds NaN/inf samples")
    return chans, int(sr)


def load_audio_rates(src: str | Path | bytes, rates: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """Decode once, return float32 mono `[1, N_r]` at each rate in `rates` (the official `load_wav`).

    Channels are averaged; other rates go through `resample` (torchaudio's sinc/Hann defaults).
    Raises `AudioError` naming the input when it is missing, empty, corrupt or undecodable.
    """
    chans, sr = _read_any(src)  # [C, N]
    mono = chans.float().mean(dim=0, keepdim=True)  # [1, N]
    return tuple(resample(mono, sr, r) if sr != r else mono for r in rates)


def load_audio(src: str | Path | bytes, target_sr: int) -> torch.Tensor:
    """Load audio as float32 mono `[1, N]` at `target_sr` Hz (see `load_audio_rates`)."""
    return load_audio_rates(src, (target_sr,))[0]


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


def to_int16_pcm(wave: np.ndarray | torch.Tensor) -> np.ndarray:
    """Float samples -> little-endian int16 with a fixed scale (clip to [-1, 1], × 32767, round)."""
    if isinstance(wave, torch.Tensor):
        wave = wave.detach().float().cpu().numpy()
    x = np.clip(np.asarray(wave, dtype=np.float32), -1.0, 1.0) * INT16_SCALE
    return np.rint(x).astype("<i2")


def wav_bytes(samples: np.ndarray | torch.Tensor, sample_rate: int) -> bytes:
    """Encode samples as a 16-bit PCM WAV file.

    `samples`: float in [-1, 1] (fixed-scale converted) or int16; `[N]`, `[1, N]` or channels-first `[C, N]`.
    """
    if isinstance(samples, torch.Tensor):
        samples = samples.detach().cpu().numpy()
    arr = np.asarray(samples)
    pcm = arr.astype("<i2") if arr.dtype == np.int16 else to_int16_pcm(arr)
    if pcm.ndim == 1:
        pcm = pcm[None]
    if pcm.ndim != 2:
        raise ValueError(f"wav_bytes expects [N] or [C, N] samples, got shape {arr.shape}")
    buf = io.BytesIO()
    with _wave.open(buf, "wb") as w:
        w.setnchannels(pcm.shape[0])
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(np.ascontiguousarray(pcm.T).tobytes())  # interleaved frames
    return buf.getvalue()
