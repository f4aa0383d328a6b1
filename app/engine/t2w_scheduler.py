"""The one owner of token->wave (flow + HiFT) compute: worker threads that run the most urgent chunk first.

Every stream's chunks are jobs with a deadline: a first chunk's deadline is its request's start
(someone is waiting in silence), a later chunk's is the moment the audio already sent runs out
(first audio + seconds emitted). Each worker pops the job with the earliest deadline, so a new
request's first chunk goes before chunks that still have audio in the listener's buffer, and no
stream is starved (earliest-deadline-first). With several workers, a request always goes to the same
worker (`key`): its per-request tensors (flow/HiFT caches) then live on one CUDA stream, so no
cross-stream synchronisation is needed. Threads start on the first job; `shutdown()` joins them.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def _resolve(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():  # the awaiting request was cancelled meanwhile
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class Token2WavScheduler:
    """`await run(fn, deadline=..., key=...)` runs `fn()` on a worker thread, earliest deadline first."""

    def __init__(self, n_workers: int = 1, device: torch.device | str = "cpu") -> None:
        if n_workers < 1:
            raise ValueError("n_workers must be >= 1")
        self.n_workers = n_workers
        self.device = torch.device(device)
        self._heaps: list[list[tuple]] = [[] for _ in range(n_workers)]
        self._cv = threading.Condition()
        self._seq = itertools.count()  # FIFO among equal deadlines
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.n_done = 0

    def _start(self) -> None:
        for w in range(self.n_workers):
            t = threading.Thread(target=self._work, args=(w,), name=f"token2wav-{w}", daemon=True)
            t.start()
            self._threads.append(t)

    async def run(self, fn: Callable[[], T], *, deadline: float, key: int = 0) -> T:
        """`fn()` on worker `key % n_workers`; `deadline` in time.perf_counter() seconds (smaller = sooner)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the token2wav scheduler is shut down")
            if not self._threads:
                self._start()
            heapq.heappush(self._heaps[key % self.n_workers], (deadline, next(self._seq), fn, fut, loop))
            self._cv.notify_all()
        return await fut

    def queued(self) -> int:
        with self._cv:
            return sum(len(h) for h in self._heaps)

    def _work(self, w: int) -> None:
        use_cuda = self.device.type == "cuda"
        # one CUDA stream per worker (the default stream for a single worker): workers overlap on the GPU
        stream = torch.cuda.Stream(self.device) if use_cuda and self.n_workers > 1 else None
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            while True:
                with self._cv:
                    while not self._heaps[w] and not self._closed:
                        self._cv.wait()
                    if not self._heaps[w]:
                        return  # closed and drained
                    _, _, fn, fut, loop = heapq.heappop(self._heaps[w])
                if fut.done():  # cancelled while queued: skip the work
                    continue
                result, error = None, None
                try:
                    result = fn()
                except BaseException as e:  # handed to the awaiting request
                    error = e
                self.n_done += 1
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(_resolve, fut, result, error)

    def shutdown(self) -> None:
        """Finish queued jobs, then stop the threads."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()
