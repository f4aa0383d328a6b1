"""On a CUDA machine: the flow's ODE solve eagerly vs with CUDA graphs (engine.flow_cuda_graphs) on a
model folder (the `full` random model for the real FLOPs): max |difference| of the mel and ms per
flow call at the chunk lengths of a 10 s utterance with a 5 s prompt. Prints and writes JSON.

    python3 -m bench.gpu.flow_graphs /tmp/full out/flow_graphs.json
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

from app.model.flow import CausalFlow
from app.model.flow.graphs import EstimatorGraphs
from app.model.hparams import load_hparams
from app.model.loader import load_strict
from bench.gpu.timing import timed

model_dir, out = sys.argv[1], sys.argv[2]
if os.environ.get("FLOW_TF32") == "1":  # what TF32 matmuls would give (not a project setting)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
hp = load_hparams(model_dir)
flow = CausalFlow(hp.flow)
load_strict(flow, Path(model_dir) / "flow.pt")
flow = flow.cuda().eval()
gen = torch.Generator().manual_seed(0)
P = 125  # 5 s prompt: 125 tokens, 250 mel frames
prompt_tokens = torch.randint(0, hp.flow.vocab_size, (1, P), generator=gen).cuda()
prompt_mel = torch.randn(1, 2 * P, 80, generator=gen).cuda()
embedding = torch.randn(1, 192, generator=gen).cuda()
tokens = torch.randint(0, hp.flow.vocab_size, (1, 250), generator=gen).cuda()
graphs = EstimatorGraphs(flow.decoder["estimator"], bucket_frames=64)


rows = []
# the official schedule with a 125-token prompt: first chunk 25 (+0 pad) + 3 look-ahead, hops 50, 100, final
for n, streaming, finalize in ((28, True, False), (78, True, False), (178, True, False), (250, False, True)):
    def call(g=None, n=n, streaming=streaming, finalize=finalize):
        return flow.inference(tokens[:, :n], prompt_tokens, prompt_mel, embedding, streaming=streaming,
                              finalize=finalize, graphs=g)
    eager = call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    first = call(graphs)  # captures this length's graph
    torch.cuda.synchronize()
    capture_ms = (time.perf_counter() - t0) * 1e3
    graphed = call(graphs)
    diff = (graphed - eager).abs().max().item()
    rows.append({"tokens": n, "streaming": streaming, "frames": 2 * (P + n - (0 if finalize else 3)),
                 "padded_frames": graphs.padded_length(2 * (P + n - (0 if finalize else 3))),
                 "eager_ms": round(timed(call, 5), 2), "graph_ms": round(timed(lambda: call(graphs), 5), 2),
                 "first_call_with_capture_ms": round(capture_ms, 1), "max_abs_diff": diff,
                 "rms_ref": float(eager.pow(2).mean().sqrt()), "same_as_first": bool(torch.equal(first, graphed))})
    print(json.dumps(rows[-1]), flush=True)
report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model_dir": model_dir,
          "prompt_tokens": P, "bucket_frames": 64, "stats": vars(graphs.stats), "rows": rows,
          "memory_allocated_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2)}
with open(out, "w") as f:
    json.dump(report, f, indent=1)
print(json.dumps({k: v for k, v in report.items() if k != "rows"}))
