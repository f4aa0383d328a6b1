"""Command-line synthesis through the same engine as the server (vLLM where installed, else PyTorch).

Design notes: docs/design.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

from app.audio import OUTPUT_SAMPLE_RATE_HZ, wav_bytes
from app.cli import add_config_args, config_from_cli
from app.engine.requests import MODES
from app.service.prepare import SpeechInputs, prepare
from app.service.service import StudioService


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m app.tools.synthesize", description=__doc__.split("\n")[0],
                                epilog="Prints a JSON report. Design notes: docs/design.md.")
    add_config_args(p)
    p.add_argument("--text", required=True, help="text to speak")
    p.add_argument("--prompt-wav", required=True, help="reference recording (any common format)")
    p.add_argument("--prompt-text", default="", help="transcript of the reference recording")
    p.add_argument("--out", required=True, help="output 16-bit WAV path (24 kHz)")
    p.add_argument("--stream", action="store_true", help="stream token->wave in chunks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=MODES, default="zero_shot")
    p.add_argument("--instruct-text", default="")
    p.add_argument("--speed", type=float, default=1.0, help="non-streaming only")
    args = p.parse_args(argv)
    if not args.model_dir:
        p.error("--model-dir is required")
    return args


async def run(args: argparse.Namespace) -> dict:
    cfg = config_from_cli(args)
    service = StudioService(cfg)
    t0 = time.perf_counter()
    try:
        await service.start()
        if not service.ready:
            raise ValueError(service.error or service.status)
        load_s = time.perf_counter() - t0
        prepared = await prepare(service, SpeechInputs(
            text=args.text, reference=Path(args.prompt_wav), transcript=args.prompt_text, mode=args.mode,
            instruct_text=args.instruct_text, seed=args.seed, speed=args.speed, stream=args.stream))
        parts, chunk_lens, stats = [], [], None
        async for chunk in service.stream(prepared.request):
            parts.append(chunk.samples)
            chunk_lens.append(int(chunk.samples.shape[0]))
            stats = chunk.stats or stats
    finally:
        await service.aclose()
    audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    Path(args.out).write_bytes(wav_bytes(audio, OUTPUT_SAMPLE_RATE_HZ))
    assert stats is not None
    return {"out": args.out, "backend": service.facts().get("backend"),
            "checkpoint_counts": service.model.checkpoint_counts, "load_s": round(load_s, 3),
            "frontend_s": round(prepared.reference_s, 3), "mode": prepared.request.mode, "notes": list(prepared.notes),
            "ttfa_ms": round(stats.ttfa_ms, 1), "rtf": round(stats.rtf, 3), "audio_s": round(stats.audio_s, 3),
            "n_tokens": stats.n_tokens, "prompt_tokens": prepared.request.voice.n_prompt_tokens,
            "tokens_per_s": round(stats.tokens_per_s, 1),
            "n_segments": stats.n_segments, "chunk_samples": chunk_lens,
            "lm_s": round(stats.lm_s, 3), "flow_s": round(stats.flow_s, 3), "hift_s": round(stats.hift_s, 3)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = asyncio.run(run(args))
    except (ValueError, OSError) as e:  # bad model folder, audio, text or config: say what, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
