"""CUDA graphs of one static-shape function per bucket of input shapes, captured at warm-up only and replayed
while serving: the paged hops' solve (paged_graphs.py) and their encoder pass (encoder_graphs.py).
Design notes: docs/model.md.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)


class BucketGraphs:
    """Subclasses give `_static(key)` (a bucket's inputs: an object with `copy_(other)`), `_fn(inputs)` (the
    captured function: a tensor or a tuple of tensors) and may prepare shared state in `_before_capture(keys)`.
    A bucket whose capture fails is left out (its calls run eagerly)."""

    name = "bucket"

    def __init__(self, device: torch.device, *, min_free_bytes: int = 0) -> None:
        """min_free_bytes: no bucket is captured while the device has less free (the serving's own
        allocations come first; the rest run eagerly)."""
        self.device, self.min_free_bytes = device, min_free_bytes
        self._graphs: dict[tuple[int, ...], tuple[torch.cuda.CUDAGraph, Any, tuple[Tensor, ...]]] = {}
        self.lock = threading.Lock()
        # token->wave workers replay on their own CUDA streams: the next caller's stream waits for this event
        # (recorded after the last caller's output clone), else its input copy could overwrite the static
        # buffers while the last replay still reads them
        self._released: torch.cuda.Event | None = None
        self.replays = self.misses = self.capture_failures = self.skipped = 0

    @property
    def buckets(self) -> list[tuple[int, ...]]:
        return sorted(self._graphs)

    @property
    def facts(self) -> dict[str, int]:
        """Graphs kept, replays, captures that failed, calls no bucket held (run eagerly)."""
        return {"kept": len(self._graphs), "replays": self.replays, "capture_failures": self.capture_failures,
                "skipped_low_memory": self.skipped, "eager": self.misses}

    def _static(self, key: tuple[int, ...]) -> Any:
        raise NotImplementedError

    def _fn(self, inputs: Any) -> Tensor | tuple[Tensor, ...]:
        raise NotImplementedError

    def _before_capture(self, keys: list[tuple[int, ...]]) -> None:
        """Shared state the captured functions read, made outside any capture."""

    @torch.inference_mode()
    def _capture(self, keys: list[tuple[int, ...]]) -> int:
        """Captures the buckets not held yet (before serving) -> the number of graphs now held."""
        if self.device.type != "cuda":
            return 0
        self._before_capture(keys)
        mempool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        with self.lock:
            for i, key in enumerate(keys):
                if key in self._graphs:
                    continue
                if self._short_of_memory():
                    self.skipped = len(keys) - i
                    log.warning("%s graphs: %d buckets not captured, less than %.1f GiB free", self.name,
                                self.skipped, self.min_free_bytes / 2**30)
                    break
                inp = self._static(key)
                g = torch.cuda.CUDAGraph()
                try:  # out of memory included (a subclass): that bucket then runs eagerly
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        self._fn(inp)  # warm-up: allocator and kernel choices
                    torch.cuda.current_stream().wait_stream(side)
                    torch.cuda.synchronize(self.device)
                    with torch.cuda.graph(g, pool=mempool):
                        out = self._fn(inp)
                except RuntimeError as e:  # the next capture gets a new pool
                    log.warning("%s graph %s not captured: %s", self.name, key, e)
                    self.capture_failures += 1
                    mempool = torch.cuda.graph_pool_handle()
                    continue
                self._graphs[key] = (g, inp, out if isinstance(out, tuple) else (out,))
            torch.cuda.synchronize(self.device)
        return len(self._graphs)

    def _short_of_memory(self) -> bool:
        """Less than `min_free_bytes` free on the device (the warm-ups' cached blocks given back first)."""
        if not self.min_free_bytes:
            return False
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0] < self.min_free_bytes

    def _replay(self, key: tuple[int, ...], inputs: Any) -> tuple[Tensor, ...]:
        """The outputs (fresh tensors) of bucket `key`'s graph on `inputs` (shaped as its static ones)."""
        with self.lock:
            g, static, out = self._graphs[key]
            stream = torch.cuda.current_stream(self.device)
            if self._released is not None:  # the previous caller's stream is done with the static buffers
                stream.wait_event(self._released)
            static.copy_(inputs)
            g.replay()
            self.replays += 1
            fresh = tuple(x.clone() for x in out)
            self._released = torch.cuda.Event()
            self._released.record(stream)
            return fresh
