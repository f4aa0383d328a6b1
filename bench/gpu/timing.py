"""`timed(fn)`: the median wall ms of `fn()` after one warm-up call, the device synchronised around each
call (CUDA kernels are asynchronous); `kernels(fn)`: what one call launches; `top_kernels(fn)`: where its
device time goes. Shared by the bench/gpu/*.py checks."""

from __future__ import annotations

import statistics
import time

import torch


def timed(fn, n: int = 20, device: torch.device | str = "cuda") -> float:
    def sync() -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up (kernel selection, graph capture, allocator)
    sync()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def _profiled(fn, device: torch.device):
    """The torch profiler's record of one `fn()`, the device synchronised around it."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return prof


def kernels(fn, device: torch.device) -> dict:
    """Device kernels and launch calls of one `fn()` (torch profiler)."""
    if device.type != "cuda":
        return {}
    ev = _profiled(fn, device).events()
    return {"device_kernels": sum(1 for e in ev if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
                                  and "memset" not in e.name.lower()),
            "kernel_launches": sum(1 for e in ev if e.name in LAUNCHES),
            "graph_launches": sum(1 for e in ev if e.name in ("cudaGraphLaunch", "cuGraphLaunch"))}


def top_kernels(fn, device: torch.device, n: int = 12) -> dict:
    """One `fn()` under the torch profiler: device ms in total and the n kernels (by name) taking the
    most of it, each [name (80 characters), calls, device ms]."""
    if device.type != "cuda":
        return {}
    rows = [(e.key[:80], e.count, e.self_device_time_total / 1e3) for e in _profiled(fn, device).key_averages()
            if e.self_device_time_total > 0]
    rows.sort(key=lambda r: -r[2])
    return {"device_ms": round(sum(r[2] for r in rows), 2),
            "top": [[k, c, round(ms, 2)] for k, c, ms in rows[:n]]}
