"""The one owner of token->wave (flow + HiFT) compute: worker threads that run the most urgent chunk first.
Design notes: docs/design.md."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from app.engine.call_sizing import CallBudget, CallCost, size_call

T = TypeVar("T")


def _resolve(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():  # the awaiting request was cancelled meanwhile
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def finish_each(finishes: list[Callable[[Any, float], Any]], outs: list[Any],
                flow_s: float) -> Iterator[tuple[int, Any, BaseException | None]]:
    """The default finish_batch: each job's `finish(out, flow_s)` alone, as (index, result, error)."""
    for i, (finish, out) in enumerate(zip(finishes, outs, strict=True)):
        try:
            yield i, finish(out, flow_s), None
        except Exception as e:  # fails this job alone
            yield i, None, e


@dataclass(order=True)
class _Job:
    deadline: float
    seq: int
    item: Any = field(compare=False)  # a flow job's input (has .batch_key), for flow_fn; None: a plain job
    finish: Callable[..., Any] = field(compare=False)  # (flow output, flow wall s) -> result; a plain job's: () -> it
    fut: asyncio.Future = field(compare=False)  # of the awaiting request's loop
    on_worker: Callable[[int], None] | None = field(compare=False, default=None)  # told the worker that takes it
    first: bool = field(compare=False, default=False)  # its request's first chunk (app/engine/call_sizing.py)

    @property
    def frames(self) -> int:  # mel frames its flow call computes (the call's cost grows with their sum)
        return getattr(self.item, "work_frames", 1)


