"""The final call through the pipeline: `[streaming] final_call` ("exact" full attention, the default, or
"chunk_causal") on the re-solve and incremental paths, and exact finals of streams that finish together
sharing one batched flow call. Tiny random model, real CPU LM (torch backend)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from test_pipeline import EN_PROMPT, collect, held_together, make_synth
from tolerances import WAVE_MAX_ATOL, WAVE_RMS_ATOL, within

from app.config import ConfigError, load_config
from app.engine.requests import SynthesisRequest

TEXT = "Hello there, how are you today?"


@pytest.fixture(scope="module")
def voice(tiny_model_dir):
    synth = make_synth(tiny_model_dir)
    try:
        yield synth.model.frontend.voice_from_audio("assets/prompt_en.wav", EN_PROMPT)
    finally:
        asyncio.run(synth.aclose())


def _chunks(model_dir, voice, **kw):
    synth = make_synth(model_dir, flow_batch=1, **kw)
    try:
        req = SynthesisRequest(text=TEXT, voice=voice, seed=21, stream=True, fixed_tokens=120)
        return synth, [c.samples for c in asyncio.run(collect(synth, req))]
    finally:
        asyncio.run(synth.aclose())


def test_final_call_option(tiny_model_dir, voice):
    """chunk_causal changes the last chunk only (same hops, same length); on the incremental path it
    gives what the re-solve gives (README wave tolerances); "exact" is the default."""
    assert load_config().streaming.final_call == "exact"
    with pytest.raises(ConfigError, match="final_call"):
        load_config(overrides={"streaming.final_call": "causal"})
    resolve = {"flow_incremental": False}  # the references: the re-solve (the default path)
    synth, exact = _chunks(tiny_model_dir, voice, engine=resolve)
    assert synth.streaming.final_call == "exact"
    synth, causal = _chunks(tiny_model_dir, voice, final_call="chunk_causal", engine=resolve)
    assert synth.streaming.final_call == "chunk_causal" and len(causal) == len(exact) >= 3
    for a, b in zip(causal[:-1], exact[:-1], strict=True):
        assert np.array_equal(a, b)  # the hops: untouched
    assert causal[-1].shape == exact[-1].shape and not np.array_equal(causal[-1], exact[-1])
    synth, incremental = _chunks(tiny_model_dir, voice, final_call="chunk_causal", engine={"flow_incremental": True})
    assert synth.incremental and synth.streaming.final_call == "chunk_causal"
    a, b = np.concatenate(incremental), np.concatenate(causal)
    assert a.shape == b.shape
    err = np.abs(a - b)
    assert within(err.max(), WAVE_MAX_ATOL, "max") and within(np.sqrt((err**2).mean()), WAVE_RMS_ATOL, "rms")


def test_exact_finals_of_streams_finishing_together_share_a_call(tiny_model_dir, voice):
    """Three requests whose exact final calls (full attention) wait together run as one batched flow call
    (rows padded and masked), each giving what it gives alone (within -34 dB, as the batched hops in
    tests/test_pipeline.py: the random tiny HiFT amplifies float rounding)."""
    synth = make_synth(tiny_model_dir, flow_batch=4)
    reqs = [SynthesisRequest(text=TEXT, voice=voice, seed=30 + i, stream=False, fixed_tokens=40 + 20 * i)
            for i in range(3)]

    try:
        alone = [asyncio.run(collect(synth, r)) for r in reqs]
        before = synth._t2w.batch_sizes.get(3, 0)
        both = asyncio.run(held_together(synth, reqs, "finals"))
    finally:
        asyncio.run(synth.aclose())
    assert synth._t2w.batch_sizes.get(3, 0) == before + 1  # one flow call held the three finals
    for conc, solo in zip(both, alone, strict=True):
        a, b = conc[0].samples, solo[0].samples
        assert len(conc) == 1 and conc[0].is_final and a.shape == b.shape
        assert np.sqrt(np.mean((a - b) ** 2)) < 0.02 * np.sqrt(np.mean(b**2))
