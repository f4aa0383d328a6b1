"""On a GPU: the RAS step as CUDA graphs (app/model/ras_graphs.py) vs the eager call.

    python3 -m bench.gpu.ras_graphs OUT.json

For R rows (1, 4, 16, 64) of CosyVoice2-shaped logits [R, 6592] with mixed settings and histories:
(1) the graphed log P equals the eager one bit for bit, step after step with changing inputs and a
settings change; (2) wall time per step of each, as the engine pays it (host launch time; the GPU
keeps up), over 300 steps, with the settings' and the history's host->device copies included.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from app.model.ras_batch import RASBatch, RASParams, ras_log_probs
from app.model.ras_graphs import RASGraphs

VOCAB, N_VALID = 6592, 6564


def inputs(n_rows: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    logits = torch.full((n_rows, VOCAB), -1e4)
    logits[:, :N_VALID] = torch.randn(n_rows, N_VALID, generator=g) * 3
    params = [RASParams(top_p=(0.5, 0.8, 0.95)[r % 3], min_tokens=(0, 50)[r % 2]) for r in range(n_rows)]
    outs = [torch.randint(0, 30, (r + 3,), generator=g).tolist() for r in range(n_rows)]
    return logits.to(device), params, outs


def main(out_path: str) -> int:
    device = "cuda"
    graphs, report = RASGraphs(), {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": []}
    for n_rows in (1, 4, 16, 64):
        equal = True
        for step in range(6):
            logits, params, outs = inputs(n_rows, 100 * n_rows + step, device)
            if step >= 3:  # the batch's requests change: new settings copied into the graph's buffers
                params = [RASParams(top_p=0.7, top_k=25, min_tokens=3) for _ in params]
            batch = RASBatch.build(params, device, pin=True)
            hist, ban = batch.history(outs, device)
            want = ras_log_probs(logits, batch, hist, ban)
            got = graphs(logits, batch, hist, ban).clone()
            equal &= torch.equal(got, want)
        times, sink = {}, torch.empty_like(logits)
        for name in ("eager", "graph"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(300):
                hist, ban = batch.history(outs, device)
                if name == "eager":
                    sink.copy_(ras_log_probs(logits, batch, hist, ban))
                else:
                    sink.copy_(graphs(logits, batch, hist, ban))
            torch.cuda.synchronize()
            times[f"{name}_ms_per_step"] = round((time.perf_counter() - t0) / 300 * 1e3, 4)
        row = {"rows": n_rows, "bit_equal": bool(equal), **times}
        report["rows"].append(row)
        print(row, flush=True)
    report["stats"] = vars(graphs.stats)
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    return 0 if all(r["bit_equal"] for r in report["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else "ras_graphs.json"))
