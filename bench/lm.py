"""Speech-LM benchmark: time to first token and inter-token latency at several concurrencies.

    python -m bench.lm --model-dir D [--config configs/x.toml] [--set vllm.KEY=VALUE ...] [--conc 1,16,64]
        [--tokens 300] [--prompt-tokens 150] [--text-tokens 20] [--reps 2] [--out report.json]
        [--voice-prefix N] [--profile-dir DIR]

Each request is a zero-shot-shaped LM prompt (sos, random text ids, task_id, random prompt speech
tokens) built with the model's own embedding tables, and produces exactly `--tokens` speech tokens
(fixed-length mode: eos ignored, as random-weight models need). A level of concurrency C starts C
requests at once and waits for all of them (after a short warm-up at that size). TTFT = first
token - submit; ITL = (last - first token time) / (tokens - 1). GPU memory from nvidia-smi.
`--voice-prefix N`: every request speaks with one saved voice (the same N prompt-text ids and the same
prompt speech tokens; only the text to speak differs), as a voice's repeat users do: what vLLM's prefix
cache can reuse. `--profile-dir DIR` (vLLM engines): a torch profile of the engine process over one more
1-stream request (vLLM's profiler; with VLLM_CUSTOM_SCOPES_FOR_PROFILING=1 its steps are annotated).
Each level also records the event loop's lag (a 5 ms timer's
lateness: the GIL and the loop's own work) and, with psutil, the CPU seconds per wall second of the
loop's thread and of the whole process.
Prints one JSON line per level and a Markdown table; `--out` writes the whole report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import threading
import time
import zlib
from pathlib import Path

import torch

from app.cli import parse_sets
from app.config import load_config
from app.engine.lm_backend import LMRequest, make_backend
from app.model.llm import build_lm_ids
from app.model.loader import load_model


def gpu_memory() -> dict:
    """Device used/total MiB and per-process MiB (vLLM's engine core is its own process)."""
    def q(args: list[str]) -> str:
        try:
            return subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True,
                                  text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    used_total = q(["--query-gpu=memory.used,memory.total"])
    procs = q(["--query-compute-apps=pid,used_memory"])
    out: dict = {"available": bool(used_total)}
    if used_total:
        used, total = (int(x) for x in used_total.splitlines()[0].split(","))
        out.update(used_mib=used, total_mib=total,
                   processes_mib={p.split(",")[0].strip(): int(p.split(",")[1]) for p in procs.splitlines() if p})
    return out


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


async def one(backend, req: LMRequest) -> tuple[float, list[tuple[float, int]]]:
    t0 = time.perf_counter()
    marks = []
    async for ids in backend.stream(req):
        marks.append((time.perf_counter(), len(ids)))
    return t0, marks


def make_requests(model, cfg, n: int, args, tag: str) -> list[LMRequest]:
    g = torch.Generator().manual_seed(zlib.crc32(tag.encode()))  # hash() is salted per process
    voice = torch.Generator().manual_seed(1)  # --voice-prefix: the same voice in every level and request
    prompt_text = torch.randint(0, 150_000, (args.voice_prefix,), generator=voice)
    prompt_speech = torch.randint(0, 6561, (args.prompt_tokens,), generator=voice)
    reqs = []
    for i in range(n):
        text = torch.randint(0, 150_000, (args.text_tokens,), generator=g)
        speech = torch.randint(0, 6561, (args.prompt_tokens,), generator=g)
        ids = build_lm_ids(text, prompt_text, prompt_speech) if args.voice_prefix else build_lm_ids(text, (), speech)
        reqs.append(LMRequest(request_id=f"{tag}-{i}", prompt_ids=tuple(ids), min_tokens=args.tokens,
                              max_tokens=args.tokens, seed=i, sampling=cfg.sampling, ignore_eos=True))
    return reqs


def thread_cpu_s() -> dict[int, float]:
    """CPU seconds so far of each thread of this process, by native id ({} without psutil)."""
    try:
        import psutil
    except ImportError:
        return {}
    return {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}


async def loop_lag(lags: list[float], period_s: float = 0.005) -> None:
    """How late a `period_s` sleep wakes, until cancelled: the loop's lag (GIL waits, other callbacks)."""
    while True:
        t0 = time.perf_counter()
        await asyncio.sleep(period_s)
        lags.append(time.perf_counter() - t0 - period_s)


def host_share(wall: float, cpu0: dict[int, float], lags: list[float]) -> dict:
    """The host's split over one level: loop lag, CPU per wall second of the loop and of the process."""
    cpu1 = thread_cpu_s()
    def share(tid: int | None) -> float | None:
        return round((cpu1[tid] - cpu0.get(tid, 0.0)) / wall, 3) if tid in cpu1 else None
    out = {"loop_lag_ms_p50": round(1e3 * pct(lags, 50), 3) if lags else None,
           "loop_lag_ms_p95": round(1e3 * pct(lags, 95), 3) if lags else None,
           "loop_lag_ms_max": round(1e3 * max(lags), 3) if lags else None,
           "loop_cpu_share": share(threading.main_thread().native_id),
           "process_cpu_share": round((sum(cpu1.values()) - sum(cpu0.values())) / wall, 3) if cpu1 else None}
    return out


async def level(backend, model, cfg, c: int, args, tag: str) -> dict:
    reqs = make_requests(model, cfg, c, args, tag)
    lags: list[float] = []
    cpu0 = thread_cpu_s()
    probe = asyncio.create_task(loop_lag(lags))
    t0 = time.perf_counter()
    try:
        res = await asyncio.gather(*[one(backend, r) for r in reqs])
    finally:
        wall = time.perf_counter() - t0
        probe.cancel()
    ttft, itl, n_total = [], [], 0
    for ts, marks in res:
        n = sum(k for _, k in marks)
        n_total += n
        ttft.append(marks[0][0] - ts)
        if n > marks[0][1]:
            itl.append((marks[-1][0] - marks[0][0]) / (n - marks[0][1]))
    short = sum(sum(k for _, k in m) != args.tokens for _, m in res)
    return {"concurrency": c, "requests": c, "short_requests": short, "wall_s": round(wall, 3),
            "tokens_per_s": round(n_total / wall, 1),
            "ttft_ms_p50": round(1e3 * pct(ttft, 50), 2), "ttft_ms_p95": round(1e3 * pct(ttft, 95), 2),
            "itl_ms_p50": round(1e3 * pct(itl, 50), 3) if itl else None,
            "itl_ms_mean": round(1e3 * statistics.mean(itl), 3) if itl else None,
            "realtime_x_per_stream": round(40 / (1e3 * statistics.mean(itl)), 1) if itl else None,
            **host_share(wall, cpu0, lags)}


async def profile_one(backend, model, cfg, args) -> None:
    """`--profile-conc` streams (1: one request) under vLLM's torch profiler (the engine process writes its trace)."""
    await backend.engine.start_profile()
    try:
        await level(backend, model, cfg, args.profile_conc, args, "profile")
    finally:
        await backend.engine.stop_profile()


async def run(args) -> dict:
    sets = {"model.device": args.device} if args.device else {}
    cfg = load_config(args.config, sets | parse_sets(args.set))
    model = load_model(args.model_dir, device=cfg.model.device, text_frontend=False)
    t0 = time.perf_counter()
    if args.profile_dir:
        import app.engine.vllm_backend as vllm_backend

        # a small trace, quick to write: the engine process only, 100 steps, no gzip; Python stacks (the host's
        # time by function) only when asked, they make the trace several times larger
        # (run Q's default-option trace of a 300-token request was not written within minutes)
        profiler = {"profiler": "torch", "torch_profiler_dir": str(Path(args.profile_dir).resolve()),
                    "torch_profiler_with_stack": args.profile_stack, "torch_profiler_use_gzip": False,
                    "torch_profiler_dump_cuda_time_total": False, "ignore_frontend": True, "max_iterations": 100}
        # the profiler joins the engine's arguments (the app's start reads engine_kwargs from this module)
        base_kwargs = vllm_backend.engine_kwargs
        vllm_backend.engine_kwargs = lambda *a, **k: base_kwargs(*a, **k) | {"profiler_config": profiler}
        backend = await vllm_backend.VLLMBackend.start(cfg, args.model_dir)
    else:
        backend = await make_backend(cfg, model)
    start_s = time.perf_counter() - t0
    report = {"machine": platform.node(), "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "date": time.strftime("%Y-%m-%d"), "backend": backend.name,
              "engine_start_s": round(start_s, 1),
              "facts": getattr(backend, "facts", dict)(), "tokens": args.tokens,
              "prompt_positions": 2 + args.voice_prefix + args.text_tokens + args.prompt_tokens,
              "voice_prefix": args.voice_prefix, "sets": args.set,
              "mem_after_start": gpu_memory(), "levels": []}
    try:
        for c in args.conc:
            await level(backend, model, cfg, c, argparse.Namespace(**{**vars(args), "tokens": 8}), f"warm{c}")
            for rep in range(args.reps):
                r = await level(backend, model, cfg, c, args, f"c{c}r{rep}")
                r["rep"] = rep
                report["levels"].append(r)
                print("BENCH_LM", json.dumps(r), flush=True)
        report["mem_after_runs"] = gpu_memory()
        if args.profile_dir:
            await profile_one(backend, model, cfg, args)
    finally:
        await backend.aclose()
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lm", description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--config", default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--voice-prefix", type=int, default=0, help="N: one saved voice with N prompt-text ids")
    p.add_argument("--profile-dir", default=None, help="vLLM: profile one level (--profile-conc) into DIR")
    p.add_argument("--profile-stack", action="store_true", help="record Python stacks in the profile")
    p.add_argument("--profile-conc", type=int, default=1, help="streams decoded at once while profiling")
    p.add_argument("--device", default=None)
    p.add_argument("--conc", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--prompt-tokens", type=int, default=150)
    p.add_argument("--text-tokens", type=int, default=20)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    report = asyncio.run(run(args))
    print("| streams | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | tokens/s | x real time per stream | loop lag p95 ms "
          "| CPU/s loop / process |")
    print("|---|---|---|---|---|---|---|---|")
    for r in report["levels"]:
        print(f"| {r['concurrency']} | {r['ttft_ms_p50']} | {r['ttft_ms_p95']} | {r['itl_ms_p50']} | "
              f"{r['tokens_per_s']} | {r['realtime_x_per_stream']} | {r['loop_lag_ms_p95']} | "
              f"{r['loop_cpu_share']} / {r['process_cpu_share']} |")
    print("memory after runs:", json.dumps(report.get("mem_after_runs")))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
