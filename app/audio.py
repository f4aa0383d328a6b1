"""Audio units and DSP helpers shared by every layer.

Design notes: docs/design.md.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tempfile
import wave as _wave
from pathlib import Path

import numpy as np
import torch

from app.message import Message
from app.resample import MAX_RESAMPLE_KERNEL, resample, resample_kernel_size

OUTPUT_SAMPLE_RATE_HZ = 24_000  # HiFT output and prompt-mel rate
PROMPT_SAMPLE_RATE_HZ = 16_000  # speech tokenizer and CAM++ rate
TOKEN_RATE_HZ = 25  # speech tokens per second
MEL_FRAMES_PER_TOKEN = 2  # token_mel_ratio
MEL_RATE_HZ = TOKEN_RATE_HZ * MEL_FRAMES_PER_TOKEN  # 50 mel frames per second
SAMPLES_PER_MEL_FRAME = OUTPUT_SAMPLE_RATE_HZ // MEL_RATE_HZ  # 480
SAMPLES_PER_TOKEN = SAMPLES_PER_MEL_FRAME * MEL_FRAMES_PER_TOKEN  # 960
N_MELS = 80  # prompt mel / flow output channels
MAX_PROMPT_SECONDS = 30.0  # the speech tokenizer refuses longer prompts
MIN_PROMPT_SECONDS = 1.0  # shorter references carry too little of the voice to clone (3-10 s work best)

# reference-clip checks (app/model/frontend.py applies them; docs/inputs.md lists the outcomes)
MAX_DECODE_SECONDS = 600.0  # uploads longer than this are refused before they are decoded
LEVEL_FRAME_SECONDS = 0.02  # loudness is measured per 20 ms frame (AC RMS, dBFS)
SILENCE_DBFS = -50.0  # a frame quieter than this holds no usable speech
MIN_SOUND_SECONDS = 0.5  # a reference needs at least this much sound above SILENCE_DBFS
CLIP_MIN_PEAK = 0.5  # clipping is only looked for in clips whose peak reaches this (-6 dBFS)
CLIP_WARN_FRACTION = 0.01  # >= 1% of samples pinned at the peak: heavily clipped (accepted with a note)
# sample rates are checked before resampling: an odd rate (e.g. 44101 Hz) would need a huge polyphase kernel
MIN_SOURCE_RATE_HZ, MAX_SOURCE_RATE_HZ = 4_000, 192_000
FFMPEG_TIMEOUT_S = 60  # decoding one upload with the ffmpeg CLI

INT16_SCALE = 32767  # fixed float -> int16 scale (never peak-normalised)

# Containers libsndfile cannot decode -> (label, ffmpeg demuxer); PyAV or the ffmpeg CLI decodes them.
_FFMPEG_ONLY = {".webm": ("WebM", "matroska"), ".mkv": ("Matroska", "matroska"), ".m4a": ("M4A/AAC", "mov"),
                ".mp4": ("MP4", "mov"), ".3gp": ("3GP", "mov"), ".aac": ("AAC", "aac"), ".opus": ("Opus", "ogg"),
                ".wma": ("WMA", "asf"), ".amr": ("AMR", "amr")}
_COMMON_RATES = "8, 16, 22.05, 24, 32, 44.1 or 48 kHz"
_CONVERT = "convert it to WAV, FLAC, OGG or MP3"


class AudioError(ValueError):
    """An audio input is missing, empty, corrupt or in a format we cannot decode; the message names it."""


def _sniff_container(head: bytes, suffix: str) -> tuple[str, str] | None:
    """(label, ffmpeg demuxer) of an ffmpeg-only container from its magic bytes or file suffix, else None."""
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "WebM/Matroska", "matroska"
    if head[4:8] == b"ftyp":
        return "MP4/M4A", "mov"
    if head[:4] == b"\x30\x26\xb2\x75":
        return "WMA/ASF", "asf"
    if head[:5] == b"#!AMR":
        return "AMR", "amr"
    if len(head) >= 2 and head[0] == 0xFF and (head[1] & 0xF6) == 0xF0:
        return "AAC (ADTS)", "aac"
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


def _decode_with_av(data: bytes, name: str, label: str, demuxer: str) -> tuple[np.ndarray, int]:
    """Decode with PyAV (imported lazily) -> ([C, N] float32, sample_rate). The demuxer is forced, as for
    the ffmpeg CLI: no format probing, so an upload cannot pose as a playlist that opens other inputs."""
    import av  # only reached for formats libsndfile cannot read
    from av.error import FFmpegError

    try:
        with av.open(io.BytesIO(data), format=demuxer) as container:
            if not container.streams.audio:
                raise AudioError(Message("no_stream", "{name}: no audio stream", name=name))
            stream = container.streams.audio[0]
            chunks = [_av_frame_to_float(f) for f in container.decode(stream)]
            sr = int(stream.codec_context.sample_rate)
    except FFmpegError as e:  # the same words as the ffmpeg CLI's failure: what it is and what to do
        raise AudioError(Message("cannot_decode", "{name}: this {label} audio cannot be decoded ({why}); {convert}",
                                 name=name, label=label, why=f"PyAV: {e}", convert=_CONVERT)) from e
    if not chunks:
        raise AudioError(Message("no_samples", "{name}: the audio stream holds no samples", name=name))
    return np.concatenate(chunks, axis=1), sr


def _decode_with_ffmpeg(exe: str, data: bytes, name: str, label: str, demuxer: str) -> tuple[np.ndarray, int]:
    """Decode with the ffmpeg CLI -> ([C, N] float32, sample_rate).

    The demuxer is forced (no format probing, so a playlist or concat file cannot pull in other
    files) and only the `file` protocol is allowed; the first audio stream becomes a float WAV of at
    most MAX_DECODE_SECONDS (+1 s, so that the length check below still sees it is too long).
    """
    import soundfile as sf

    with tempfile.TemporaryDirectory(prefix="studio-audio-") as tmp:
        src, out = Path(tmp) / "upload", Path(tmp) / "decoded.wav"
        src.write_bytes(data)
        cmd = [exe, "-nostdin", "-hide_banner", "-loglevel", "error", "-protocol_whitelist", "file",
               "-f", demuxer, "-i", str(src), "-map", "0:a:0", "-t", f"{MAX_DECODE_SECONDS + 1:.0f}",
               "-c:a", "pcm_f32le", "-f", "wav", str(out)]
        try:
            done = subprocess.run(cmd, capture_output=True, timeout=FFMPEG_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as e:
            raise AudioError(Message("decode_slow", "{name}: decoding this {label} audio took over {seconds} s; "
                                     "{convert}", name=name, label=label, seconds=FFMPEG_TIMEOUT_S,
                                     convert=_CONVERT)) from e
        if done.returncode != 0 or not out.is_file():
            lines = done.stderr.decode("utf-8", "replace").replace(str(src), "input").strip().splitlines()
            raise AudioError(Message("cannot_decode", "{name}: this {label} audio cannot be decoded ({why}); {convert}",
                                     name=name, label=label, why=f"ffmpeg: {lines[-1] if lines else done.returncode}",
                                     convert=_CONVERT))
        samples, sr = sf.read(out, dtype="float32", always_2d=True)  # [N, C]
    return np.ascontiguousarray(samples.T), int(sr)


def _decode_other(data: bytes, name: str, suffix: str, err: Exception) -> tuple[np.ndarray, int]:
    """What libsndfile refused: known ffmpeg-only containers via PyAV, else the ffmpeg CLI, else a message."""
    container = _sniff_container(data[:16], suffix)
    if container is None:  # not a container we know: do not hand arbitrary bytes to ffmpeg
        reason = str(err).rsplit(": ", 1)[-1]  # drop soundfile's "Error opening <BytesIO ...>"
        raise AudioError(Message("not_audio", "{name}: not a readable audio file ({reason}); upload a WAV, FLAC, "
                                 "OGG or MP3 recording", name=name, reason=reason)) from err
    label, demuxer = container
    try:
        import av  # noqa: F401
    except ImportError:
        exe = shutil.which("ffmpeg")
        if exe is None:
            raise AudioError(Message("needs_ffmpeg", "{name}: {label} audio is not supported without ffmpeg; install "
                                     "ffmpeg or PyAV (`pip install av`), or {convert}", name=name, label=label,
                                     convert=_CONVERT)) from err
        try:
            return _decode_with_ffmpeg(exe, data, name, label, demuxer)
        except AudioError as e:  # say what was tried: PyAV might be what the admin reaches for
            raise AudioError(Message("decoders_tried", "{error} (decoders tried: libsndfile, ffmpeg; PyAV is not "
                                     "installed)", error=e)) from err
    return _decode_with_av(data, name, label, demuxer)


def _read_bytes(src: str | Path | bytes) -> tuple[bytes, str, str]:
    """(bytes, name for messages, file suffix) of a path or of bytes."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        data, name, suffix = bytes(src), "the upload", ""
    else:
        path = Path(src)
        name, suffix = str(path), path.suffix
        if not path.is_file():
            raise AudioError(Message("no_file", "audio file not found: {path}", path=str(path)))
        try:
            data = path.read_bytes()
        except OSError as e:
            raise AudioError(f"cannot read audio file {path}: {e}") from e
    if not data:
        raise AudioError(f"{name} is empty (0 bytes): upload a recording")
    return data, name, suffix


