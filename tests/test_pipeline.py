"""The whole chain through the Synthesizer: streaming contract, e2e parity, interleaving, cancel."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time

import numpy as np
import pytest
import torch
from tolerances import BATCH_ATOL, OWN_TOKEN_AGREEMENT, WAVE_MAX_ATOL, WAVE_RMS_ATOL, at_least, within

from app.config import load_config
from app.engine.lm_backend import LMRequest, TorchLMBackend
from app.engine.pipeline import EmptyTextError, Synthesizer
from app.engine.requests import SynthesisRequest
from app.model.loader import load_model

EN_PROMPT = "The quick brown fox jumps over the lazy dog near the quiet river bank."


def make_synth(model_dir, *, nsf_noise: bool = True, flow_batch: int = 1, engine: dict | None = None,
               **streaming) -> Synthesizer:
    overrides = {"model.device": "cpu", "streaming.nsf_noise": nsf_noise, "engine.flow_batch": flow_batch}
    overrides.update({f"streaming.{k}": v for k, v in streaming.items()})
    overrides.update({f"engine.{k}": v for k, v in (engine or {}).items()})
    cfg = load_config(overrides=overrides)
    model = load_model(model_dir, device="cpu", nsf_noise=nsf_noise)
    return Synthesizer(model, TorchLMBackend(model.llm), cfg)


async def collect(synth: Synthesizer, req: SynthesisRequest):
    return [c async for c in synth.stream(req)]


async def held_together(synth: Synthesizer, reqs: list[SynthesisRequest], what: str = "first chunks",
                        timeout_s: float = 120.0) -> list:
    """Stream `reqs` concurrently with the token->wave worker held until one job of each waits in its
    queue, so the jobs meet in one batched call; returns each request's chunks."""
    gate = threading.Event()
    blocker = asyncio.ensure_future(synth._t2w.run(gate.wait, deadline=float("-inf")))
    runs = [asyncio.ensure_future(collect(synth, r)) for r in reqs]
    deadline = time.monotonic() + timeout_s
    while synth._t2w.queued() < len(reqs):
        assert time.monotonic() < deadline, f"the {what} never waited together"
        await asyncio.sleep(0.01)
    gate.set()
    await blocker
    return await asyncio.gather(*runs)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    synth = make_synth(tiny_model_dir)
    voice = synth.model.frontend.voice_from_audio("assets/prompt_en.wav", EN_PROMPT)
    yield synth, voice
    asyncio.run(synth.aclose())


