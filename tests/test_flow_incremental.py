"""Incremental streaming flow (app/model/flow/incremental/state.py, its estimator state in a `KVPool`) == today's
re-solve, on the CPU.

Every schedule comes from the fixtures (prompt and tokens of flow.npz / stream.npz / e2e.npz) and
`Token2WavStream.next_plan`. Measured on this 2-core CPU (torch 2.13, parity fixture v1):
- streaming hops, fp32: max |incremental - re-solve| 2.1e-6 (mel absmax ~4.9), with or without the
  voice prefix, aligned and unaligned schedules; the first hop without a prefix is bitwise equal
  (same shapes). fp64: 0.0 on every hop.
- chunk-causal final (streaming=True, finalize=True) vs the re-solve of the same call: 2.1e-6
  (fp64 0.0); vs the official full-attention final: max 0.42, RMS 8.7 % of the tail's RMS (random
  weights; docs/precision.md).
- Token2WavStream audio, incremental vs re-solve: see test_stream_audio_incremental_equals_resolve.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from t2w_chunks import run_chunk
from tolerances import (
    FLOW_MEL_ATOL,
    HALF_INCREMENTAL_ATOL,
    INCREMENTAL_ATOL,
    INCREMENTAL_F64_ATOL,
    WAVE_MAX_ATOL,
    WAVE_RMS_ATOL,
)

from app.config import StreamingConfig
from app.model.flow import CausalFlow, load_flow
from app.model.flow.incremental.paged import KVPool
from app.model.flow.incremental.prompt_cache import PromptCache
from app.model.flow.incremental.state import FlowState, build_voice_prefix, prompt_only_chunks
from app.model.flow_calls import FlowItem, FlowPrompt, flow_batch
from app.model.hift import HiFTGenerator, normalize_hift_state_dict
from app.model.hparams import load_hparams
from app.model.loader import load_strict
from app.model.token2wav import Token2WavStream, flow_step

MEL_ATOL = FLOW_MEL_ATOL
CAUSAL_FINAL = StreamingConfig(final_call="chunk_causal")  # the official hops, a chunk-causal final call
FP32_TIGHT, FP64_TIGHT = INCREMENTAL_ATOL, INCREMENTAL_F64_ATOL
AUDIO_MAX, AUDIO_RMS = WAVE_MAX_ATOL, WAVE_RMS_ATOL


@pytest.fixture(scope="module")
def flow(parity_model_dir) -> CausalFlow:
    return load_flow(parity_model_dir / "flow.pt", load_hparams(parity_model_dir).flow)


@pytest.fixture(scope="module")
def flow64(flow) -> CausalFlow:
    return copy.deepcopy(flow).double()


@pytest.fixture(scope="module")
def hift(parity_model_dir) -> HiFTGenerator:
    hift = HiFTGenerator(load_hparams(parity_model_dir).hift, nsf_noise=False)  # goldens: zero NSF noise
    load_strict(hift, parity_model_dir / "hift.pt", transform=normalize_hift_state_dict)
    hift.remove_weight_norm()
    return hift.eval()


def other_voice(prompt: FlowPrompt) -> FlowPrompt:
    """A second voice from the fixture's: the first 2/3 of the prompt, x-vector reversed."""
    n = 2 * prompt.tokens.shape[1] // 3
    return FlowPrompt(prompt.tokens[:, :n], prompt.mel[:, : 2 * n], prompt.embedding.flip(1))


def unaligned_streaming(prompt: FlowPrompt, chunk: int, **kw) -> StreamingConfig:
    """A small unaligned first hop whose end falls inside a chunk (so a partial chunk is computed)."""
    hop = next(h for h in range(10, 10 + chunk) if (prompt.tokens.shape[1] + h) % chunk)
    return StreamingConfig(first_hop_tokens=hop, align_first_hop=False, **kw)


def new_pool(flow: CausalFlow, n_blocks: int = 96) -> KVPool:
    """A state pool in the flow's dtype with room for a few of the fixture's streams (50 frames a block)."""
    return KVPool(flow, n_blocks=n_blocks)


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.double() - b.double()).abs().max())


