"""HiFT graphs captured at warm-up only (app/model/hift_graphs.py), on the CPU.

A CUDA graph cannot be captured on the CPU, so `RecordedSteps` stands in for the recording only: its
"graph" re-runs `vocode_step` on the static inputs and copies into static outputs, as a replay would.
Everything else is the served code: the (rows, frames) buckets, the row and source-cache padding
into static buffers, the frozen set, the eager fallback, and the pipeline's warm-up capture. Checked:
a replay equals the eager batched call on the unpadded rows (the batched-rows bound) and on the padded
ones (bit for bit); padding in time would not be exact (why frames are exact lengths); after warm-up
nothing is recorded, whatever shapes come; the schedule's chunk lengths cover every non-final chunk
the pipeline vocodes. The GPU check is bench/gpu/hift_graphs.py.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch
from test_hift_batch import _hift
from test_pipeline import collect, held_together, make_synth
from tolerances import BATCH_ATOL, WAVE_MAX_ATOL, WAVE_RMS_ATOL, within

from app.config import StreamingConfig
from app.engine.requests import SynthesisRequest
from app.model.hift_batch import make_row, stack_rows, vocode_rows, vocode_step
from app.model.hift_graphs import HiftGraphs, row_buckets, schedule_frames
from app.model.token2wav import SOURCE_CACHE_SAMPLES

pytestmark = pytest.mark.parity


class RecordedSteps(HiftGraphs):
    """HiftGraphs whose 'graph' is the eager step on the static buffers (the CPU cannot capture)."""

    def __init__(self) -> None:
        super().__init__()
        self.recorded = 0  # calls of the recording function: must stop at warm-up

    def _record(self, hift, inputs, pool, side):
        self.recorded += 1
        outputs = tuple(t.clone() for t in vocode_step(hift, *inputs))

        def replay() -> None:
            for static, new in zip(outputs, vocode_step(hift, *inputs), strict=True):
                static.copy_(new)

        return replay, outputs, pool


@pytest.fixture(scope="module")
def hift(parity_model_dir):
    return _hift(parity_model_dir, nsf_noise=True)


def _rows(hift, n, frames, *, cached):
    g = torch.Generator().manual_seed(10 * n + frames)
    rows = []
    for i in range(n):
        mel = torch.randn(1, 80, frames, generator=g) - 5
        cache = 0.1 * torch.randn(1, 1, SOURCE_CACHE_SAMPLES, generator=g) if cached and i % 3 != 1 else None
        rows.append(make_row(hift, mel, cache, torch.Generator().manual_seed(100 + i)))
    return rows


def test_schedule_frames_official_and_unaligned():
    # official: first chunks 2 x (25 + pad) for pad 0..24, then 8 + 100 and 8 + 200 (steady, most frequent)
    official = schedule_frames(StreamingConfig())
    assert official[0] == 208 and sorted(official) == [*range(50, 100, 2), 108, 208]
    # fast.toml's unaligned 10-token first hop: 20 frames, then hops rounded up to chunk edges
    fast = schedule_frames(StreamingConfig(first_hop_tokens=10, align_first_hop=False))
    assert fast[0] == 208 and 20 in fast and len(fast) <= 60
    assert row_buckets(16) == [1, 2, 4, 8, 16] and row_buckets(5) == [1, 2, 4, 8]


@torch.inference_mode()
def test_replay_equals_eager_batched_call(hift):
    graphs = RecordedSteps()
    graphs.capture(hift, row_buckets(8), [40, 108])
    for n, frames, cached in ((1, 40, False), (3, 108, True), (5, 108, True), (8, 40, False), (6, 40, True)):
        rows = _rows(hift, n, frames, cached=cached and frames * 480 >= SOURCE_CACHE_SAMPLES)
        before = graphs.stats.replays
        spec, source = graphs(hift, rows)
        assert graphs.stats.replays == before + 1 and spec.shape[0] == 1 << (n - 1).bit_length()
        # the eager call on the unpadded rows: the batched-rows bound (rows never interact)
        want_spec, want_source = vocode_step(hift, *stack_rows(rows))
        assert within((spec[:n] - want_spec).abs().max(), BATCH_ATOL, "rows")
        assert within((source[:n] - want_source).abs().max(), BATCH_ATOL, "rows")
        # the eager call on the same padded rows, the cache zero-padded to the graph's width: bit for bit
        mel, eps, cache, cache_len = stack_rows(rows, spec.shape[0])
        wide = torch.zeros(cache.shape[0], 1, min(SOURCE_CACHE_SAMPLES, 480 * frames))
        wide[:, :, : cache.shape[2]] = cache
        padded_spec, padded_source = vocode_step(hift, mel, eps, wide, cache_len)
        assert torch.equal(spec, padded_spec) and torch.equal(source, padded_source)
        # and through vocode_rows (the engine's call): the waves of the unpadded eager call
        got, want = vocode_rows(hift, rows, graphs), vocode_rows(hift, rows)
        for (a, _), (b, _) in zip(got, want, strict=True):
            assert within((a - b).abs().max(), BATCH_ATOL, "rows")


@torch.inference_mode()
def test_padding_in_time_would_change_the_row(hift):
    """Why frames are never padded: HiFT is not causal, extra frames change the row's own last samples."""
    (row,) = _rows(hift, 1, 40, cached=False)
    spec, _ = vocode_step(hift, *stack_rows([row]))
    longer = make_row(hift, torch.cat([row.mel, torch.full((1, 80, 8), -5.0)], 2), None, None)
    longer = type(row)(longer.mel, None, torch.cat([row.eps, longer.eps[:, :, 40 * 480:]], 2))
    spec_padded, _ = vocode_step(hift, *stack_rows([longer]))
    assert (spec_padded[:, :, : spec.shape[2]] - spec).abs().max() > 1e3 * BATCH_ATOL


