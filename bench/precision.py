"""Measure what each flow / vocoder precision costs against fp32, on one utterance.

    python -m bench.precision --model-dir D [--device cuda] [--out report.json]

Speech tokens come from the reference LM once (fixed seed); then token->wave runs with every
(flow dtype, HiFT dtype) pair, deterministic NSF source, and is compared with fp32/fp32: the
flow mel (max abs) and the waveform (max abs, RMS, and SNR in dB against the fp32 waveform).
Prints a table and writes the JSON report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path

import torch

from app.config import StreamingConfig, load_config
from app.engine.lm_backend import TorchLMBackend
from app.engine.pipeline import Synthesizer
from app.engine.requests import SynthesisRequest
from app.model.loader import load_model
from app.model.token2wav import Token2WavStream

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TEXT = "Hello there, how are you today? This sentence measures numerical precision."
PROMPT_WAV = Path(__file__).resolve().parents[1] / "assets" / "prompt_en.wav"
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog near the quiet river bank."


def _tokens(model_dir: str, device: str) -> tuple[torch.Tensor, object]:
    cfg = load_config(overrides={"model.device": device})
    model = load_model(model_dir, device=device, nsf_noise=False)
    synth = Synthesizer(model, TorchLMBackend(model.llm), cfg)
    voice = model.frontend.voice_from_audio(PROMPT_WAV, PROMPT_TEXT)
    req = SynthesisRequest(text=TEXT, voice=voice, seed=1, stream=False)
    lm_req = synth.lm_request(req, synth.model.frontend.split_text(TEXT)[0], 0)

    async def collect() -> list[int]:
        out: list[int] = []
        async for new in synth.lm.stream(lm_req):
            out.extend(new)
        await synth.aclose()
        return out

    return torch.tensor([asyncio.run(collect())]), voice


def measure(model_dir: str, device: str = "cpu") -> dict:
    tokens, voice = _tokens(model_dir, device)
    results, ref_mel, ref_wav = [], None, None
    for flow_dt in DTYPES:
        for hift_dt in DTYPES:
            model = load_model(model_dir, device=device, flow_dtype=flow_dt, hift_dtype=hift_dt, nsf_noise=False)
            s = Token2WavStream(model.flow, model.hift, voice.flow_prompt(model.device), StreamingConfig(),
                                stream=False)
            plan = s.next_plan(tokens.shape[1], lm_finished=True)
            t0 = time.perf_counter()
            mel = s.flow_mel(tokens.to(model.device), plan)
            wav = s.vocode(mel, plan).float().cpu()
            seconds = time.perf_counter() - t0
            mel = mel.float().cpu()
            if ref_mel is None:
                ref_mel, ref_wav = mel, wav
            d = wav - ref_wav
            rms = d.pow(2).mean().sqrt().item()
            snr = 10 * math.log10(ref_wav.pow(2).mean().item() / max(rms**2, 1e-30))
            results.append({"flow_dtype": flow_dt, "hift_dtype": hift_dt,
                            "mel_max_abs": (mel - ref_mel).abs().max().item(),
                            "wav_max_abs": d.abs().max().item(), "wav_rms": rms, "wav_snr_db": round(snr, 1),
                            "token2wav_s": round(seconds, 3)})
    return {"model_dir": str(model_dir), "device": device, "n_tokens": int(tokens.shape[1]),
            "signal_rms": ref_wav.pow(2).mean().sqrt().item(), "results": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.precision", description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    report = measure(args.model_dir, args.device)
    print(f"{report['n_tokens']} tokens, fp32 signal RMS {report['signal_rms']:.4f}, device {args.device}")
    print("| flow | HiFT | mel max abs | wav max abs | wav RMS | SNR dB | token2wav s |")
    print("|---|---|---|---|---|---|---|")
    for r in report["results"]:
        print(f"| {r['flow_dtype']} | {r['hift_dtype']} | {r['mel_max_abs']:.2e} | {r['wav_max_abs']:.2e} | "
              f"{r['wav_rms']:.2e} | {r['wav_snr_db']} | {r['token2wav_s']} |")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