def compare_hops(flow, prompt, tokens, streaming, *, prefix=None) -> tuple[list[float], list[int]]:
    """Each plan's mel: incremental (`flow_step`) vs re-solve (`flow_batch`); returns the max diffs
    and the committed tokens after each call (the stream's pool: the prefix's, else a new one)."""
    pool = prefix.state.est.pool if prefix is not None else new_pool(flow)
    s = Token2WavStream(flow, None, prompt, streaming, stream=True, incremental=True, voice_prefix=prefix,
                        flow_pool=pool)
    diffs, committed = [], []
    while not s.done:
        plan = s.next_plan(tokens.shape[1], lm_finished=True)
        ref = flow_batch(flow, [s.flow_item(tokens, plan)])[0]
        state = s.flow_state
        mel = flow_step(flow, state, tokens, plan)
        diffs.append(err(mel, ref))
        committed.append(state.n_tokens)
        s.advance(plan)
    return diffs, committed


def test_prompt_only_chunk_rule():
    """chunk c is prompt-only iff chunk·(c+1) + lookahead <= P."""
    for P in range(0, 130):
        want = sum(1 for c in range(P) if 25 * (c + 1) + 3 <= P)
        assert prompt_only_chunks(P, 25, 3) == want, P


@pytest.mark.parity
@pytest.mark.parametrize("use_prefix", [False, True], ids=["no_prefix", "prefix"])
@pytest.mark.parametrize("schedule", ["official", "unaligned"])
def test_streaming_hops_equal_resolve(flow, prompt, tokens, schedule, use_prefix):
    chunk = flow.dims.encoder.static_chunk_size
    P = prompt.tokens.shape[1]
    streaming = StreamingConfig() if schedule == "official" else unaligned_streaming(prompt, chunk)
    prefix = build_voice_prefix(flow, prompt.tokens, prompt.mel, prompt.embedding, new_pool(flow)) if use_prefix \
        else None
    if prefix is not None:
        assert prefix.n_tokens == chunk * prompt_only_chunks(P, chunk, flow.dims.pre_lookahead_len)
        assert prefix.n_frames == 2 * prefix.n_tokens > 0
    diffs, committed = compare_hops(flow, prompt, tokens, streaming, prefix=prefix)
    print(f"{schedule} prefix={use_prefix}: max diff per streaming hop {diffs[:-1]}, final {diffs[-1]}")
    assert max(diffs[:-1]) <= min(MEL_ATOL, FP32_TIGHT)
    assert diffs[-1] == 0.0  # the official final: today's re-solve itself
    assert all(c % chunk == 0 for c in committed[:-1])  # only whole chunks are committed
    plans = [p for p in _plans(prompt, tokens, streaming) if not p.finalize]
    ends = [P + p.n_tokens - flow.dims.pre_lookahead_len for p in plans]
    assert committed[:-1] == [e // chunk * chunk for e in ends]
    if schedule == "unaligned":
        assert ends[0] % chunk, "the first hop should end mid-chunk"


def _plans(prompt, tokens, streaming):
    s = Token2WavStream(None, None, prompt, streaming, stream=True)
    while not s.done:
        plan = s.next_plan(tokens.shape[1], lm_finished=True)
        yield plan
        s.advance(plan)


@pytest.mark.parity
@pytest.mark.parametrize("schedule", ["official", "unaligned"])
def test_streaming_hops_equal_resolve_float64(flow64, prompt, tokens, schedule):
    chunk = flow64.dims.encoder.static_chunk_size
    streaming = CAUSAL_FINAL if schedule == "official" \
        else unaligned_streaming(prompt, chunk, final_call="chunk_causal")
    for prefix in (None, build_voice_prefix(flow64, prompt.tokens, prompt.mel, prompt.embedding, new_pool(flow64))):
        diffs, _ = compare_hops(flow64, prompt, tokens, streaming, prefix=prefix)
        print(f"float64 {schedule} prefix={prefix is not None}: {diffs}")
        assert max(diffs) <= FP64_TIGHT


@pytest.mark.parity
def test_final_calls(flow, prompt, tokens):
    """Exact final (default) = today's call; the chunk-causal final is incremental and equals the
    re-solve of the same (streaming=True, finalize=True) call; its deviation from the official
    full-attention final is measured (random weights: large, see docs/precision.md)."""
    s = Token2WavStream(flow, None, prompt, CAUSAL_FINAL, stream=True, incremental=True, flow_pool=new_pool(flow))
    while (plan := s.next_plan(tokens.shape[1], lm_finished=True)) is not None and not plan.finalize:
        flow_step(flow, s.flow_state, tokens, plan)
        s.advance(plan)
    assert plan.streaming and plan.finalize
    state = s.flow_state
    start = state.n_frames
    mel = flow_step(flow, state, tokens, plan)
    assert state.finished and state.n_tokens == prompt.tokens.shape[1] + plan.n_tokens
    chunk_ref = flow_batch(flow, [s.flow_item(tokens, plan)])[0]
    official = flow_batch(flow, [FlowItem(tokens[:, : plan.n_tokens], prompt, False, True, plan.token_offset)])[0]
    dev = (mel - official).abs().max().item()
    rel_rms = ((mel - official).pow(2).mean().sqrt() / official.pow(2).mean().sqrt()).item()
    print(f"chunk-causal final: vs re-solve {err(mel, chunk_ref):.2e}; vs official full-attention final: "
          f"max {dev:.3e}, RMS {100 * rel_rms:.2f} % of the mel's RMS ({mel.shape[2]} frames, "
          f"computed from frame {start})")
    assert err(mel, chunk_ref) <= FP32_TIGHT
    assert dev > 0
    with pytest.raises(ValueError, match="final"):
        flow_step(flow, state, tokens, plan)
    # the default final: streaming=False, the full re-solve, bit-identical to today's path
    s = Token2WavStream(flow, None, prompt, StreamingConfig(), stream=True, incremental=True, flow_pool=new_pool(flow))
    while not (plan := s.next_plan(tokens.shape[1], lm_finished=True)).finalize:
        flow_step(flow, s.flow_state, tokens, plan)
        s.advance(plan)
    assert not plan.streaming
    assert torch.equal(flow_step(flow, s.flow_state, tokens, plan), flow_batch(flow, [s.flow_item(tokens, plan)])[0])


@pytest.mark.parity
def test_interleaved_streams_share_an_untouched_prefix(flow, prompt, tokens):
    """Streams of two voices (and two of the same voice, different tokens), advanced alternately,
    give exactly what each gives alone; the shared voice prefixes are never written."""
    pool = new_pool(flow)
    cache = PromptCache(max_bytes=1 << 30, pool=pool)
    voice_b = other_voice(prompt)
    jobs = [("a", prompt, tokens), ("a", prompt, tokens.flip(1)), ("b", voice_b, tokens)]

    def prefix_of(key, p):
        return cache.get(key, flow, p.tokens, p.mel, p.embedding)

    def snapshot(prefix) -> list[torch.Tensor]:  # the encoder stages' rows, the estimator's blocks and tails
        enc, up, est = prefix.state.stages
        return [pool.encoder.committed(0, est.table, enc.length), pool.encoder.committed(1, est.table, up.length),
                pool.kv[:, :, est.table].clone(), pool.tails[est.tail_slot].clone()]

    snapshots = {key: snapshot(prefix_of(key, p)) for key, p, _ in jobs}

    def new(key, p):
        return Token2WavStream(flow, None, p, CAUSAL_FINAL, stream=True, incremental=True,
                               voice_prefix=prefix_of(key, p), flow_pool=pool)

    alone = []
    for key, p, tok in jobs:
        s, mels = new(key, p), []
        while not s.done:
            plan = s.next_plan(tok.shape[1], lm_finished=True)
            mels.append(s.flow_mel(tok, plan))
            s.advance(plan)
        alone.append(mels)
    streams = [new(key, p) for key, p, _ in jobs]
    together = [[] for _ in jobs]
    while not all(s.done for s in streams):
        for s, (_, _, tok), out in zip(streams, jobs, together, strict=True):
            if not s.done:
                plan = s.next_plan(tok.shape[1], lm_finished=True)
                out.append(s.flow_mel(tok, plan))
                if not plan.finalize:  # a stream's blocks (all three stages' rows) are its own once extended
                    owned, shared = s.flow_state, s.voice_prefix.state
                    assert owned.est.table[: owned.est.n_shared] == shared.est.table  # read, never written
                    assert not set(owned.est.table[owned.est.n_shared:]) & set(shared.est.table)
                s.advance(plan)
    for a, b in zip(alone, together, strict=True):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert cache.stats.misses == 2 and len(cache) == 2
    for key, p, _ in jobs:
        assert all(torch.equal(a, b) for a, b in zip(snapshot(prefix_of(key, p)), snapshots[key], strict=True))


@pytest.mark.parity
def test_stream_audio_incremental_equals_resolve(flow, hift, prompt, golden, manifest):
    """Whole Token2WavStream output (stream.npz and e2e.npz stream tokens): incremental (with and
    without the voice prefix) vs the re-solve and vs the official goldens, README tolerances."""
    pool = new_pool(flow)
    prefix = build_voice_prefix(flow, prompt.tokens, prompt.mel, prompt.embedding, pool)
    cases = [(torch.from_numpy(golden("stream")["tokens"]).long(),
              [golden("stream")[f"stream_{i}_speech"] for i in range(len(manifest["stream_schedule"]))]),
             (torch.from_numpy(golden("e2e")["stream_llm_tokens"]).long(), None)]
    for tok, golden_chunks in cases:
        ref = _audio(flow, hift, prompt, tok, incremental=False)
        for voice_prefix in (None, prefix):
            inc = _audio(flow, hift, prompt, tok, incremental=True, voice_prefix=voice_prefix, pool=pool)
            assert [c.shape for c in inc] == [c.shape for c in ref]
            d = torch.cat(inc) - torch.cat(ref)
            print(f"audio incremental vs re-solve ({tok.shape[1]} tokens, prefix={voice_prefix is not None}): "
                  f"max {d.abs().max().item():.2e}, RMS {d.pow(2).mean().sqrt().item():.2e}")
            assert d.abs().max().item() <= AUDIO_MAX and d.pow(2).mean().sqrt().item() <= AUDIO_RMS
            for i, want in enumerate(golden_chunks or []):
                e = inc[i] - torch.from_numpy(want).reshape(-1)
                assert e.abs().max().item() <= AUDIO_MAX and e.pow(2).mean().sqrt().item() <= AUDIO_RMS, i


def _audio(flow, hift, prompt, tok, *, incremental: bool, voice_prefix=None, pool=None) -> list[torch.Tensor]:
    s = Token2WavStream(flow, hift, prompt, StreamingConfig(), stream=True, incremental=incremental,
                        voice_prefix=voice_prefix, flow_pool=pool)
    chunks = []
    while not s.done:
        chunks.append(run_chunk(s, tok, s.next_plan(tok.shape[1], lm_finished=True)))
    return chunks


@pytest.mark.parity
def test_prompt_cache_bounds_and_state_size(flow, prompt):
    voices = {"a": prompt, "b": other_voice(prompt), "c": other_voice(other_voice(prompt))}
    pool = new_pool(flow)
    cache = PromptCache(max_bytes=1 << 30, max_entries=2, pool=pool)
    for key in ("a", "b", "a", "c"):  # "b" is least recently used when "c" arrives
        p = voices[key]
        cache.get(key, flow, p.tokens, p.mel, p.embedding)
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions, len(cache)) == (1, 3, 1, 2)
    assert cache.get("a", flow, prompt.tokens, prompt.mel, prompt.embedding) is not None and cache.stats.hits == 2
    b = voices["b"]
    entry = cache.get("a", flow, b.tokens, b.mel, b.embedding)  # same key, another prompt: rebuilt
    assert cache.stats.misses == 4 and entry.matches(b.tokens, b.mel, b.embedding)
    prefix = build_voice_prefix(flow, prompt.tokens, prompt.mel, prompt.embedding, pool)
    assert prefix.n_frames > 0
    est = prefix.state.est  # its chunks exactly, in whole blocks, and its tail slot
    assert len(est.table) * pool.block_frames == prefix.n_frames
    assert est.nbytes == len(est.table) * pool.block_bytes + pool.tail_bytes
    enc_up = sum(s.nbytes for s in prefix.state.stages[:2])
    assert prefix.nbytes == enc_up + est.nbytes
    small = PromptCache(max_bytes=prefix.nbytes - 1, pool=pool)
    small.get("a", flow, prompt.tokens, prompt.mel, prompt.embedding)
    assert len(small) == 0  # larger than the bound: returned, not kept
    with pytest.raises(ValueError, match="another prompt"):
        FlowState(flow, b.tokens, b.mel, b.embedding, pool=pool, prefix=prefix)
    with pytest.raises(ValueError, match="same flow state pool"):
        FlowState(flow, prompt.tokens, prompt.mel, prompt.embedding, pool=new_pool(flow), prefix=prefix)


