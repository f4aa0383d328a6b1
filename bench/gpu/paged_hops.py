"""Paged incremental hops on a GPU (app/model/flow/incremental/packed.py, paged*.py), next to the graphed re-solve.

Per dtype (fp32, fp16), hop (the first hop from a voice prefix: 100 new frames; a mid hop: the 3rd,
200 new frames) and stream count (1 / 4 / 16, each stream its own voice and tokens): ms per call of
the packed solve alone (streams one after another, eager), batched (one eager packed call), graphed
(the packed bucket's CUDA graph, captured before timing, replayed) and the re-solve of the same calls
with the estimator's CUDA graphs; max |diff| graphed vs eager and
eager vs the re-solve; kernels per hop (torch profiler: device kernels and launch calls); the streams'
encoder passes alone (one batched pass, eager and replayed from its bucket's CUDA graph, with max |diff| of
their mu, and one stream at a time); pool bytes per frame and
per stream; the shared prefix's reference counts; with --profile, the top kernels of the most streams'
graphed packed solve and of their re-solve.

    python3 -m bench.gpu.paged_hops out/paged_hops.json                       # full random flow, H200
    python3 -m bench.gpu.paged_hops /tmp/x.json --size tiny --device cpu --streams 1,2 --dtypes float32

Timed calls are encoder pass + solve without the commit (lengths stay; the solve rewrites the same
positions and tail slots, so every repetition does the same work); exactness compares the first call
of each kind from the same saved tail slots.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import Tensor

from app.config import StreamingConfig
from app.model.flow import CausalFlow
from app.model.flow.graphs import EstimatorGraphs
from app.model.flow.incremental.paged import KVPool, bytes_per_frame
from app.model.flow.incremental.paged_graphs import PagedGraphs
from app.model.flow.incremental.paged_solve import solve_calls
from app.model.flow.incremental.state import build_voice_prefix, prepare_hop, prepare_hops
from app.model.flow_calls import FlowItem, FlowPrompt, flow_batch
from app.model.hparams import load_hparams
from app.model.random import SIZES
from app.model.random.init import randomize
from app.model.random.tokenizer_files import write_qwen_config
from app.model.random.yaml_template import render_cosyvoice2_yaml
from app.model.token2wav import Token2WavStream
from bench.gpu.timing import kernels, timed, top_kernels


def at_hop(s: Token2WavStream, tok: Tensor, which: str) -> tuple:
    """(stream, tokens, plan) at its first hop ("first"), or at its 3rd (a 100-token mid hop) after running
    the two before it."""
    for _ in range(0 if which == "first" else 2):
        plan = s.next_plan(tok.shape[1], lm_finished=False)
        s.flow_mel(tok, plan)
        s.advance(plan)
    return s, tok, s.next_plan(tok.shape[1], lm_finished=False)


def build_flow(size: str, device: str, dtype: torch.dtype, *, weights: bool = True) -> CausalFlow:
    """The `size` flow (app/model/random), random weights (seed 0); weights=False: on the meta device."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "cosyvoice2.yaml").write_text(render_cosyvoice2_yaml(SIZES[size]), encoding="utf-8")
        write_qwen_config(d / "CosyVoice-BlankEN", SIZES[size])
        hp = load_hparams(d)
    if not weights:
        with torch.device("meta"):
            return CausalFlow(hp.flow).to(dtype)
    flow = CausalFlow(hp.flow).eval()
    randomize(flow, torch.Generator().manual_seed(0))
    return flow.to(device, dtype)


