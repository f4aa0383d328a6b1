"""What word timings cost: `python -m bench aligner [--device cpu|cuda] [--size full|tiny] [--out F.json]`.

The aligner (app/model/align.py, docs/timings.md) runs once per finished sentence: one Whisper encoder pass over
its 30 s window and one teacher-forced decoder pass over its tokens. This times `WhisperAligner.align` on the
example recordings (assets/prompt_en.wav 4.75 s, prompt_zh.wav 7.47 s, with their transcripts) on a random-weights
Whisper built in memory (app/model/random/whisper.py): `full` has large-v3-turbo's shapes (the FLOPs of the real
model, float16 on a GPU and float32 on a CPU as WhisperAsr.load gives them), `tiny` is the tests' model. Reported
per recording: median ms per sentence over --repeats (after one warm-up), ms per audio second, and the model's
memory (parameters; peak CUDA memory on a GPU).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from app.audio import OUTPUT_SAMPLE_RATE_HZ, load_audio
from bench.examples import example_voices

COLUMNS = ("recording", "audio_s", "words", "ms_per_sentence", "ms_per_audio_s", "device", "size", "note")


def add_parser(sub: Any) -> None:
    a = sub.add_parser("aligner", help="cost of aligning one sentence's words (Whisper, random weights)")
    a.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when there is one)")
    a.add_argument("--size", choices=("full", "tiny"), default="full")
    a.add_argument("--repeats", type=int, default=5)
    a.add_argument("--out", help="JSON report")


def recordings() -> list[tuple[str, np.ndarray, str]]:
    """(name, [N] float32 samples at 24 kHz, transcript) of the example voices."""
    return [(v["name"], load_audio(v["audio"], OUTPUT_SAMPLE_RATE_HZ)[0].numpy(), v["transcript"])
            for v in example_voices()]


def run(args: Any, argv: list[str]) -> dict[str, Any]:
    import torch

    from app.model.align import WhisperAligner
    from app.model.asr import WhisperAsr, resolve_device
    from app.model.random.whisper import build_whisper

    device = resolve_device(args.device)
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    model, processor = build_whisper(full=args.size == "full")
    aligner = WhisperAligner(WhisperAsr(model.to(device, dtype), processor, device))
    n_params = sum(p.numel() for p in model.parameters())
    rows = []
    for name, samples, text in recordings():
        aligner.align(samples, OUTPUT_SAMPLE_RATE_HZ, text)  # warm-up: first-call allocations and kernels
        times = []
        for _ in range(args.repeats):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = aligner.align(samples, OUTPUT_SAMPLE_RATE_HZ, text)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        ms, audio_s = statistics.median(times) * 1e3, samples.size / OUTPUT_SAMPLE_RATE_HZ
        rows.append({"recording": name, "audio_s": round(audio_s, 2), "words": len(got.words),
                     "ms_per_sentence": round(ms, 1), "ms_per_audio_s": round(ms / audio_s, 1),
                     "device": device, "size": args.size, "note": got.note})  # a note: not aligned (why)
    facts = {"parameters": n_params, "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
             "threads": torch.get_num_threads(), "repeats": args.repeats}
    if device.startswith("cuda"):
        facts |= {"gpu": torch.cuda.get_device_name(), "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20)}
    return {"bench": "aligner", "argv": argv, "rows": rows, "facts": facts}