def test_frozen_after_warm_up(hift):
    """Captured once: shapes outside the buckets (new lengths, more rows, a longer cache) run eagerly,
    nothing is recorded again, and a second capture is refused."""
    graphs = RecordedSteps()
    graphs.capture(hift, row_buckets(4), [40, 108], streams=[None, None], max_graphs=5)
    assert graphs.frozen and graphs.recorded == graphs.stats.captures == 10 == graphs.n_graphs * 2
    for rows in (_rows(hift, 2, 30, cached=False), _rows(hift, 5, 40, cached=False), _rows(hift, 1, 60, cached=False)):
        before = graphs.stats.eager
        graphs(hift, rows)
        assert graphs.stats.eager == before + 1
    graphs(hift, _rows(hift, 4, 40, cached=False))  # the 5th bucket (4 rows x 40) was captured
    assert graphs.stats.replays == 1 and graphs.recorded == 10 and graphs.n_graphs == 5
    with pytest.raises(RuntimeError, match="warm-up"):
        graphs.capture(hift, [1], [30])


TEXTS = ("Hello there, how are you today?", "A second request running at the same time, with more words in it.",
         "And a third one.")


class CountingSteps(RecordedSteps):
    """Also notes, per call, its mel length and whether it replayed."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, bool]] = []
        self._lock = threading.Lock()

    def __call__(self, hift, rows):
        with self._lock:
            before = self.stats.replays
            out = super().__call__(hift, rows)
            self.calls.append((rows[0].n_frames, self.stats.replays > before))
        return out


def test_pipeline_captures_at_warm_up_only(parity_model_dir, voice):
    """The Synthesizer's warm-up capture, then three concurrent streamed requests: every non-final chunk
    replays a graph (the schedule's lengths cover them), finals run eagerly, nothing is recorded while
    serving, and each request's audio is what it gives without graphs (README tolerances)."""
    synth = make_synth(parity_model_dir, nsf_noise=True, flow_batch=4, engine={"hift_graph_rows": 4})
    reqs = [SynthesisRequest(text=t, voice=voice, seed=5 + i, stream=True) for i, t in enumerate(TEXTS)]

    try:
        alone = [asyncio.run(collect(synth, r)) for r in reqs]  # no graphs (CPU)
        synth.hift_graphs = graphs = CountingSteps()
        synth.capture_graphs()
        captured = graphs.recorded
        synth.capture_graphs()  # a second warm-up does nothing
        both = asyncio.run(held_together(synth, reqs))
        facts = synth.facts()["hift_graphs"]
    finally:
        asyncio.run(synth.aclose())
    assert captured == graphs.stats.captures == graphs.n_graphs == 3 * len(schedule_frames(
        synth.streaming, chunk_tokens=synth.chunk_tokens, pre_lookahead=synth.pre_lookahead))
    assert graphs.recorded == captured and facts["frozen"] and facts["captures"] == captured
    n_final = sum(len({c.segment for c in cs}) for cs in both)  # one final per segment
    non_final = [frames for frames, replayed in graphs.calls if not replayed]
    assert graphs.stats.replays >= 3 and len(non_final) <= n_final, graphs.calls  # only finals ran eagerly
    for conc, solo in zip(both, alone, strict=True):
        assert [c.samples.shape for c in conc] == [c.samples.shape for c in solo]
        a, b = (np.concatenate([c.samples for c in cs]) for cs in (conc, solo))
        err = np.abs(a - b)
        assert within(err.max(), WAVE_MAX_ATOL, "max") and within(np.sqrt((err**2).mean()), WAVE_RMS_ATOL, "rms")
