"""How far the chunk-causal final call (`[streaming] final_call = "chunk_causal"`: streaming=True,
finalize=True) is from the exact one (full attention), on a model folder's flow, CPU or CUDA.

For each token count, a 119-token prompt (the bench reference's length; random tokens, mel and
x-vector, seeded) streams with the official schedule; the hops are identical in both modes, so only
the final chunk's frames differ. Reported per case: the final's frames, max |diff| and RMS of the
difference relative to the mel's RMS, over the final chunk ("tail") and over the whole emitted
utterance ("utterance", the measure docs/precision.md gives fp16 as: 1.0 % on the `full` model);
the re-solve (`flow_batch`) and the incremental path (`flow_step`, fp32) must give the same tail.

    python -m bench.final_call_deviation MODEL_DIR [OUT.json] [--tokens 120,250]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from app.config import StreamingConfig
from app.model.flow import CausalFlow
from app.model.flow.incremental.paged import KVPool
from app.model.flow_calls import FlowPrompt
from app.model.hparams import load_hparams
from app.model.loader import load_strict
from app.model.token2wav import Token2WavStream

PROMPT_TOKENS = 119


def stream_mels(flow, prompt: FlowPrompt, tokens: torch.Tensor, streaming: StreamingConfig, *,
                incremental: bool = False) -> list[torch.Tensor]:
    # the incremental state's pool: every frame of prompt + tokens in whole blocks (one chunk each), and a spare
    frames, chunk = 2 * (prompt.tokens.shape[1] + tokens.shape[1]), flow.dims.estimator.static_chunk_size
    pool = KVPool(flow, n_blocks=-(-frames // chunk) + 1) if incremental else None
    s = Token2WavStream(flow, None, prompt, streaming, stream=True, incremental=incremental, flow_pool=pool)
    mels = []
    while not s.done:
        plan = s.next_plan(tokens.shape[1], lm_finished=True)
        mels.append(s.flow_mel(tokens, plan))
        s.advance(plan)
    return mels


def deviation(x: torch.Tensor, ref: torch.Tensor) -> dict:
    d = x.double() - ref.double()
    rms_pct = 100 * d.pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt()
    return {"max_abs": float(d.abs().max()), "rms_pct": float(rms_pct)}


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out", nargs="?")
    ap.add_argument("--tokens", default="120,250")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hp = load_hparams(a.model_dir)
    flow = CausalFlow(hp.flow)
    load_strict(flow, Path(a.model_dir) / "flow.pt")
    flow = flow.to(dev, getattr(torch, a.dtype)).eval()
    gen = torch.Generator().manual_seed(0)
    prompt = FlowPrompt(tokens=torch.randint(0, hp.flow.vocab_size, (1, PROMPT_TOKENS), generator=gen).to(dev),
                        mel=torch.randn(1, 2 * PROMPT_TOKENS, 80, generator=gen).to(dev),
                        embedding=torch.randn(1, 192, generator=gen).to(dev))
    cases = []
    for n in (int(t) for t in a.tokens.split(",")):
        tokens = torch.randint(0, hp.flow.vocab_size, (1, n), generator=gen).to(dev)
        exact = stream_mels(flow, prompt, tokens, StreamingConfig())
        causal = stream_mels(flow, prompt, tokens, StreamingConfig(final_call="chunk_causal"))
        incremental = stream_mels(flow, prompt, tokens, StreamingConfig(final_call="chunk_causal"), incremental=True)
        assert all(torch.equal(x, y) for x, y in zip(exact[:-1], causal[:-1], strict=True)), "hops must not change"
        case = {"tokens": n, "chunks": len(exact), "final_frames": int(exact[-1].shape[2]),
                "tail": deviation(causal[-1], exact[-1]),
                "utterance": deviation(torch.cat(causal, 2), torch.cat(exact, 2)),
                "incremental_vs_resolve_tail_max_abs": float((incremental[-1] - causal[-1]).abs().max()),
                "mel_absmax": float(torch.cat(exact, 2).abs().max())}
        cases.append(case)
        print(json.dumps(case), flush=True)
    report = {"model_dir": a.model_dir, "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": a.dtype, "prompt_tokens": PROMPT_TOKENS, "cases": cases}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