@pytest.mark.parity
def test_state_dtype_follows_flow_and_bad_calls(flow, prompt, tokens):
    half = copy.deepcopy(flow).half()
    s = Token2WavStream(half, None, prompt, StreamingConfig(), stream=True, incremental=True,
                        flow_pool=new_pool(half))
    plan = s.next_plan(tokens.shape[1], lm_finished=False)
    mel = s.flow_mel(tokens, plan)
    pool = s.flow_state.est.pool
    assert pool.kv.dtype == torch.float16 and all(kv.dtype == torch.float16 for kv in pool.encoder.kv)
    # the fp16 hop is the packed call, whose spread vs the fp16 re-solve is tolerances.py's (5.9e-3 here)
    assert err(mel, flow_batch(half, [s.flow_item(tokens, plan)])[0]) <= HALF_INCREMENTAL_ATOL
    state = s.flow_state
    s.advance(plan)
    with pytest.raises(ValueError, match="extend"):
        flow_step(half, state, tokens.flip(1), s.next_plan(tokens.shape[1], lm_finished=False))
    with pytest.raises(ValueError, match="committed"):
        flow_step(half, state, tokens, plan)  # the first hop again: its frames are committed
    with pytest.raises(ValueError, match="incremental"):
        Token2WavStream(flow, None, prompt, StreamingConfig(), stream=True, voice_prefix=object())
    with pytest.raises(ValueError, match="flow_pool"):
        Token2WavStream(flow, None, prompt, StreamingConfig(), stream=True, incremental=True)