def _too_long(name: str, seconds: float) -> AudioError:
    return AudioError(f"{name} is {seconds / 60:.1f} min long; uploads are limited to {MAX_DECODE_SECONDS / 60:.0f} "
                      f"min and a reference needs only {MIN_PROMPT_SECONDS:.0f}-{MAX_PROMPT_SECONDS:.0f} s: "
                      "cut a short part of it")


def decode_audio(src: str | Path | bytes) -> tuple[torch.Tensor, int]:
    """Decode a file or its bytes -> ([C, N] float32 in [-1, 1], sample_rate).

    libsndfile first (WAV, FLAC, OGG/Vorbis/Opus, MP3, AIFF, ...), then PyAV or the ffmpeg CLI for
    WebM/MP4/M4A/AAC/WMA/AMR. Raises `AudioError` naming the input when it is missing, empty,
    corrupt, not audio, longer than MAX_DECODE_SECONDS, at an odd sample rate or holds NaN/inf.
    """
    data, name, suffix = _read_bytes(src)
    import soundfile as sf  # lazily: only prompt decoding needs libsndfile

    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            sr = int(f.samplerate)
            if sr > 0 and f.frames > MAX_DECODE_SECONDS * sr:  # refuse before decoding all of it
                raise _too_long(name, f.frames / sr)
            # soundfile's float read of int PCM is int/32768 (16 bit), as torchaudio's loader gives it
            arr = np.ascontiguousarray(f.read(dtype="float32", always_2d=True).T)  # [C, N]
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        arr, sr = _decode_other(data, name, suffix, e)
    if not MIN_SOURCE_RATE_HZ <= sr <= MAX_SOURCE_RATE_HZ:
        raise AudioError(f"{name}: sample rate {sr} Hz is outside {MIN_SOURCE_RATE_HZ}-{MAX_SOURCE_RATE_HZ} Hz; "
                         f"re-save it at {_COMMON_RATES}")
    if arr.shape[-1] == 0:
        raise AudioError(f"{name} holds no samples: upload a recording")
    if arr.shape[-1] > MAX_DECODE_SECONDS * sr:
        raise _too_long(name, arr.shape[-1] / sr)
    if not np.isfinite(arr).all():
        raise AudioError(f"{name} holds NaN/inf samples (a broken float recording): export it again, e.g. as "
                         "16-bit PCM WAV")
    return torch.from_numpy(arr), sr


