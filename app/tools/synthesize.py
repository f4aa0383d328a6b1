"""Command-line synthesis through the whole chain (frontend, LM, flow, HiFT).

    python -m app.tools.synthesize --model-dir D --text T --prompt-wav W --prompt-text P \
        --out out.wav [--stream] [--seed N] [--mode zero_shot|cross_lingual|instruct]
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
from app.config import load_config
from app.engine.lm_backend import TorchLMBackend
from app.engine.pipeline import Synthesizer
from app.engine.requests import MODES, SynthesisRequest
from app.model.loader import load_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m app.tools.synthesize", description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", required=True, help="CosyVoice2 folder in the official layout")
    p.add_argument("--text", required=True, help="text to speak")
    p.add_argument("--prompt-wav", required=True, help="reference recording (any common format)")
    p.add_argument("--prompt-text", default="", help="transcript of the reference recording")
    p.add_argument("--out", required=True, help="output 16-bit WAV path (24 kHz)")
    p.add_argument("--stream", action="store_true", help="stream token->wave in chunks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=MODES, default="zero_shot")
    p.add_argument("--instruct-text", default="")
    p.add_argument("--speed", type=float, default=1.0, help="non-streaming only")
    p.add_argument("--config", default=None, help="override file, e.g. configs/cpu.toml")
    p.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N")
    return p.parse_args(argv)


async def run(args: argparse.Namespace) -> dict:
    overrides = {"model.device": args.device} if args.device else {}
    cfg = load_config(args.config, overrides)
    t0 = time.perf_counter()
    m = cfg.model
    model = load_model(args.model_dir, device=m.device, llm_dtype=m.llm_dtype, flow_dtype=m.flow_dtype,
                       hift_dtype=m.hift_dtype, text_frontend=m.text_frontend,
                       nsf_noise=cfg.streaming.nsf_noise)
    load_s = time.perf_counter() - t0
    synth = Synthesizer(model, TorchLMBackend(model.llm), cfg)
    try:
        t1 = time.perf_counter()
        voice = synth.voice_from_audio(args.prompt_wav, args.prompt_text)
        frontend_s = time.perf_counter() - t1
        req = SynthesisRequest(text=args.text, voice=voice, mode=args.mode, instruct_text=args.instruct_text,
                               seed=args.seed, speed=args.speed, stream=args.stream)
        parts, chunk_lens, stats = [], [], None
        async for chunk in synth.stream(req):
            parts.append(chunk.samples)
            chunk_lens.append(int(chunk.samples.shape[0]))
            stats = chunk.stats or stats
    finally:
        await synth.aclose()
    audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    Path(args.out).write_bytes(wav_bytes(audio, OUTPUT_SAMPLE_RATE_HZ))
    assert stats is not None
    return {"out": args.out, "checkpoint_counts": model.checkpoint_counts,
            "load_s": round(load_s, 3), "frontend_s": round(frontend_s, 3),
            "ttfa_ms": round(stats.ttfa_ms, 1), "rtf": round(stats.rtf, 3), "audio_s": round(stats.audio_s, 3),
            "n_tokens": stats.n_tokens, "tokens_per_s": round(stats.tokens_per_s, 1),
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
