"""The incremental flow inside the whole pipeline (engine.flow_incremental): same audio as the re-solve,
the per-voice prompt cache reused across requests, interleaved streams, and the memory budget's fallback."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from test_pipeline import collect, held_together, make_synth
from tolerances import WAVE_MAX_ATOL, WAVE_RMS_ATOL, within

from app.engine.requests import SynthesisRequest
from app.model.flow_calls import IncrementalItem

pytestmark = pytest.mark.parity
TEXTS = ("Hello there, how are you today?", "A second request running at the same time, with more words in it.")


def run(model_dir, voice, texts, **engine) -> tuple[list[np.ndarray], object]:
    """Each text as one streamed request, all at once, on one synthesizer; (audio per text, synthesizer)."""
    synth = make_synth(model_dir, nsf_noise=False, engine=engine)

    async def all_at_once():
        reqs = [SynthesisRequest(text=t, voice=voice, seed=5 + i, stream=True) for i, t in enumerate(texts)]
        return await asyncio.gather(*(collect(synth, r) for r in reqs))

    try:
        outs = asyncio.run(all_at_once())
    finally:
        asyncio.run(synth.aclose())
    return [np.concatenate([c.samples for c in chunks]) for chunks in outs], synth


def assert_same_audio(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        err = np.abs(a - b)
        assert within(err.max(), WAVE_MAX_ATOL, "max") and within(np.sqrt((err**2).mean()), WAVE_RMS_ATOL, "rms")


def test_incremental_pipeline_equals_resolve(parity_model_dir, voice):
    """Two interleaved streams of one voice: the incremental engine gives the re-solve's audio (README
    tolerances); the voice's prefix is built once and hit by the other stream and the next request."""
    want, _ = run(parity_model_dir, voice, TEXTS, flow_incremental=False)
    got, synth = run(parity_model_dir, voice, TEXTS, flow_incremental=True)
    assert_same_audio(got, want)
    cache = synth.prompt_cache
    assert cache is not None and cache.stats.misses >= 1 and cache.stats.hits >= 1, cache.stats
    assert synth.flow_budget.refused == 0 and synth.flow_budget.held_bytes == 0  # released at the end
    tables = synth.facts()["flow_incremental"]["position_table_bytes"]  # the encoder's rows, held once by the pool
    assert tables == sum(t.nbytes for t in synth.flow_pool.encoder.positions) > 0


def test_no_room_falls_back_to_the_resolve(parity_model_dir, voice):
    """flow_state_gib = 0: every stream is refused its state and re-solves; the audio is the same."""
    want, _ = run(parity_model_dir, voice, TEXTS[:1], flow_incremental=False)
    got, synth = run(parity_model_dir, voice, TEXTS[:1], flow_incremental=True, flow_state_gib=0.0)
    assert_same_audio(got, want)
    assert synth.flow_budget.refused >= 1 and synth.flow_budget.held_bytes == 0


def test_concurrent_hops_share_one_estimator_call(parity_model_dir, voice):
    """engine.flow_batch 16: two requests' first incremental hops, held until both wait, run as one
    batched flow call (IncrementalItem jobs of the token->wave scheduler); the audio is the re-solve's."""
    want, _ = run(parity_model_dir, voice, TEXTS, flow_incremental=False)
    synth = make_synth(parity_model_dir, nsf_noise=False, flow_batch=16, engine={"flow_incremental": True})
    t2w, calls = synth._t2w, []
    flow_fn = t2w.flow_fn

    def counting(items):  # the scheduler's real flow_fn (flow_batch), sizes of incremental calls noted
        if isinstance(items[0], IncrementalItem):
            calls.append(len(items))
        return flow_fn(items)

    t2w.flow_fn = counting

    async def both():
        gate = threading.Event()  # hold the worker until both first hops wait, so they share a call
        blocker = asyncio.ensure_future(t2w.run(gate.wait, deadline=float("-inf")))
        reqs = [SynthesisRequest(text=t, voice=voice, seed=5 + i, stream=True) for i, t in enumerate(TEXTS)]
        runs = [asyncio.ensure_future(collect(synth, r)) for r in reqs]
        deadline = time.monotonic() + 300
        while t2w.queued() < 2:
            assert time.monotonic() < deadline, "the two first hops never waited together"
            await asyncio.sleep(0.01)
        gate.set()
        await blocker
        return await asyncio.gather(*runs)

    try:
        outs = asyncio.run(both())
    finally:
        asyncio.run(synth.aclose())
    assert calls and calls[0] == 2, calls  # the first hops shared one estimator call
    assert_same_audio([np.concatenate([c.samples for c in chunks]) for chunks in outs], want)
    assert synth.prompt_cache.stats.misses == 1 and synth.flow_budget.held_bytes == 0


