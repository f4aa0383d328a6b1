"""Streaming encoders of /v1/audio/speech's formats on this CPU: `python -m bench formats [--out F.json]`.

For each (format, library) pair of app/audio_formats.BACKENDS, real speech (assets/prompt_en.wav at
24 kHz, repeated to --seconds) is handed over in --chunk-s blocks as the engine yields them, and
measured: first_byte_ms (the first block handed to a new encoder -> its first bytes out, encoder
construction included), first_audio_block (the block whose call first returns bytes past the
headers, i.e. audio: 0 = the first block),
encode_ms_per_audio_s (all encode calls / audio seconds), kbps, and the decoded length against the
input (extra_ms: encoder priming and frame padding a plain decoder keeps). Each pair runs --repeats
times; medians are reported. The decoder is PyAV (FFmpeg), which reads every format here.
"""

from __future__ import annotations

import io
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from app.audio import OUTPUT_SAMPLE_RATE_HZ, load_audio, to_int16_pcm

REPO = Path(__file__).resolve().parents[1]
COLUMNS = ("format", "backend", "chosen", "first_byte_ms", "first_audio_block", "header_bytes", "encode_ms_per_audio_s",
           "kbps", "extra_ms")


def add_parser(sub: Any) -> None:
    f = sub.add_parser("formats", help="first-byte time and cost of the mp3/opus/aac/flac streaming encoders")
    f.add_argument("--seconds", type=float, default=20.0, help="audio per run (speech, repeated)")
    f.add_argument("--chunk-s", type=float, default=1.0, help="block size handed to the encoder (engine chunk)")
    f.add_argument("--repeats", type=int, default=3)
    f.add_argument("--out", help="JSON report")


def speech(seconds: float) -> np.ndarray:
    """int16 [N] of the example prompt at 24 kHz, repeated to `seconds`."""
    wave = load_audio(REPO / "assets" / "prompt_en.wav", OUTPUT_SAMPLE_RATE_HZ)[0].numpy()
    n = int(seconds * OUTPUT_SAMPLE_RATE_HZ)
    return to_int16_pcm(np.tile(wave, -(-n // wave.size))[:n])


def decoded_seconds(data: bytes) -> float:
    import av

    with av.open(io.BytesIO(data)) as c:
        return sum(f.samples / f.sample_rate for f in c.decode(c.streams.audio[0]))  # Opus decodes at 48 kHz


def one_run(fmt: str, backend: str, pcm: np.ndarray, chunk: int) -> dict[str, float]:
    from app.audio_formats import make_encoder

    t0 = time.perf_counter()
    enc = make_encoder(fmt, backend)
    pieces, first_byte, first_audio, header, encode_s = [], None, None, 0, 0.0
    for i in range(0, pcm.size, chunk):
        t = time.perf_counter()
        out = enc.encode(pcm[i:i + chunk])
        encode_s += time.perf_counter() - t
        if out and first_byte is None:
            first_byte = time.perf_counter() - t0
        pieces.append(out)
    t = time.perf_counter()
    pieces.append(enc.finish())
    encode_s += time.perf_counter() - t
    # header bytes: what an encoder gives for a lone 1-sample block is headers only (no whole frame yet)
    probe = make_encoder(fmt, backend)
    header = len(probe.encode(pcm[:1]))
    probe.close()
    sent = np.cumsum([len(p) for p in pieces])  # the first piece that takes the total past the headers
    first_audio = int(np.argmax(sent > header))
    data = b"".join(pieces)
    seconds = pcm.size / OUTPUT_SAMPLE_RATE_HZ
    return {"first_byte_ms": (first_byte or 0) * 1e3, "first_audio_block": first_audio, "header_bytes": header,
            "encode_ms_per_audio_s": encode_s * 1e3 / seconds, "kbps": len(data) * 8 / seconds / 1e3,
            "extra_ms": (decoded_seconds(data) - seconds) * 1e3}


def run(args: Any, argv: list[str]) -> dict[str, Any]:
    from app.audio_formats import BACKENDS, ENCODERS
    from bench import report as rep

    pcm = speech(args.seconds)
    chunk = int(args.chunk_s * OUTPUT_SAMPLE_RATE_HZ)
    rows = []
    for backend, (cls, fmts) in BACKENDS.items():
        for fmt in fmts:
            runs = [one_run(fmt, backend, pcm, chunk) for _ in range(args.repeats)]
            row = {"format": fmt, "backend": backend, "chosen": ENCODERS[fmt] is cls}
            for key in runs[0]:
                row[key] = round(statistics.median(r[key] for r in runs), 2)
            rows.append(row)
    return {**rep.run_header("formats", argv), "seconds": args.seconds, "chunk_s": args.chunk_s,
            "repeats": args.repeats, "rows": rows}
