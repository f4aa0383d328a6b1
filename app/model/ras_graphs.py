"""CUDA graphs of the batched RAS step (`[vllm] ras_cuda_graphs`, GPU engines only).

Design notes: docs/model.md.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from app.model.ras_batch import RASBatch, ras_log_probs

log = logging.getLogger(__name__)

_SETTINGS = ("top_p", "rank_ok", "min_count", "eos", "n_valid", "tie_break")  # RASBatch's tensors


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: Tensor  # [R, V] float32 static input
    history: Tensor  # [R, W] long
    ban_eos: Tensor  # [R, 1] bool
    batch: RASBatch  # static copies of the rows' settings
    out: Tensor  # [R, V] float32 static output
    settings_of: RASBatch  # the batch whose settings the static copies hold now


@dataclass
class RASGraphStats:
    captures: int = 0
    replays: int = 0
    evictions: int = 0
    eager: int = 0  # steps run without a graph (a failed capture's layout)
    capture_failures: int = 0


def _static_batch(batch: RASBatch) -> RASBatch:
    return dataclasses.replace(batch, **{k: None if getattr(batch, k) is None else getattr(batch, k).clone()
                                         for k in _SETTINGS})


def _copy_settings(dst: RASBatch, src: RASBatch) -> None:
    for k in _SETTINGS:
        if getattr(dst, k) is not None:
            getattr(dst, k).copy_(getattr(src, k), non_blocking=True)


class RASGraphs:
    """`graphs(logits, batch, history, ban_eos)` -> `[R, V]` float32 log P, as `ras_log_probs` (float32);
    the result is a static buffer, valid until the next call: copy it out (see the module docstring)."""

    def __init__(self, max_graphs: int = 64) -> None:
        if max_graphs < 1:
            raise ValueError("max_graphs must be >= 1")
        self.max_graphs = max_graphs
        self.stats = RASGraphStats()
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._failed: set[tuple] = set()
        self._pool = None  # one memory pool for every graph (made by the first capture)

    def __call__(self, logits: Tensor, batch: RASBatch, history: Tensor, ban_eos: Tensor) -> Tensor:
        key = (*logits.shape, history.shape[1], batch.k_max, batch.n_cols, batch.n_valid is None, logits.device)
        g = self._graphs.get(key)
        if g is None:
            if key in self._failed:
                self.stats.eager += 1
                return ras_log_probs(logits, batch, history, ban_eos)
            g = self._capture(key, logits, batch, history, ban_eos)
            if g is None:
                return ras_log_probs(logits, batch, history, ban_eos)
        else:
            self._graphs.move_to_end(key)
            g.logits.copy_(logits)
            g.history.copy_(history)
            g.ban_eos.copy_(ban_eos)
            if g.settings_of is not batch:  # the batch's requests changed since this graph last ran
                _copy_settings(g.batch, batch)
                g.settings_of = batch
        g.graph.replay()
        self.stats.replays += 1
        return g.out

    def _capture(self, key: tuple, logits: Tensor, batch: RASBatch, history: Tensor,
                 ban_eos: Tensor) -> _Graph | None:
        t0 = time.perf_counter()
        cur = torch.cuda.current_stream(logits.device)
        static = (logits.clone(), history.clone(), ban_eos.clone(), _static_batch(batch))
        side = torch.cuda.Stream(logits.device)
        side.wait_stream(cur)  # the static inputs are written on `cur`
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side):
                ras_log_probs(static[0], static[3], static[1], static[2])  # warm-up: lazy inits outside capture
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    out = ras_log_probs(static[0], static[3], static[1], static[2])
                finally:
                    graph.capture_end()
        except RuntimeError as e:
            cur.wait_stream(side)
            self._failed.add(key)
            self.stats.capture_failures += 1
            log.warning("RAS step for %d rows runs without a CUDA graph (capture failed: %s)", logits.shape[0], e)
            return None
        cur.wait_stream(side)
        if self._pool is None:
            self._pool = graph.pool()
        g = _Graph(graph, static[0], static[1], static[2], static[3], out, batch)
        self._graphs[key] = g
        self.stats.captures += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
            self.stats.evictions += 1
        log.info("RAS CUDA graph for %d rows captured in %.1f ms", logits.shape[0], (time.perf_counter() - t0) * 1e3)
        return g
