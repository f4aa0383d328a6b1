"""On a CUDA machine: the flow's ODE solve (10 Euler steps, the CFG pair as 2 rows per stream) eagerly, with
CUDA graphs (`engine.flow_cuda_graphs`) and with torch.compile (inductor, dynamic shapes) under the graphs, on
the `size` random flow (`full`: the real model's FLOPs). Per solve: ms per call (median), max |diff| against
eager and the mel's RMS, device kernels per call (torch profiler); and the compile time. Solves: one stream
at the lengths of a 10 s utterance's calls after a 5 s prompt (300 / 400 / 600 frames chunk-causal, the
final 750 with full attention), then 4 and 16 streams batched at 300 and 600 frames (what `flow_batch`
makes at 16 streams). First, one estimator evaluation (`evals`: ms, kernels, max |diff| of the graph
against eager) at A = 2 rows x 320 frames and B = 32 x 640, chunk-causal (research/perf_levers.md §1.4's
shapes). Prints each row as JSON and writes the report. `--evals-only` also runs on the CPU.

    python3 -m bench.gpu.flow_graphs out/flow_graphs.json                        # fp32 (the default config)
    python3 -m bench.gpu.flow_graphs out/flow_graphs_fp16.json --dtype float16   # configs/fast.toml's flow
    python3 -m bench.gpu.flow_graphs out/flow_graphs.json --no-compile            # eager and graphs only
    python3 -m bench.gpu.flow_graphs out/est_cpu.json --device cpu --size tiny --evals-only --reps 5
`--reference` adds the evaluation rows of the official-structure forward (same weights): before/after.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

import torch

from app.model.flow.graphs import EstimatorGraphs
from bench.gpu.paged_hops import build_flow
from bench.gpu.timing import kernels, timed

EVALS = [("A", 2, 320), ("B", 32, 640)]  # (shape, rows, frames): one evaluation, chunk-causal
SOLVES = [(1, 300, True), (1, 400, True), (1, 600, True), (1, 750, False),  # (streams, frames, chunk-causal)
          (4, 300, True), (16, 300, True), (4, 600, True), (16, 600, True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--size", default="full")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--evals-only", action="store_true", help="only the per-evaluation rows (CPU too)")
    ap.add_argument("--shapes", default="AB", help="which EVALS shapes to run (A, B or AB)")
    ap.add_argument("--reference", action="store_true",
                    help="also the per-evaluation rows of the official-structure forward (cuDNN convs): before/after")
    ap.add_argument("--no-compile", action="store_true", help="solves eager and graphed only (no inductor rows)")
    args = ap.parse_args()
    if os.environ.get("FLOW_TF32") == "1":  # what TF32 matmuls would give (not a project setting)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    flow = build_flow(args.size, args.device, dtype)
    estimator = flow.decoder["estimator"]
    graphs = EstimatorGraphs(estimator, bucket_frames=64, max_graphs=256)
    evals = eval_rows(estimator, graphs, args, device, dtype)
    if args.reference:  # the same weights through the official structure (tests/estimator_reference.py)
        ref = official_structure(estimator)
        evals += eval_rows(ref, EstimatorGraphs(ref, bucket_frames=64, max_graphs=8), args, device, dtype,
                           "official_structure")
    if args.evals_only:
        write(args, device, None, graphs, None, [], evals)
        return
    compiled = None
    if not args.no_compile:
        fused_estimator = torch.compile(estimator, dynamic=True, fullgraph=True)  # compiled at its first call
        compiled = EstimatorGraphs(fused_estimator, bucket_frames=64, max_graphs=256)
    gen = torch.Generator().manual_seed(0)
    rows, compile_s = [], None
    for streams, frames, streaming in SOLVES:
        mu, cond = (torch.randn(streams, 80, frames, generator=gen).to(device, dtype) for _ in range(2))
        spks = torch.randn(streams, 80, generator=gen).to(device, dtype)
        mask = torch.ones(streams, 1, frames, device=device, dtype=dtype)

        def solve(g=None, mu=mu, mask=mask, spks=spks, cond=cond, streaming=streaming):
            return flow.solve(mu, mask, spks, cond, streaming, g)

        eager = solve()
        graphed = solve(graphs)
        row = {"streams": streams, "frames": frames, "streaming": streaming,
               "eager_ms": round(timed(solve, args.reps, device), 2),
               "graph_ms": round(timed(lambda: solve(graphs), args.reps, device), 2),
               "graph_max_abs_diff": float((graphed - eager).abs().max()),
               "rms_ref": float(eager.pow(2).mean().sqrt()),
               "kernels_eager": kernels(solve, device), "kernels_graph": kernels(lambda: solve(graphs), device)}
        if compiled is not None:
            t0 = time.perf_counter()
            first = solve(compiled)  # the first call compiles (once) and captures this bucket's graph
            first_s = time.perf_counter() - t0
            compile_s = first_s if compile_s is None else compile_s
            fused = solve(compiled)
            row |= {"compiled_graph_ms": round(timed(lambda: solve(compiled), args.reps, device), 2),
                    "first_compiled_call_s": round(first_s, 2),
                    "compiled_max_abs_diff": float((fused - eager).abs().max()),
                    "compiled_replay_equal": bool(torch.equal(first, fused)),
                    "kernels_compiled_graph": kernels(lambda: solve(compiled), device)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        write(args, device, compile_s, graphs, compiled, rows, evals)  # after every row: a time limit keeps what ran


def official_structure(estimator):
    """A callable estimator running tests/estimator_reference.py (the pre-restructure forward)."""
    spec = importlib.util.spec_from_file_location("estimator_reference",
                                                  Path(__file__).parents[2] / "tests" / "estimator_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return lambda *args, streaming: module.reference(estimator, *args, streaming=streaming)


def eval_rows(estimator, graphs: EstimatorGraphs, args, device: torch.device, dtype: torch.dtype,
              variant: str = "restructured") -> list[dict]:
    """One velocity evaluation at the EVALS shapes: eager and (on CUDA) graphed ms, kernels, graph diff."""
    gen, rows = torch.Generator().manual_seed(1), []
    for shape, n_rows, frames in EVALS:
        if shape not in args.shapes:
            continue
        x, mu, cond = (torch.randn(n_rows, 80, frames, generator=gen).to(device, dtype) for _ in range(3))
        spks = torch.randn(n_rows, 80, generator=gen).to(device, dtype)
        mask = torch.ones(n_rows, 1, frames, device=device, dtype=dtype)
        t = torch.full((n_rows,), 0.3, device=device, dtype=dtype)

        @torch.inference_mode()
        def evaluate(g=None, args=(x, mask, mu, t, spks, cond)):
            return g(*args, True) if g is not None else estimator(*args, streaming=True)

        eager = evaluate()
        row = {"variant": variant, "shape": shape, "rows": n_rows, "frames": frames, "dtype": args.dtype,
               "eager_ms": round(timed(evaluate, args.reps, device), 3), "kernels_eager": kernels(evaluate, device),
               "rms_ref": float(eager.float().pow(2).mean().sqrt())}
        if device.type == "cuda":
            graphed = evaluate(graphs).clone()
            row |= {"graph_ms": round(timed(lambda: evaluate(graphs), args.reps, device), 3),
                    "kernels_graph": kernels(lambda: evaluate(graphs), device),
                    "graph_max_abs_diff": float((graphed - eager).abs().max())}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def write(args, device: torch.device, compile_s: float | None, graphs: EstimatorGraphs,
          compiled: EstimatorGraphs | None, rows: list[dict], evals: list[dict]) -> None:
    cuda = device.type == "cuda"
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "size": args.size, "dtype": args.dtype, "bucket_frames": 64,
              "compile_s": None if compile_s is None else round(compile_s, 1), "evals": evals,
              "stats_graph": vars(graphs.stats), "stats_compiled": compiled and vars(compiled.stats), "rows": rows,
              "memory_allocated_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if cuda else None}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
