"""Streaming encoders for the speech formats OpenAI's audio API offers: mp3, opus (Ogg), aac (ADTS), flac.

Design notes: docs/design.md.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import AsyncIterator

import numpy as np

from app.audio import OUTPUT_SAMPLE_RATE_HZ

# every response_format of /v1/audio/speech; the first two need no encoder
FORMATS = ("wav", "pcm", "mp3", "opus", "aac", "flac")
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "mp3": "audio/mpeg", "opus": "audio/ogg",
               "aac": "audio/aac", "flac": "audio/flac"}
SUFFIXES = {"wav": ".wav", "pcm": ".pcm", "mp3": ".mp3", "opus": ".opus", "aac": ".aac", "flac": ".flac"}
ENCODED = ("mp3", "opus", "aac", "flac")
# sent whole by the HTTP API (app/server/speech.py): only a whole FLAC has the exact STREAMINFO length that
# libsndfile (soundfile.read) needs; every other format is read by soundfile (but aac: libsndfile has no AAC)
# and ffmpeg when streamed
WHOLE_ONLY = ("flac",)
OPUS_PAGE_MS = 100.0  # an Ogg page is closed after this much audio (libsndfile default: 1000 ms)
SFC_SET_OGG_PAGE_LATENCY_MS = 0x1302  # libsndfile >= 1.2 sf_command (sndfile.h)
MP3_BITRATE = 64_000  # 24 kHz mono speech (MPEG-2 layer III); OpenAI's mp3 is 24 kHz too
AAC_BITRATE = 64_000
OPUS_BITRATE = 48_000  # wideband speech is transparent well below this
# mp3: no Xing/LAME frame (its content is only known at the end) and no ID3 tag; opus: close an Ogg page
# every OPUS_PAGE_MS (the muxer's default holds 1 s)
AV_MUXER_OPTIONS = {"mp3": {"write_xing": "0", "id3v2_version": "0"},
                    "opus": {"page_duration": str(int(OPUS_PAGE_MS * 1000))}}  # microseconds
AV_BUFFER_BYTES = 4096  # PyAV's output buffer; packets are flushed one by one anyway (flush_packets)


class FormatUnavailable(RuntimeError):
    """The format's library is not installed; the message says what to install."""