def run_dtype(args, dtype: torch.dtype, device: torch.device, partial: list) -> dict:
    t0 = time.perf_counter()
    flow = build_flow(args.size, args.device, dtype)
    dims = flow.dims
    counts = [int(s) for s in args.streams.split(",")]
    n_voices = max(counts)
    pool = KVPool(flow, n_blocks=args.blocks)
    gen = torch.Generator().manual_seed(1)
    P0 = 119
    voices = []
    for i in range(n_voices):
        P = P0 - 4 * i
        tok = torch.randint(0, dims.vocab_size, (1, P), generator=gen)
        voices.append((FlowPrompt(tok.to(device), torch.randn(1, 2 * P, 80, generator=gen).to(device),
                                  torch.randn(1, 192, generator=gen).to(device)),
                       torch.randint(0, dims.vocab_size, (1, 400), generator=gen).to(device)))
    prefixes = [build_voice_prefix(flow, p.tokens, p.mel, p.embedding, pool=pool) for p, _ in voices]
    graphs = PagedGraphs(flow, pool, rows=(1, 4, 16), frames=(100, 200), key_blocks=(8, 12, 16))
    graphs.encoder.capture()  # every encoder bucket (18 small graphs), as the engine's start-up
    resolve_graphs = EstimatorGraphs(flow.decoder["estimator"], bucket_frames=64) if device.type == "cuda" else None
    out: dict = {"dtype": str(dtype).removeprefix("torch."), "pool_blocks": pool.n_blocks,
                 "block_bytes": pool.block_bytes, "bytes_per_frame": bytes_per_frame(flow),
                 "tail_slot_bytes": pool.tail_bytes, "prefix_blocks": len(prefixes[0].state.est.table), "rows": []}

    def stream(i: int, which: str) -> tuple:
        p, tok = voices[i]
        s = Token2WavStream(flow, None, p, StreamingConfig(), stream=True, incremental=True,
                            voice_prefix=prefixes[i], flow_pool=pool)
        return at_hop(s, tok, which)

    for which in ("first", "mid"):
        for B in counts:
            jobs = [stream(i, which) for i in range(B)]

            def hops(jobs=jobs, g=None):  # one encoder pass for every stream, as served (g: its graphs)
                return prepare_hops(flow, [s.flow_state for s, _, _ in jobs],
                                    [tok[:, : plan.n_tokens] for _, tok, plan in jobs], finalize=[False] * len(jobs),
                                    token_offsets=[plan.token_offset for _, _, plan in jobs], graphs=g)

            def hops_graphed(hops=hops):
                return hops(g=graphs.encoder)

            def hops_one_by_one(jobs=jobs):  # each stream's encoder pass on its own (before)
                return [prepare_hop(flow, s.flow_state, tok[:, : plan.n_tokens], finalize=False,
                                    token_offset=plan.token_offset) for s, tok, plan in jobs]

            def solve(hs, g=None):
                return solve_calls(flow, [h.est_call for h in hs], [h.mu for h in hs], [h.state.spks for h in hs],
                                   [h.cond for h in hs], g)

            def alone(hops=hops, solve=solve):
                return [solve([h])[0] for h in hops()]

            def batched(hops=hops, solve=solve):
                return solve(hops())

            def graphed(hops=hops, solve=solve):
                return solve(hops(), graphs)

            items = [FlowItem(tok[:, : plan.n_tokens], s.prompt, True, False, plan.token_offset)
                     for s, tok, plan in jobs]

            def resolve(items=items):
                return flow_batch(flow, items, graphs=resolve_graphs)

            with torch.inference_mode():
                hs = hops()
                calls = [h.est_call for h in hs]
                Bf = pool.block_frames
                N = max(c.end - c.start for c in calls)
                Nb = next(n for n in graphs.frames if n >= N)
                nb = next(k for k in graphs.key_blocks if k * Bf >= max(c.end for c in calls))
                r = next(r for r in graphs.rows if r >= B)
                key = (r, r * Nb, r * nb * Bf)  # the packed bucket the engine's warm-up captures for these
                t_cap, capture_error = time.perf_counter(), None
                try:
                    graphs.capture([key])  # before any timed call: what the engine does at start-up
                except Exception as e:  # recorded; the graphed column then runs eagerly (a miss)
                    capture_error = repr(e)[:300]
                capture_s = time.perf_counter() - t_cap
                mu_diff = max(float((x.mu - y.mu).abs().max()) for x, y in zip(hs, hops_graphed(), strict=True))
                saved = pool.tails.clone()
                eager = batched()
                pool.tails.copy_(saved)
                replay = graphed() if graphs.available(pool) else eager
                pool.tails.copy_(saved)
                ref = resolve()
                skip = [2 * (s.n_prompt + plan.token_offset) - h.est_call.start for (s, _, plan), h in zip(jobs, hs,
                                                                                                        strict=True)]
                row = {"dtype": out["dtype"], "hop": which, "streams": B, "bucket": key,
                       "capture_s": round(capture_s, 2), "capture_error": capture_error,
                       "new_frames": [c.end - c.start for c in calls], "keys": [c.end for c in calls],
                       "max_abs_diff_graphed_vs_eager": max(float((x - y).abs().max())
                                                            for x, y in zip(replay, eager, strict=True)),
                       "max_abs_diff_eager_vs_resolve": max(float((x[:, :, k:] - r).abs().max())
                                                            for x, r, k in zip(eager, ref, skip, strict=True)),
                       "mel_rms": float(torch.cat([x.flatten() for x in eager]).pow(2).mean().sqrt()),
                       "alone_ms": round(timed(alone, args.reps if B < 16 else 1, device), 2),
                       "batched_ms": round(timed(batched, args.reps, device), 2),
                       "graphed_ms": round(timed(graphed, args.reps, device), 2) if graphs.available(pool) else None,
                       "resolve_graphs_ms": round(timed(resolve, args.reps, device), 2),
                       "encoder_passes_ms": round(timed(hops, args.reps, device), 2),  # one pass, all streams
                       "encoder_graphed_ms": round(timed(hops_graphed, args.reps, device), 2),
                       "max_abs_diff_encoder_graphed_vs_eager": mu_diff, "encoder_graphs": graphs.encoder.facts,
                       "encoder_one_by_one_ms": round(timed(hops_one_by_one, args.reps, device), 2),
                       "pool_used_blocks": pool.used_blocks,
                       "state_gb_per_stream": round(sum(s.flow_state.nbytes for s, _, _ in jobs) / B / 1e9, 3),
                       "prefix_block_refcount": pool.refcount(prefixes[0].state.est.table[0]),
                       "graph_replays": graphs.replays, "graph_misses": graphs.misses}
                if B == 1:
                    row["kernels_paged_eager"] = kernels(batched, device)
                    row["kernels_paged_graphed"] = kernels(graphed, device)
                    row["kernels_resolve_graphs"] = kernels(resolve, device)
                if args.profile and max(counts) == B:  # where the device time goes, packed vs re-solve
                    row["profile_graphed"] = top_kernels(graphed, device)
                    row["profile_resolve"] = top_kernels(resolve, device)
            if device.type == "cuda":
                row["max_allocated_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
            out["rows"].append(row)
            partial.append(row)
            print(json.dumps(row), flush=True)
            args.save()
            for s, _, _ in jobs:
                s.drop_flow_state()
    out["graphs_kept"] = len(graphs.buckets)
    out["pool_used_after_streams"] = pool.used_blocks  # the voices' prefixes only
    for p in prefixes:
        p.release()
    out["pool_used_after_prefixes_released"] = pool.used_blocks
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--size", default="full")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="float32,float16")
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--blocks", type=int, default=240)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="top kernels of the most streams, packed vs re-solve")
    args = ap.parse_args()
    device = torch.device(args.device)
    report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "size": args.size, "prompt_tokens": 119, "runs": []}
    partial: list = []

    def save() -> None:  # after every row: a run cut short still reports what it measured
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report | {"partial_rows": partial}, indent=1) + "\n")

    args.save = save
    for name in args.dtypes.split(","):
        report["runs"].append(run_dtype(args, getattr(torch, name), device, partial))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()


if __name__ == "__main__":
    sys.exit(main())