class Token2WavScheduler:
    """`await run(fn, ...)` / `await run_flow(item, finish, ...)` on worker threads, earliest deadline first;
    a flow call takes the due jobs of its batch key that `size_call` lets join the most urgent one (`budget`;
    `clock`: time.perf_counter, the deadlines' clock)."""

    def __init__(self, n_workers: int = 1, device: torch.device | str = "cpu", *,
                 flow_fn: Callable[[list[Any]], list[Any]] | None = None, max_batch: int = 1,
                 finish_batch: Callable[[list[Any], list[Any], float], Iterator[tuple[int, Any, BaseException | None]]]
                 | None = None, budget: CallBudget | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.n_workers, self.max_batch, self.flow_fn = n_workers, max_batch, flow_fn
        self.budget, self.clock = budget or CallBudget(0.0, 0.0), clock
        self.cost = CallCost()  # seconds per call (flow + its HiFT), learned from the calls run
        self.finish_batch = finish_batch or finish_each  # a flow call's finishes: (finishes, outs, flow_s) -> results
        self.device = torch.device(device)
        # one CUDA stream per worker (the default stream for a single worker): workers overlap on the GPU;
        # made here so that warm-up can capture each worker's CUDA graphs before any job runs
        self.streams = [torch.cuda.Stream(self.device) if self.device.type == "cuda" and n_workers > 1 else None
                        for _ in range(n_workers)]
        self._heaps: list[list[_Job]] = [[] for _ in range(n_workers)]
        self._shared: list[_Job] = []  # jobs without a key: any worker
        self._cv = threading.Condition()
        self._seq = itertools.count()  # FIFO among equal deadlines
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.batch_sizes: dict[int, int] = {}  # flow calls by batch size (facts for the panels/bench)

    async def run(self, fn: Callable[[], T], *, deadline: float, key: int | None = 0) -> T:
        """`fn()` on worker `key % n_workers` (None: the first free one); `deadline` in time.perf_counter()
        seconds (smaller = sooner)."""
        return await self.run_flow(None, fn, deadline=deadline, key=key)

    async def run_flow(self, item: Any, finish: Callable[[Any, float], T], *, deadline: float, key: int | None = 0,
                       on_worker: Callable[[int], None] | None = None, first: bool = False) -> T:
        """`finish(flow_fn([item, ...])[i], flow wall s)`, the flow call possibly shared with other jobs; with
        `key` None on the first free worker, `on_worker(w)` called (on that worker) before it runs; `first`: the
        request's first chunk (its call is kept small)."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the token2wav scheduler is shut down")
            if not self._threads:  # the first job starts the workers
                self._threads = [threading.Thread(target=self._work, args=(w,), name=f"token2wav-{w}", daemon=True)
                                 for w in range(self.n_workers)]
                for t in self._threads:
                    t.start()
            heapq.heappush(self._shared if key is None else self._heaps[key % self.n_workers],
                           _Job(deadline, next(self._seq), item, finish, fut, on_worker, first))
            self._cv.notify_all()
        return await fut

    def facts(self) -> dict[str, Any]:
        """How calls are sized (ms; 0 = not sized), the learned cost of a 100-frame call, calls by rows."""
        cost = self.cost.predict(100)
        return {"first_call_ms": self.budget.first_call_s * 1e3, "max_call_ms": self.budget.max_call_s * 1e3,
                "ms_per_100_frames": None if cost is None else round(cost * 1e3, 1), "by_rows": dict(self.batch_sizes)}

    def queued(self) -> int:
        with self._cv:
            return sum(len(h) for h in self._heaps) + len(self._shared)

    def _ready(self, w: int) -> bool:  # worker `w` has a job to take (lock held)
        return bool(self._heaps[w] or self._shared)

    def _take(self, w: int) -> list[_Job]:
        """The most urgent job for worker `w` (its own or a shared one), plus the flow jobs of either queue that
        can share its call; each shared job taken is told it runs on `w` (lock held)."""
        own, shared = self._heaps[w], self._shared
        job = heapq.heappop(own if own and (not shared or own[0] < shared[0]) else shared)
        jobs = [job]
        if job.item is not None and self.max_batch > 1:
            mates = sorted(j for heap in (own, shared) for j in heap if j.item is not None
                           and j.item.batch_key == job.item.batch_key and not j.fut.done())
            mates = size_call(job, mates, self.clock(), self.cost, self.budget, self.max_batch)
            if mates:
                taken = {id(j) for j in mates}
                for heap in (own, shared):
                    heap[:] = [j for j in heap if id(j) not in taken]
                    heapq.heapify(heap)
            jobs += mates
        for j in jobs:
            if j.on_worker is not None:
                j.on_worker(w)
        return jobs

    def _work(self, w: int) -> None:
        stream = self.streams[w]
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            while True:
                with self._cv:
                    while not self._ready(w) and not self._closed:
                        self._cv.wait()
                    if not self._ready(w):
                        return  # closed and drained
                    jobs = self._take(w)
                jobs = [j for j in jobs if not j.fut.done()]  # cancelled while queued: skip the work
                if jobs and jobs[0].item is None:  # a plain job: its result or error to the awaiting request
                    try:
                        self._hand_back(jobs[0], jobs[0].finish(), None)
                    except BaseException as e:
                        self._hand_back(jobs[0], None, e)
                elif jobs:
                    self._flow_call(jobs)

    def _flow_call(self, jobs: list[_Job]) -> None:
        """One flow call for `jobs`, then their finishes together through finish_batch; the whole call's seconds
        teach `cost`."""
        t0 = time.perf_counter()
        try:
            try:
                outs = self.flow_fn([j.item for j in jobs])
                if self.device.type == "cuda":  # flow_s is the call's GPU time too: a replayed paged hop
                    torch.cuda.current_stream(self.device).synchronize()  # returns before its kernels ran
            except BaseException as e:  # every job of the call gets the error
                for j in jobs:
                    self._hand_back(j, None, e)
                return
            flow_s = time.perf_counter() - t0
            self.batch_sizes[len(jobs)] = self.batch_sizes.get(len(jobs), 0) + 1
            good = []
            for j, out in zip(jobs, outs, strict=True):
                if isinstance(out, BaseException):  # an error output fails its job alone
                    self._hand_back(j, None, out)
                else:
                    good.append((j, out))
            if not good:
                return
            # a job finish_batch never answered gets its error (or a bug report)
            left, error = dict(enumerate(j for j, _ in good)), None
            try:
                for i, result, err in self.finish_batch([j.finish for j, _ in good], [o for _, o in good], flow_s):
                    self._hand_back(left.pop(i), result, err)
            except BaseException as e:  # handed to every job still waiting
                error = e
            for j in left.values():
                self._hand_back(j, None, error or RuntimeError("finish_batch returned no result for this job"))
        finally:
            self.cost.observe(sum(j.frames for j in jobs), time.perf_counter() - t0)

    def _hand_back(self, job: _Job, result: Any, error: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            job.fut.get_loop().call_soon_threadsafe(_resolve, job.fut, result, error)

    def shutdown(self) -> None:
        """Finish queued jobs, then stop the threads."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()