class _Tap:
    """A write-only file for the encoders: appended bytes are collected for `take`; a write into bytes
    already taken (a header rewritten at close) is dropped. Seekable for libsndfile's virtual IO."""

    def __init__(self, seekable: bool) -> None:
        self._out, self._taken, self._pos, self._size = bytearray(), 0, 0, 0
        if not seekable:  # PyAV treats a file without seek/tell as a pipe (no header rewrite)
            self.seek = self.tell = None

    def write(self, data) -> int:
        data = bytes(data)
        start = self._pos - self._taken  # index into the bytes not yet taken
        if start >= 0:
            self._out[start:start + len(data)] = data
        elif start + len(data) > 0:  # overlaps the untaken tail: keep that part
            self._out[:start + len(data)] = data[-start:]
        self._pos += len(data)
        self._size = max(self._size, self._pos)
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else (self._pos + offset if whence == 1 else self._size + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:  # libsndfile never reads back what it writes here
        return b""

    def take(self) -> bytes:
        end = self._size - self._taken
        out = bytes(self._out[:end])
        del self._out[:end]
        self._taken = self._size
        return out


class _SoundfileEncoder:
    def __init__(self, fmt: str) -> None:
        import soundfile as sf

        self._tap = _Tap(seekable=True)
        major, subtype = {"flac": ("FLAC", "PCM_16"), "opus": ("OGG", "OPUS"), "mp3": ("MP3", "MPEG_LAYER_III")}[fmt]
        self._file = sf.SoundFile(self._tap, "w", samplerate=OUTPUT_SAMPLE_RATE_HZ, channels=1, format=major,
                                  subtype=subtype)
        if fmt == "opus":
            ms = sf._ffi.new("double *", OPUS_PAGE_MS)
            sf._snd.sf_command(self._file._file, SFC_SET_OGG_PAGE_LATENCY_MS, ms, sf._ffi.sizeof("double"))

    def encode(self, pcm: np.ndarray) -> bytes:
        self._file.write(pcm)
        return self._tap.take()

    def finish(self) -> bytes:
        self._file.close()
        return self._tap.take()

    def whole(self, pcm: np.ndarray) -> bytes:
        """One file: nothing is taken before the close, so its header rewrite (FLAC: length, MD5) lands."""
        self._file.write(pcm)
        return self.finish()

    def close(self) -> None:
        self._file.close()


class _AvEncoder:
    def __init__(self, fmt: str) -> None:
        try:
            import av
        except ImportError as e:
            raise FormatUnavailable(f"response_format {fmt!r} needs PyAV on the server (pip install av); "
                                    "use flac, wav or pcm") from e
        codec, container, sample_fmt, bitrate = {"mp3": ("libmp3lame", "mp3", "s16p", MP3_BITRATE),
                                                 "aac": ("aac", "adts", "fltp", AAC_BITRATE),
                                                 "flac": ("flac", "flac", "s16", 0),
                                                 "opus": ("libopus", "ogg", "s16", OPUS_BITRATE)}[fmt]
        self._av, self._sample_fmt = av, sample_fmt
        self._tap = _Tap(seekable=False)
        opts = {"flush_packets": "1", **AV_MUXER_OPTIONS.get(fmt, {})}
        self._out = av.open(self._tap, "w", format=container, buffer_size=AV_BUFFER_BYTES, options=opts)
        self._stream = self._out.add_stream(codec, rate=OUTPUT_SAMPLE_RATE_HZ, layout="mono")
        if bitrate:
            self._stream.bit_rate = bitrate
        self._samples = 0

    def _frame(self, pcm: np.ndarray):
        arr = pcm[None] if self._sample_fmt.startswith("s16") else (pcm.astype(np.float32) / 32768.0)[None]
        frame = self._av.AudioFrame.from_ndarray(np.ascontiguousarray(arr), format=self._sample_fmt, layout="mono")
        frame.sample_rate, frame.pts = OUTPUT_SAMPLE_RATE_HZ, self._samples
        self._samples += pcm.shape[0]
        return frame

    def encode(self, pcm: np.ndarray) -> bytes:
        self._out.mux(self._stream.encode(self._frame(pcm)))
        return self._tap.take()

    def finish(self) -> bytes:
        self._out.mux(self._stream.encode(None))
        self._out.close()
        return self._tap.take()

    def whole(self, pcm: np.ndarray) -> bytes:
        return self.encode(pcm) + self.finish()

    def close(self) -> None:
        self._out.close()


# format -> encoder class: the measured choice (docs/api.md); BACKENDS lists every pair the bench compares
ENCODERS = {"mp3": _AvEncoder, "opus": _AvEncoder, "aac": _AvEncoder, "flac": _SoundfileEncoder}
BACKENDS = {"soundfile": (_SoundfileEncoder, ("mp3", "opus", "flac")), "pyav": (_AvEncoder, ENCODED)}


def make_encoder(fmt: str, backend: str | None = None):
    """A streaming encoder for `fmt` (one of ENCODED): `.encode(int16 [N]) -> bytes`, `.finish() -> bytes`
    (the tail; closes), `.whole(int16 [N]) -> bytes` (instead of both: one file), `.close()` (idempotent).
    `FormatUnavailable` when its library is missing."""
    cls = ENCODERS[fmt] if backend is None else BACKENDS[backend][0]
    return cls(fmt)


@functools.cache
def available(fmt: str) -> bool:
    """Whether `fmt` can be encoded here (mp3, opus and aac need PyAV)."""
    if fmt not in ENCODED:
        return fmt in FORMATS
    try:
        make_encoder(fmt).close()
    except FormatUnavailable:
        return False
    return True


async def encode_stream(pcm_chunks: AsyncIterator[bytes], fmt: str) -> AsyncIterator[bytes]:
    """s16le mono 24 kHz PCM byte chunks -> `fmt`'s bytes, one piece per chunk (empty pieces skipped);
    encoding runs in a worker thread so other streams keep the event loop."""
    import asyncio

    enc = make_encoder(fmt)
    try:
        async for chunk in pcm_chunks:
            out = await asyncio.to_thread(enc.encode, np.frombuffer(chunk, dtype="<i2"))
            if out:
                yield out
        tail = await asyncio.to_thread(enc.finish)
        if tail:
            yield tail
    finally:
        enc.close()
        if hasattr(pcm_chunks, "aclose"):  # the synthesis' own cleanup runs at once, not at garbage collection
            await pcm_chunks.aclose()


def wav_header(n_samples: int | None = None) -> bytes:
    """The 44-byte RIFF/WAVE header of 16-bit mono 24 kHz PCM: exact RIFF and data sizes for `n_samples`,
    or the "unknown length" sizes (0xFFFFFFFF) of a stream when None."""
    rate = OUTPUT_SAMPLE_RATE_HZ
    data_bytes = 0xFFFFFFFF if n_samples is None else 2 * n_samples
    riff_bytes = 0xFFFFFFFF if n_samples is None else 36 + data_bytes
    return (b"RIFF" + struct.pack("<I", riff_bytes) + b"WAVE" + b"fmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16) + b"data" + struct.pack("<I", data_bytes))


def encode_whole(samples: np.ndarray, fmt: str) -> bytes:
    """int16 [N] mono 24 kHz -> one `fmt` file (any of FORMATS) with exact lengths where the format has
    them (WAV sizes, FLAC's STREAMINFO total and MD5): a whole /v1 response, the page's download of a take."""
    if fmt in ("wav", "pcm"):
        pcm = np.ascontiguousarray(samples, dtype="<i2").tobytes()
        return (wav_header(samples.shape[0]) if fmt == "wav" else b"") + pcm
    enc = make_encoder(fmt)
    try:
        return enc.whole(samples)
    finally:
        enc.close()