def test_tiny_model_constant_hops(tiny_model_dir, golden):
    """The `make_model --size tiny` flow, 25-token hops over the e2e tokens: every hop equals the
    re-solve; prints the CPU time of both (informational, not asserted)."""
    flow = load_flow(tiny_model_dir / "flow.pt", load_hparams(tiny_model_dir).flow)
    f = golden("flow")
    prompt = FlowPrompt(torch.from_numpy(f["prompt_token"]).long(), torch.from_numpy(f["prompt_feat"]),
                        torch.from_numpy(f["embedding"]))
    tok = torch.from_numpy(golden("e2e")["stream_llm_tokens"]).long()
    chunk = flow.dims.encoder.static_chunk_size
    streaming = StreamingConfig(first_hop_tokens=chunk, hop_growth=1, max_hop_tokens=chunk)
    pool = new_pool(flow)
    s = Token2WavStream(flow, None, prompt, streaming, stream=True, incremental=True, flow_pool=pool,
                        voice_prefix=build_voice_prefix(flow, prompt.tokens, prompt.mel, prompt.embedding, pool))
    t_ref = t_inc = 0.0
    n_hops = 0
    while not (plan := s.next_plan(tok.shape[1], lm_finished=True)).finalize:
        t0 = time.perf_counter()
        ref = flow_batch(flow, [s.flow_item(tok, plan)])[0]
        t1 = time.perf_counter()
        mel = s.flow_mel(tok, plan)
        t_ref, t_inc = t_ref + t1 - t0, t_inc + time.perf_counter() - t1
        assert err(mel, ref) <= FP32_TIGHT
        n_hops += 1
        s.advance(plan)
    assert n_hops >= 2
    print(f"tiny model, {n_hops} hops of {chunk} tokens: re-solve {1e3 * t_ref / n_hops:.0f} ms/hop, "
          f"incremental {1e3 * t_inc / n_hops:.0f} ms/hop")
