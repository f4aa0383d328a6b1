"""The incremental flow inside the whole pipeline (engine.flow_incremental): same audio as the re-solve,
the per-voice prompt cache reused across requests, interleaved streams, and the memory budget's fallback."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from test_pipeline import collect, make_synth
from tolerances import WAVE_MAX_ATOL, WAVE_RMS_ATOL, within

from app.engine.requests import SynthesisRequest

pytestmark = pytest.mark.parity
TEXTS = ("Hello there, how are you today?", "A second request running at the same time, with more words in it.")


@pytest.fixture(scope="module")
def voice(parity, parity_model_dir, manifest):
    e2e = manifest["e2e"]
    synth = make_synth(parity_model_dir, nsf_noise=False)
    try:
        yield synth.voice_from_audio(parity / e2e["prompt_wav"], e2e["prompt_text"])
    finally:
        asyncio.run(synth.aclose())


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
    want, _ = run(parity_model_dir, voice, TEXTS)
    got, synth = run(parity_model_dir, voice, TEXTS, flow_incremental=True)
    assert_same_audio(got, want)
    cache = synth.prompt_cache
    assert cache is not None and cache.stats.misses >= 1 and cache.stats.hits >= 1, cache.stats
    assert synth.flow_budget.refused == 0 and synth.flow_budget.held_bytes == 0  # released at the end


def test_no_room_falls_back_to_the_resolve(parity_model_dir, voice):
    """flow_state_gib = 0: every stream is refused its state and re-solves; the audio is the same."""
    want, _ = run(parity_model_dir, voice, TEXTS[:1])
    got, synth = run(parity_model_dir, voice, TEXTS[:1], flow_incremental=True, flow_state_gib=0.0)
    assert_same_audio(got, want)
    assert synth.flow_budget.refused >= 1 and synth.flow_budget.held_bytes == 0
