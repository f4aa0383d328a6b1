"""`timed(fn)`: the median wall ms of `fn()` after one warm-up call, the device synchronised around each
call (CUDA kernels are asynchronous); `kernels(fn)`: what one call launches. Shared by the bench/gpu/*.py checks."""

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


def kernels(fn, device: torch.device) -> dict:
    """Device kernels and launch calls of one `fn()` (torch profiler)."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    ev = prof.events()
    return {"device_kernels": sum(1 for e in ev if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
                                  and "memset" not in e.name.lower()),
            "kernel_launches": sum(1 for e in ev if e.name in LAUNCHES),
            "graph_launches": sum(1 for e in ev if e.name in ("cudaGraphLaunch", "cuGraphLaunch"))}
