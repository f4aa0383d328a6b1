"""The classic memory experiment: KV-cache capacity and memory in use as the engine's sizes vary.

    python -m bench memory --model-dir DIR [--config F] [--set k=v ...]
        [--max-model-len 1024,2048,4096] [--gpu-util 0.1,0.15,0.3] [--cpu-kv-gib 1,2,4]
        [--out mem.json] [--png mem.png]

For each (max_model_len, knob value) the vLLM backend starts alone (`VLLMBackend.start`: the LM
export, cached, then the engine; no flow, vocoder or frontend), is measured, and is closed before
the next. The knob is `vllm.gpu_memory_utilization` on a GPU (a share of the whole card that vLLM
fills with weights, activations and KV cache) and `vllm.cpu_kvcache_space_gib` on a CPU (GiB of KV
cache, VLLM_CPU_KVCACHE_SPACE); the report names it. Per row: KV-cache capacity in tokens
(num_gpu_blocks x block_size, as vLLM reports it), how many requests of the full max_model_len fit
at once (capacity // max_model_len), whole-device memory used (GPU) and the engine process's share,
RSS of this process and the engine's (CPU), and the engine start seconds.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from typing import Any

from bench import report as rep

COLUMNS = ("max_model_len", "knob_value", "kv_cache_tokens", "max_full_len_requests", "device_used_gb",
           "engine_gpu_gb", "rss_gb", "engine_start_s", "error")
GB, MIB = 1e9, 1024 * 1024


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def add_parser(sub: Any) -> None:
    m = sub.add_parser("memory", help="KV-cache capacity and memory against max_model_len and the memory knob")
    m.add_argument("--model-dir", required=True)
    m.add_argument("--config", help="override file (default as app.py: cpu.toml without CUDA)")
    m.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (TOML value)")
    m.add_argument("--max-model-len", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048, 4096])
    m.add_argument("--gpu-util", type=_floats, default=[0.1, 0.15, 0.3], help="GPU: vllm.gpu_memory_utilization")
    m.add_argument("--cpu-kv-gib", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4],
                   help="CPU: vllm.cpu_kvcache_space_gib")
    m.add_argument("--out", help="JSON report")
    m.add_argument("--png", help="PNG plot (needs matplotlib)")


def nvidia_smi() -> tuple[float | None, dict[int, float]]:
    """(device used MiB, {pid: MiB}) from nvidia-smi: the fallback where NVML's Python binding is missing."""
    def q(args: list[str]) -> list[str]:
        try:
            out = subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True,
                                 text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return []
        return [ln for ln in out.splitlines() if ln.strip()]

    used = q(["--query-gpu=memory.used"])
    procs = {int(p.split(",")[0]): float(p.split(",")[1]) for p in q(["--query-compute-apps=pid,used_memory"])}
    return (float(used[0]) if used else None), procs


def measure(probe: Any, backend: Any, gpu: bool) -> dict[str, float | None]:
    """Device memory used (whole card), the engine processes' GPU memory, RSS of this process tree (GB)."""
    sample = probe.sample(backend)
    used_mib = (sample.get("device") or {}).get("used_mib")
    per_pid = {p["pid"]: p["gpu_mib"] for p in sample["processes"] if p.get("gpu_mib") is not None}
    if gpu and used_mib is None:
        used_mib, per_pid = nvidia_smi()
    mine = {p["pid"] for p in sample["processes"]}  # this process and its children (the engine)
    engine = sum(mib for pid, mib in per_pid.items() if pid in mine) if per_pid else None
    return {"device_used_gb": round(used_mib * MIB / GB, 3) if used_mib is not None else None,
            "engine_gpu_gb": round(engine * MIB / GB, 3) if engine is not None else None,
            "rss_gb": round(sample["cpu"]["rss_mib"] * MIB / GB, 3)}


async def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    import torch

    from app.cli import config_path, parse_sets
    from app.config import load_config
    from app.engine.vllm_backend import EngineStartError, VLLMBackend
    from app.service.resources import ResourceProbe, kv_cache_tokens

    gpu = torch.cuda.is_available()
    knob, values = ("vllm.gpu_memory_utilization", args.gpu_util) if gpu else ("vllm.cpu_kvcache_space_gib",
                                                                                args.cpu_kv_gib)
    path, overrides = config_path(args.config), parse_sets(args.set)
    probe = ResourceProbe()
    report: dict[str, Any] = {**rep.run_header("memory", argv), "gpu": gpu, "knob": knob,
                              "knob_note": ("share of the whole GPU (weights + activations + KV cache)" if gpu else
                                            "CPU: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE); "
                                            "gpu_memory_utilization does not apply"),
                              "model_dir": args.model_dir, "config": str(path) if path else None, "sets": args.set,
                              "baseline": measure(probe, None, gpu), "rows": []}
    for max_len in args.max_model_len:
        for value in values:
            # the share only sizes the KV cache when no fixed size is set
            fixed = {"vllm.kv_cache_gib": 0.0} if gpu else {}
            cfg = load_config(path, {**overrides, **fixed, "vllm.max_model_len": max_len, knob: value})
            row: dict[str, Any] = {"max_model_len": max_len, "knob_value": value}
            t0 = time.perf_counter()
            try:
                backend = await VLLMBackend.start(cfg, args.model_dir)
            except EngineStartError as e:
                row["error"] = str(e).splitlines()[0][:300]
                report["rows"].append(row)
                print("BENCH_MEMORY", row, flush=True)
                continue
            try:
                cache = backend.engine.vllm_config.cache_config
                tokens = kv_cache_tokens(backend)
                row.update(kv_cache_tokens=tokens, max_full_len_requests=tokens // max_len if tokens else None,
                           num_blocks=cache.num_gpu_blocks, block_size=cache.block_size, **measure(probe, backend, gpu),
                           engine_start_s=round(backend.start_s, 2), start_s=round(time.perf_counter() - t0, 2),
                           facts=backend.facts())
            finally:
                await backend.aclose()
            report["rows"].append(row)
            print("BENCH_MEMORY", {k: row.get(k) for k in COLUMNS}, flush=True)
    return report
