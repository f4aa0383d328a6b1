"""On a CUDA machine: what the flow's speed options cost and give, on a model folder (the `full`
random model for the real FLOPs). Prints one JSON line per measurement and writes a report.

- precision: the flow in float32 (default), float32 with TF32 matmuls, float16 (the official fp16
  mode halves the flow) and bfloat16; per flow call of the official schedule (5 s prompt, 250
  tokens) the graph-replay time and the mel's deviation from float32 (max abs, RMS relative to the
  mel's RMS);
- batching: the same calls for 16 streams at once (rows padded to a power of two, graphs);
- first hop: the emitted mel of `first_hop_tokens = 10, align_first_hop = false` against the
  official schedule (float32), over the whole utterance and over the first chunk's frames.

    [SKIP_PRECISION=1] python3 -m bench.gpu.flow_options /tmp/full out/flow_options.json
"""

import copy
import json
import os
import sys
from pathlib import Path

import torch

from app.config import StreamingConfig
from app.model.flow import CausalFlow
from app.model.flow.graphs import EstimatorGraphs
from app.model.flow_calls import FlowItem, FlowPrompt, flow_batch
from app.model.hparams import load_hparams
from app.model.loader import load_strict
from app.model.token2wav import Token2WavStream
from bench.gpu.timing import timed as median_ms

model_dir, out = sys.argv[1], sys.argv[2]
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run (no graphs captured there)
hp = load_hparams(model_dir)
base = CausalFlow(hp.flow)
load_strict(base, Path(model_dir) / "flow.pt")
base = base.to(DEV).eval()
gen = torch.Generator().manual_seed(0)
P = 119  # the bench reference (assets/prompt_en.wav, 4.75 s): 119 tokens, pad 6 to the chunk edge
prompt = FlowPrompt(tokens=torch.randint(0, hp.flow.vocab_size, (1, P), generator=gen).to(DEV),
                    mel=torch.randn(1, 2 * P, 80, generator=gen).to(DEV),
                    embedding=torch.randn(1, 192, generator=gen).to(DEV))
tokens = torch.randint(0, hp.flow.vocab_size, (1, 250), generator=gen).to(DEV)
SCHEDULE = ((34, True, False, 0), (84, True, False, 31), (184, True, False, 81), (250, False, True, 181))


def timed(fn, n=5) -> float:
    return round(median_ms(fn, n, DEV), 2)


def emit(row: dict, rows: list) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)


def deviation(x: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (x.float() - ref.float())
    return {"max_abs": round(d.abs().max().item(), 5),
            "rel_rms": round((d.pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt()).item(), 6)}


def measure_precision(name: str, rows: list, reference: dict[int, torch.Tensor]) -> None:
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = name == "tf32"
    flow = copy.deepcopy(base).to(torch.float32 if name == "tf32" else getattr(torch, name))
    graphs = EstimatorGraphs(flow.decoder["estimator"], bucket_frames=64, max_graphs=256)
    for n, streaming, finalize, offset in SCHEDULE:
        item = FlowItem(tokens[:, :n], prompt, streaming, finalize, offset)
        mel = flow_batch(flow, [item], graphs)[0]
        reference.setdefault(n, mel)
        row = {"precision": name, "tokens": n, "streaming": streaming,
               "graph_ms_1": timed(lambda item=item: flow_batch(flow, [item], graphs)),
               "graph_ms_16": timed(lambda item=item: flow_batch(flow, [item] * 16, graphs), n=3),
               **deviation(mel, reference[n])}
        batch = flow_batch(flow, [item] * 3, graphs)  # 3 rows padded to 4
        row["batch_vs_single_max_abs"] = max((b - mel).abs().max().item() for b in batch)
        emit(row, rows)
    peak = round(torch.cuda.max_memory_allocated() / 1e9, 2) if DEV == "cuda" else None
    emit({"precision": name, "graphs": graphs.n_graphs, "stats": vars(graphs.stats), "max_memory_allocated_gb": peak},
         rows)


rows: list[dict] = []
reference: dict[int, torch.Tensor] = {}
for name in () if os.environ.get("SKIP_PRECISION") == "1" else ("float32", "tf32", "float16", "bfloat16"):
    measure_precision(name, rows, reference)
    if DEV == "cuda":
        torch.cuda.empty_cache()
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
flow = base


def emitted(streaming: StreamingConfig) -> tuple[torch.Tensor, list[int]]:
    s = Token2WavStream(flow, None, prompt, streaming, stream=True)
    mels, plans = [], []
    while not s.done:
        plan = s.next_plan(tokens.shape[1], lm_finished=True)
        mels.append(s.flow_mel(tokens, plan))
        plans.append(plan.n_tokens)
        s.advance(plan)
    return torch.cat(mels, dim=2), plans


official, official_plans = emitted(StreamingConfig())
small, small_plans = emitted(StreamingConfig(first_hop_tokens=10, align_first_hop=False))
first = 2 * (small_plans[0] - 3)
emit({"first_hop": "10 unaligned vs official", "official_plans": official_plans, "small_plans": small_plans,
      "frames": official.shape[2], "whole": deviation(small, official),
      "first_chunk_frames": first, "first_chunk": deviation(small[:, :, :first], official[:, :, :first])}, rows)
report = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__,
          "model_dir": model_dir, "prompt_tokens": P, "generated_tokens": 250, "bucket_frames": 64, "rows": rows}
Path(out).write_text(json.dumps(report, indent=1))
