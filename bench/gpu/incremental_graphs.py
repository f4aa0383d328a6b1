"""The incremental flow's hops on growable per-stream states (the reference path; the served one is
packed over the pool: bench/gpu/paged_hops.py), on a GPU: exactness (mel max |diff| vs the re-solve)
and ms per call of a first hop and a mid hop at 1 / 4 / 16 streams (alone one after another, and the
re-solve of the same calls batched, CUDA graphs on where the device has them); plus the states' memory
(bytes per frame and per stream: capacity doubling vs the +25 %-in-whole-chunks rule, fp32 and fp16).

    python3 -m bench.gpu.incremental_graphs out/incremental_batch.json                 # full random flow, fp32
    python3 -m bench.gpu.incremental_graphs out/inc_fp16.json --dtype float16
    python3 -m bench.gpu.incremental_graphs /tmp/x.json --size tiny --device cpu --streams 1,2  # CPU smoke run

The flow is built from app/model/random's sizes (no folder written), random weights, seed 0. Streams
get different voices (prompt lengths 119 - 4·i tokens) and tokens, so their committed edges and key
ranges differ. Timed calls are prepare + solve without the commit (the states stay as they were, so
every repetition does the same work). Prints one JSON line per measurement and writes the report.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from app.config import StreamingConfig
from app.model.flow import CausalFlow
from app.model.flow.cache import next_capacity
from app.model.flow.graphs import EstimatorGraphs
from app.model.flow.incremental import FlowState, _solve_new, build_voice_prefix, prepare_hop, state_bytes
from app.model.hparams import load_hparams
from app.model.random import SIZES
from app.model.random.init import randomize
from app.model.random.tokenizer_files import write_qwen_config
from app.model.random.yaml_template import render_cosyvoice2_yaml
from app.model.token2wav import FlowItem, FlowPrompt, Token2WavStream, flow_batch
from bench.gpu.timing import timed


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


def schedule_ends(n_prompt: int, n_tokens: int) -> list[int]:
    """Encoded frames at the end of each streaming hop of the official schedule (`Token2WavStream`)."""
    prompt = FlowPrompt(torch.zeros(1, n_prompt, dtype=torch.long), torch.zeros(1, 2 * n_prompt, 80),
                        torch.zeros(1, 192))
    s, ends = Token2WavStream(None, None, prompt, StreamingConfig(), stream=True), []
    while not s.done:
        plan = s.next_plan(n_tokens, lm_finished=True)
        if plan.streaming:
            ends.append(2 * (n_prompt + plan.n_tokens - 3))
        s.advance(plan)
    return ends


def memory_report(size: str, n_prompt: int) -> dict:
    """Bytes per committed frame (K/V + positions, `state_bytes`) and per stream at the end of a 250- and
    a 1,500-token segment of the official schedule, under capacity doubling and the +25 %-in-chunks rule."""
    out = {}
    for dtype in (torch.float32, torch.float16):
        f = build_flow(size, "meta", dtype, weights=False)
        per_frame = state_bytes(f, 2) / 2
        chunk = f.dims.estimator.static_chunk_size
        row: dict = {"bytes_per_frame": per_frame}
        for n_tokens in (250, 1500):
            ends = schedule_ends(n_prompt, n_tokens)
            for name, growth in (("doubling", 1.0), ("quarter_in_chunks", 0.25)):
                cap = 0
                for e in ends:
                    cap = next_capacity(cap, e, chunk, growth)
                row[f"{n_tokens}_tokens_{name}"] = {
                    "committed_frames": ends[-1], "capacity_frames": cap,
                    "gb_per_stream": round(cap * per_frame / 1e9, 3),
                    "gb_16_streams": round(16 * cap * per_frame / 1e9, 2)}
        out[str(dtype).removeprefix("torch.")] = row
    return out


def measure(flow: CausalFlow, jobs: list, graphs: EstimatorGraphs | None, device: torch.device, reps: int) -> dict:
    """One hop of each stream in `jobs` ((Token2WavStream, tokens, plan) each): alone one after
    another, and the re-solve of the same calls; max |diff| and median ms of each."""
    states: list[FlowState] = [s.flow_state for s, _, _ in jobs]
    flow_items = [FlowItem(tok[:, : plan.n_tokens], s.prompt, True, False, plan.token_offset) for s, tok, plan in jobs]

    def hops():
        return [prepare_hop(flow, st, tok[:, : plan.n_tokens], finalize=False, token_offset=plan.token_offset)
                for st, (_, tok, plan) in zip(states, jobs, strict=True)]

    def alone():
        return [_solve_new(flow, h.est_call, h.mu, h.state.spks, h.cond) for h in hops()]

    def resolve():
        return flow_batch(flow, flow_items, graphs=graphs)

    with torch.inference_mode():
        a, ref = alone(), resolve()
        hs = hops()
        # the incremental calls return every frame from the committed edge; the re-solve from the offset
        skip = [2 * (s.n_prompt + plan.token_offset) - h.est_call.start
                for (s, _, plan), h in zip(jobs, hs, strict=True)]
        row = {"new_frames": [x.shape[2] for x in a], "keys": [h.est_call.end for h in hs],
               "max_abs_diff_alone_vs_resolve": max(float((x[:, :, k:] - r).abs().max())
                                                    for x, r, k in zip(a, ref, skip, strict=True)),
               "mel_rms": float(torch.cat([x.flatten() for x in a]).pow(2).mean().sqrt()),
               "alone_ms": round(timed(alone, reps, device), 2),
               f"resolve_{'graphs' if graphs else 'eager'}_ms": round(timed(resolve, reps, device), 2),
               "state_gb": round(sum(st.nbytes for st in states) / 1e9, 3)}
    if device.type == "cuda":
        row["max_allocated_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--size", default="full", choices=sorted(SIZES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    flow = build_flow(args.size, args.device, dtype)
    dims = flow.dims
    counts = [int(s) for s in args.streams.split(",")]
    gen = torch.Generator().manual_seed(1)
    P0 = 119  # a 4.8 s reference: 119 prompt tokens, 238 mel frames
    report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "size": args.size, "dtype": args.dtype, "prompt_tokens": P0,
                    "memory": memory_report(args.size, P0), "rows": []}
    print(json.dumps({"memory": report["memory"]}), flush=True)
    graphs = EstimatorGraphs(flow.decoder["estimator"], bucket_frames=64) if device.type == "cuda" else None

    def voice(i: int) -> tuple[FlowPrompt, Tensor]:
        P = P0 - 4 * i  # every stream its own prompt length: different edges and key ranges
        tok = torch.randint(0, dims.vocab_size, (1, P), generator=gen)
        prompt = FlowPrompt(tok.to(device), torch.randn(1, 2 * P, 80, generator=gen).to(device),
                            torch.randn(1, 192, generator=gen).to(device))
        return prompt, torch.randint(0, dims.vocab_size, (1, 400), generator=gen).to(device)

    voices = [voice(i) for i in range(max(counts))]
    prefixes = [build_voice_prefix(flow, p.tokens, p.mel, p.embedding) for p, _ in voices]

    def plans(i: int, which: str):
        p, tok = voices[i]
        s = Token2WavStream(flow, None, p, StreamingConfig(), stream=True, incremental=True,
                            voice_prefix=prefixes[i])
        return at_hop(s, tok, which)

    for which in ("first", "mid"):
        for B in counts:
            row = measure(flow, [plans(i, which) for i in range(B)], graphs, device, args.reps)
            row = {"hop": which, "streams": B, **row}
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