def resample_rates(mono: torch.Tensor, sample_rate: int, rates: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """`mono` `[1, N]` at each rate in `rates`; `AudioError` for a source rate too odd to convert."""
    for r in rates:
        if resample_kernel_size(sample_rate, r) > MAX_RESAMPLE_KERNEL:
            raise AudioError(f"audio at an unusual sample rate ({sample_rate} Hz) cannot be converted to {r} Hz; "
                             f"re-save it at {_COMMON_RATES}")
    return tuple(resample(mono, sample_rate, r) if sample_rate != r else mono for r in rates)


def load_audio_rates(src: str | Path | bytes, rates: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """Decode once, return float32 mono `[1, N_r]` at each rate in `rates` (the official `load_wav`).

    Channels are averaged; other rates go through `resample` (torchaudio's sinc/Hann defaults).
    Raises `AudioError` naming the input when it is missing, empty, corrupt or undecodable.
    """
    chans, sr = decode_audio(src)  # [C, N]
    return resample_rates(chans.float().mean(dim=0, keepdim=True), sr, rates)  # [1, N] mono


def load_audio(src: str | Path | bytes, target_sr: int) -> torch.Tensor:
    """Load audio as float32 mono `[1, N]` at `target_sr` Hz (see `load_audio_rates`)."""
    return load_audio_rates(src, (target_sr,))[0]


# --- levels of a reference clip (mono [N] numpy at its own rate) ----------------------------------


def frame_levels_dbfs(mono: np.ndarray, sample_rate: int) -> np.ndarray:
    """[N] samples -> [F] AC RMS (DC removed) of each LEVEL_FRAME_SECONDS frame in dBFS (floor -200)."""
    n = max(1, round(sample_rate * LEVEL_FRAME_SECONDS))
    n_frames = mono.shape[0] // n
    frames = (mono[: n_frames * n].reshape(n_frames, n) if n_frames else mono[None]).astype(np.float64)
    rms = np.sqrt(np.mean((frames - frames.mean(axis=1, keepdims=True)) ** 2, axis=1))
    return 20 * np.log10(np.maximum(rms, 1e-10))


def clipped_fraction(mono: np.ndarray) -> float:
    """Share of samples pinned at the clip's peak (|x| >= 99.9% of it); 0 when the peak is under CLIP_MIN_PEAK."""
    peak = float(np.abs(mono).max()) if mono.size else 0.0
    return float(np.mean(np.abs(mono) >= 0.999 * peak)) if peak >= CLIP_MIN_PEAK else 0.0


def busiest_window(levels_dbfs: np.ndarray, n_frames: int) -> int:
    """Start frame of the `n_frames` window with the most frames above SILENCE_DBFS (the earliest of equals)."""
    active = np.concatenate([[0], np.cumsum(levels_dbfs >= SILENCE_DBFS)])  # [F + 1]
    return int(np.argmax(active[n_frames:] - active[:-n_frames]))


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