MIXED = ("Hi.", "A second request running at the same time, with more words in it than the first one has.",
         "Hello there, how are you today?")


def run_mixed(model_dir, voices, **engine) -> tuple[list[np.ndarray], object]:
    """MIXED's texts at once, each in its voice (two voices, three lengths), held until all first hops wait
    so they share a call; the short one ends while the others still hop. (audio per text, synthesizer)."""
    synth = make_synth(model_dir, nsf_noise=False, flow_batch=16, engine=engine)
    reqs = [SynthesisRequest(text=t, voice=v, seed=5 + i, stream=True)
            for i, (t, v) in enumerate(zip(MIXED, voices, strict=True))]
    try:
        outs = asyncio.run(held_together(synth, reqs, "first hops"))
    finally:
        asyncio.run(synth.aclose())
    return [np.concatenate([c.samples for c in chunks]) for chunks in outs], synth


@pytest.fixture(scope="module")
def two_voices(parity_model_dir, voice):
    from app.model.loader import load_model

    other = load_model(parity_model_dir, device="cpu").frontend.voice_from_audio(
        "assets/prompt_en.wav", "The quick brown fox jumps over the lazy dog near the quiet river bank.")
    return voice, other, voice


def test_paged_path_mixed_voices_and_lengths(parity_model_dir, two_voices):
    """The paged incremental path (its pool as configured otherwise); three interleaved streams of two voices
    and three lengths, sharing batched calls, give the re-solve's audio (README tolerances); nothing
    re-solved, every block back at the end; the flow's work is counted."""
    want, _ = run_mixed(parity_model_dir, two_voices, flow_incremental=False)
    got, synth = run_mixed(parity_model_dir, two_voices, flow_incremental=True)
    assert_same_audio(got, want)
    facts = synth.facts()
    assert facts["flow_path"] == "paged incremental" and synth.resolved_streams == 0
    inc = facts["flow_incremental"]
    assert inc["state_bytes"] == 0 and inc["sized"] == "flow_state_gib 4.0"
    assert synth.prompt_cache.stats.misses == 2  # one prefix per voice, the third stream hit it
    pool = synth.flow_pool
    assert pool.free_blocks == pool.n_blocks - sum(len(p.state.est.table) for p in synth.prompt_cache._entries.values())
    work = facts["flow_work"]
    assert work["calls"] > 0 and 0 < work["frames_needed"] <= work["frames_computed"] and work["tflop"] > 0


def test_a_pool_that_runs_out_mid_stream_resolves(parity_model_dir, two_voices):
    """A pool of a few blocks: the voices' prefixes fit, the streams' later hops do not; those streams
    re-solve from then on (counted), and every stream's audio is still the re-solve's."""
    from app.model.flow.incremental.paged import block_bytes
    from app.model.loader import load_model

    block = block_bytes(load_model(parity_model_dir, device="cpu").flow)
    want, _ = run_mixed(parity_model_dir, two_voices, flow_incremental=False)
    got, synth = run_mixed(parity_model_dir, two_voices, flow_incremental=True, flow_state_gib=12 * block / 2**30)
    assert_same_audio(got, want)
    inc = synth.facts()["flow_incremental"]
    assert synth.prompt_cache.stats.misses >= 1  # streams began on the incremental path
    assert synth.resolved_streams >= 1 and synth.resolved_streams == inc["resolved_streams"]
    assert inc["refused_streams"] + inc["pool_refused"] >= 1 and inc["state_bytes"] == 0