@pytest.mark.parametrize("stream", [True, False])
def test_chunk_contract(tiny, stream):
    synth, voice = tiny
    req = SynthesisRequest(text="Hello there, how are you today?", voice=voice, seed=3, stream=stream)
    chunks = asyncio.run(collect(synth, req))
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert [c.is_final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    stats = chunks[-1].stats
    audio = np.concatenate([c.samples for c in chunks])
    assert stats is not None and stats.n_tokens > 0 and stats.ttfa_ms > 0
    assert 0 < stats.first_token_ms <= stats.first_hop_ms <= stats.ttfa_ms  # the first-audio path, in order
    # the first chunk's wave after its tokens, its flow call and its HiFT, before it goes out
    assert stats.first_hop_ms + stats.chunk_flow_ms[0] + stats.first_hift_ms <= stats.first_wave_ms <= stats.ttfa_ms
    assert stats.lm_ms_per_token is None or stats.lm_ms_per_token > 0  # None when the first hop came in one delta
    assert audio.dtype == np.float32 and np.isfinite(audio).all() and np.abs(audio).max() <= 0.99 + 1e-6
    assert abs(stats.audio_s - audio.shape[0] / 24000) < 1e-9
    if not stream:
        assert len(chunks) == 1


def test_fast_preset_streams(tiny_model_dir):
    """configs/fast.toml on the CPU: flow in float16 on the packed O(chunk) path, a 10-token unaligned first
    hop. The first chunk carries 10 tokens of audio minus the held-back cross-fade tail, and each of two
    requests at once has all its samples (tokens x 960)."""
    from app.config import CONFIG_DIR
    from app.model.token2wav import CROSSFADE_SAMPLES

    cfg = load_config(CONFIG_DIR / "fast.toml", {"model.device": "cpu"})
    m = cfg.model
    model = load_model(tiny_model_dir, device="cpu", flow_dtype=m.flow_dtype, hift_dtype=m.hift_dtype)
    synth = Synthesizer(model, TorchLMBackend(model.llm), cfg)
    assert next(model.flow.parameters()).dtype == torch.float16
    voice = synth.model.frontend.voice_from_audio("assets/prompt_en.wav", EN_PROMPT)

    async def both():
        reqs = [SynthesisRequest(text="Hello there, how are you today?", voice=voice, seed=s, stream=True,
                                 fixed_tokens=60) for s in (1, 2)]
        return await asyncio.gather(*(collect(synth, r) for r in reqs))

    try:
        for chunks in asyncio.run(both()):
            assert chunks[0].samples.shape[0] == 10 * 960 - CROSSFADE_SAMPLES
            audio = np.concatenate([c.samples for c in chunks])
            assert audio.shape[0] == 60 * 960 and np.isfinite(audio).all()
    finally:
        asyncio.run(synth.aclose())
    assert synth.streaming.first_hop_tokens == 10 and not synth.streaming.align_first_hop


def test_all_modes_and_multi_segment(tiny):
    synth, voice = tiny
    text = ("This is the first sentence of a longer paragraph that keeps going for a while. " * 4).strip()
    for mode, instruct in (("zero_shot", ""), ("cross_lingual", ""), ("instruct", "Speak slowly.")):
        req = SynthesisRequest(text=text, voice=voice, mode=mode, instruct_text=instruct, seed=1, stream=True)
        chunks = asyncio.run(collect(synth, req))
        assert chunks[-1].stats.n_segments >= 2, mode
        assert sum(c.is_final for c in chunks) == 1


@pytest.mark.parametrize("flow_batch", [1, 16])
def test_same_seed_same_audio_and_interleaving(tiny, tiny_model_dir, flow_batch):
    """Two concurrent requests give what each gives alone (NSF noise on, seeded): exactly with one flow
    call per chunk; within -34 dB when their first chunks share a batched flow call (engine.flow_batch)."""
    synth, voice = tiny
    if flow_batch > 1:
        synth = make_synth(tiny_model_dir, flow_batch=flow_batch)
    a = SynthesisRequest(text="Hello there, how are you today?", voice=voice, seed=11, stream=True)
    b = SynthesisRequest(text="A second request running at the same time.", voice=voice, mode="cross_lingual",
                         seed=12, stream=True)

    async def both():
        if flow_batch == 1:
            return await asyncio.gather(collect(synth, a), collect(synth, b))
        # hold the token2wav worker until both requests' first chunks wait, so they must share a flow call
        gate = threading.Event()
        blocker = asyncio.ensure_future(synth._t2w.run(gate.wait, deadline=float("-inf")))
        runs = [asyncio.ensure_future(collect(synth, r)) for r in (a, b)]
        deadline = time.monotonic() + 120
        while synth._t2w.queued() < 2:
            assert time.monotonic() < deadline, "the two first chunks never waited together"
            await asyncio.sleep(0.01)
        gate.set()
        await blocker
        return await asyncio.gather(*runs)

    solo_a, solo_b = asyncio.run(collect(synth, a)), asyncio.run(collect(synth, b))
    batched_before = sum(n for size, n in synth._t2w.batch_sizes.items() if size > 1)
    conc_a, conc_b = asyncio.run(both())
    cat = lambda cs: np.concatenate([c.samples for c in cs])
    if flow_batch == 1:
        assert np.array_equal(cat(conc_a), cat(solo_a))
        assert np.array_equal(cat(conc_b), cat(solo_b))
        assert set(synth._t2w.batch_sizes) == {1}
    else:
        assert sum(n for size, n in synth._t2w.batch_sizes.items() if size > 1) > batched_before  # shared calls
        for conc, solo in ((conc_a, solo_a), (conc_b, solo_b)):
            assert [c.samples.shape for c in conc] == [c.samples.shape for c in solo]
            err = cat(conc) - cat(solo)  # the batched mel differs by float rounding only, which this random
            # tiny model's HiFT amplifies (measured RMS 4.4e-5 against a signal RMS of 4.1e-3, -40 dB):
            # test_batched_flow_differs_from_batch1_by_rounding_only shows the cause
            assert np.sqrt(np.mean(err**2)) < 0.02 * np.sqrt(np.mean(cat(solo) ** 2))
    assert not np.array_equal(cat(solo_a)[:1000], cat(asyncio.run(collect(synth, SynthesisRequest(
        text=a.text, voice=voice, seed=99))))[:1000])


def test_batched_flow_differs_from_batch1_by_rounding_only(tiny):
    """Why batched audio is not bit-equal to batch-1 audio: the batched mel equals batch-1's to float
    rounding (< 1e-5 on values of RMS ~1.3), and this random model's HiFT turns rounding-sized mel
    differences into audible-size sample differences (its F0 predictor feeds a phase integral): a
    1e-5 random nudge of the batch-1 mel moves the audio more than batching does."""
    import torch

    from app.model.flow_calls import FlowItem, FlowPrompt, flow_batch

    synth, _ = tiny
    flow, hift = synth.model.flow, synth.model.hift
    g = torch.Generator().manual_seed(0)
    prompt = FlowPrompt(tokens=torch.randint(0, 6561, (1, 40), generator=g), mel=torch.randn(1, 80, 80, generator=g),
                        embedding=torch.randn(1, 192, generator=g))
    tokens = torch.randint(0, 6561, (1, 35), generator=g)
    items = [FlowItem(tokens, prompt, True, False, 0), FlowItem(tokens[:, :28], prompt, True, False, 0)]

    def audio(mel: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return hift.inference(mel, None, generator=torch.Generator().manual_seed(5))[0][0]

    def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())

    for batched, it in zip(flow_batch(flow, items), items, strict=True):
        alone = flow_batch(flow, [it])[0]
        assert within((batched - alone).abs().max(), BATCH_ATOL)
        nudged = alone + 1e-5 * torch.randn(alone.shape, generator=g)
        ref = audio(alone)
        assert torch.equal(audio(alone.clone()), ref)  # HiFT itself is deterministic
        assert rel_rms(audio(batched), ref) < rel_rms(audio(nudged), ref)


def test_closing_the_stream_stops_the_lm(tiny):
    synth, voice = tiny

    async def first_then_leave():
        agen = synth.stream(SynthesisRequest(text="Hello there. " * 20, voice=voice, seed=5, stream=True))
        first = await anext(agen)
        await agen.aclose()  # what a Stop / disconnect does
        await synth.lm.drain()
        return first

    first = asyncio.run(first_then_leave())
    assert first.samples.shape[0] > 0 and not first.is_final
    assert synth.lm.n_active == 0


def test_lm_workers_end_even_when_their_event_loop_closed_first(tiny):
    """Each LM stream on its own loop (asyncio.run per call, as the tests and CLIs do): the loop may close right
    after the stream ends, before its decode thread has returned. The backend must still see every worker end
    (health, drain), not keep a future of a closed loop pending for good (drain then hung)."""
    synth, _ = tiny
    lm = synth.lm

    async def one(seed: int) -> int:
        req = LMRequest(request_id=f"loop-{seed}", prompt_ids=(0, 0, 0), min_tokens=2, max_tokens=6,
                        seed=seed, sampling=synth.sampling)
        return sum([len(ids) async for ids in lm.stream(req)])

    assert all(asyncio.run(one(seed)) > 0 for seed in range(30))
    asyncio.run(asyncio.wait_for(lm.drain(), timeout=30))  # hung before the fix (6 of 30 workers never ended)
    assert lm.n_active == 0 and lm.health().unfinished == 0


def test_empty_text_is_refused(tiny):
    synth, voice = tiny
    with pytest.raises(EmptyTextError):
        asyncio.run(collect(synth, SynthesisRequest(text="  ...!?  ", voice=voice)))


def test_voice_features_round_trip(tiny, tmp_path):
    from app.model.frontend import VoiceFeatures

    _, voice = tiny
    np.savez(tmp_path / "v.npz", **voice.to_arrays())
    with np.load(tmp_path / "v.npz", allow_pickle=False) as z:
        back = VoiceFeatures.from_arrays(dict(z))
    assert back.prompt_text == voice.prompt_text
    for k in ("prompt_text_ids", "speech_tokens", "speech_mel", "embedding"):
        assert np.array_equal(getattr(back, k).numpy(), getattr(voice, k).numpy()), k


@pytest.mark.parity
@pytest.mark.parametrize("stream", [False, True])
def test_e2e_parity_with_official(parity, parity_model_dir, golden, manifest, stream):
    """Text + prompt wav -> frontend -> LM (seeded RAS) -> flow -> HiFT, against e2e.npz."""
    e2e, g = manifest["e2e"], golden("e2e")
    synth = make_synth(parity_model_dir, nsf_noise=False)
    try:
        voice = synth.model.frontend.voice_from_audio(parity / e2e["prompt_wav"], e2e["prompt_text"])
        assert voice.prompt_text == e2e["normalized_prompt_text"]
        # our own features give the official prompt tokens only up to the README's agreement (a log-mel
        # within tolerance can round a token differently on another CPU's FFT), and one flipped token
        # changes every sampled LM token: the LM gets the official prompt tokens, the flow our mel.
        case = "a" if e2e["prompt_wav"] == "prompt_24k.wav" else "b"  # fixture README §3
        official = torch.from_numpy(golden("frontend")[f"{case}_zs_prompt_speech_token"])
        assert voice.speech_tokens.shape == official.shape
        assert at_least((voice.speech_tokens == official).float().mean(), OWN_TOKEN_AGREEMENT)
        voice = dataclasses.replace(voice, speech_tokens=official.to(voice.speech_tokens.dtype))
        assert synth.model.frontend.split_text(e2e["tts_text"]) == e2e["normalized_tts_text"]
        req = SynthesisRequest(text=e2e["tts_text"], voice=voice, seed=e2e["seed"], stream=stream)
        chunks = asyncio.run(collect(synth, req))
    finally:
        asyncio.run(synth.aclose())
    kind = "stream" if stream else "nonstream"
    assert chunks[-1].stats.n_tokens == g[f"{kind}_llm_tokens"].shape[1]
    assert [c.samples.shape[0] for c in chunks] == g[f"{kind}_chunk_lens"].tolist()
    audio = np.concatenate([c.samples for c in chunks])
    ref = g[f"{kind}_speech"].reshape(-1)
    err = np.abs(audio - ref)
    assert within(err.max(), WAVE_MAX_ATOL, "max") and within(np.sqrt((err**2).mean()), WAVE_RMS_ATOL, "rms")


class _Recorder:
    """The real torch backend, with a log of when each segment's LM stream started and what it gave."""

    def __init__(self, inner: TorchLMBackend) -> None:
        self.inner, self.started, self.tokens = inner, {}, {}

    def stream(self, req):
        async def gen():
            self.started[req.seed] = time.perf_counter()
            got = self.tokens.setdefault(req.seed, [])
            async for new in self.inner.stream(req):
                got.extend(new)
                yield new
        return gen()

    def health(self):
        return self.inner.health()

    def facts(self):
        return self.inner.facts()

    async def aclose(self):
        await self.inner.aclose()


def test_next_segment_lm_starts_while_this_one_is_vocoded(tiny):
    """Segment k+1's LM request starts once segment k's LM has finished, before segment k's last
    chunk is out (the join does not wait for the vocoder); each segment gets the same tokens as its
    LM request alone; stopping early aborts the LM that was started ahead (no decode thread left)."""
    synth, voice = tiny
    rec = _Recorder(synth.lm)
    synth.lm = rec
    text = ("This is the first sentence of a longer paragraph that keeps going for a while. " * 3).strip()
    req = SynthesisRequest(text=text, voice=voice, seed=40, stream=True, fixed_tokens=0)

    async def run():
        out = []
        async for c in synth.stream(req):
            out.append((c.segment, c.is_final, time.perf_counter()))
        return out

    async def alone(lm_req):
        return [t async for new in rec.inner.stream(lm_req) for t in new]

    async def stop_after_first_segment():
        async with contextlib.aclosing(synth.stream(dataclasses.replace(req, seed=80))) as chunks:
            async for c in chunks:
                if c.segment == 1:
                    break
        await rec.inner.drain()

    try:
        chunks = asyncio.run(run())
        segments = synth.model.frontend.split_text(text)
        assert len(segments) >= 2 and max(s for s, _, _ in chunks) == len(segments) - 1
        for k in range(len(segments) - 1):
            last_chunk_of_k = max(t for s, _, t in chunks if s == k)
            assert rec.started[req.seed + k + 1] < last_chunk_of_k, k
        for k, seg_text in enumerate(segments):
            assert rec.tokens[req.seed + k] == asyncio.run(alone(synth.lm_request(req, seg_text, k))), k
        asyncio.run(stop_after_first_segment())
        assert rec.inner.n_active == 0
    finally:
        synth.lm = rec.inner
