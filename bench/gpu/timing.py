"""`timed(fn)`: the median wall ms of `fn()` after one warm-up call, the device synchronised around each
call (CUDA kernels are asynchronous). Shared by the bench/gpu/*.py checks."""

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
