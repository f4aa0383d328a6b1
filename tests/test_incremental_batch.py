"""Cross-stream batching of incremental hops (app/model/flow/incremental/batch.py: one packed call over the pool,
app/model/flow/incremental/packed.py) and the states' memory bound.

Interleaved streams with different voices, tokens and schedules (so different committed edges, new
frame counts and key lengths share one call) give, per hop, what each stream gives alone through
`flow_step`, and the re-solve's mel (`flow_batch` of FlowItems). Measured on this 2-core CPU (torch
2.13, parity fixture v1): see the printed max differences (fp32 batched vs alone, vs re-solve; fp64).
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_flow_incremental import err, other_voice, unaligned_streaming
from tolerances import FLOW_MEL_ATOL, HALF_INCREMENTAL_ATOL, INCREMENTAL_ATOL, INCREMENTAL_F64_ATOL, within

from app.config import StreamingConfig
from app.model.flow import CausalFlow, load_flow
from app.model.flow.incremental.batch import incremental_batch
from app.model.flow.incremental.paged import KVPool, PoolFull, blocks_needed, bytes_per_frame
from app.model.flow.incremental.state import build_voice_prefix, prepare_hop, prepare_hops
from app.model.flow_calls import IncrementalItem, flow_batch
from app.model.hparams import load_hparams
from app.model.token2wav import Token2WavStream, flow_step

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def flow(parity_model_dir) -> CausalFlow:
    return load_flow(parity_model_dir / "flow.pt", load_hparams(parity_model_dir).flow)


def _jobs(flow, prompt, tokens):
    """(voice, tokens, schedule, voice prefix) of three incremental streams that never line up: the official
    schedule with a prefix, the unaligned one on reversed tokens, a shorter second voice with 25-token
    hops and a chunk-causal final; every state in one pool of the flow's dtype (as served)."""
    chunk = flow.dims.encoder.static_chunk_size
    b = other_voice(prompt)
    pool = KVPool(flow, n_blocks=160)
    prefix = build_voice_prefix(flow, prompt.tokens, prompt.mel, prompt.embedding, pool=pool)
    return [(prompt, tokens, StreamingConfig(), prefix, pool),
            (prompt, tokens.flip(1), unaligned_streaming(prompt, chunk), None, pool),
            (b, tokens[:, : 2 * tokens.shape[1] // 3],
             StreamingConfig(first_hop_tokens=chunk, hop_growth=1, max_hop_tokens=chunk, final_call="chunk_causal"),
             None, pool)]


def _alone(flow, jobs) -> list[list[torch.Tensor]]:
    out = []
    for p, tok, streaming, prefix, pool in jobs:
        s, mels = Token2WavStream(flow, None, p, streaming, stream=True, incremental=True, voice_prefix=prefix,
                                  flow_pool=pool), []
        while not s.done:
            plan = s.next_plan(tok.shape[1], lm_finished=True)
            mels.append(flow_step(flow, s.flow_state, tok, plan) if plan.streaming else None)
            s.advance(plan)
        out.append(mels)
    return out


def _together(flow, jobs) -> tuple[list[list[torch.Tensor]], list[list[float]], list[int]]:
    """Every round, the streaming hops of all unfinished streams in one `flow_batch` of IncrementalItems;
    returns (mels per stream, max |diff| vs the re-solve per hop, batch sizes)."""
    streams = [Token2WavStream(flow, None, p, streaming, stream=True, incremental=True, voice_prefix=prefix,
                               flow_pool=pool) for p, _, streaming, prefix, pool in jobs]
    mels, vs_resolve, sizes = [[] for _ in jobs], [[] for _ in jobs], []
    while not all(s.done for s in streams):
        live = [(i, s, s.next_plan(jobs[i][1].shape[1], lm_finished=True)) for i, s in enumerate(streams) if not s.done]
        hops = [(i, s, plan) for i, s, plan in live if plan.streaming]
        items = [IncrementalItem(lambda s=s: s.flow_state, jobs[i][1][:, : plan.n_tokens], plan.finalize,
                                 plan.token_offset) for i, s, plan in hops]
        outs = flow_batch(flow, items) if items else []
        sizes.append(len(items))
        for (i, s, plan), mel in zip(hops, outs, strict=True):
            ref = flow_batch(flow, [s.flow_item(jobs[i][1], plan)])[0]
            mels[i].append(mel)
            vs_resolve[i].append(err(mel, ref))
        for i, s, plan in live:
            if not plan.streaming:
                mels[i].append(None)
            s.advance(plan)
    return mels, vs_resolve, sizes


def test_batched_hops_equal_alone_and_resolve(flow, prompt, tokens):
    jobs = _jobs(flow, prompt, tokens)
    alone = _alone(flow, jobs)
    together, vs_resolve, sizes = _together(flow, jobs)
    assert max(sizes) == 3 and len(set(sizes)) > 1, sizes  # all three share calls, then fewer remain
    vs_alone = []
    for a, b in zip(alone, together, strict=True):
        assert len(a) == len(b)
        vs_alone += [err(x, y) for x, y in zip(a, b, strict=True) if x is not None]
    worst = max(max(d) for d in vs_resolve)
    print(f"batched hops (batch sizes {sizes}): max |batched - alone| {max(vs_alone):.2e}, "
          f"max |batched - re-solve| {worst:.2e}")
    assert within(max(vs_alone), min(FLOW_MEL_ATOL, INCREMENTAL_ATOL), "vs alone")
    assert within(worst, min(FLOW_MEL_ATOL, INCREMENTAL_ATOL), "vs re-solve")


def test_batched_hops_float64(flow, prompt, tokens):
    flow64 = copy.deepcopy(flow).double()
    jobs = _jobs(flow64, prompt, tokens)
    alone = _alone(flow64, jobs)
    together, vs_resolve, _ = _together(flow64, jobs)
    d = max(err(x, y) for a, b in zip(alone, together, strict=True) for x, y in zip(a, b, strict=True)
            if x is not None)
    print(f"float64 batched hops: vs alone {d:.2e}, vs re-solve {max(max(v) for v in vs_resolve):.2e}")
    assert within(d, INCREMENTAL_F64_ATOL, "vs alone") and within(max(max(v) for v in vs_resolve),
                                                                   INCREMENTAL_F64_ATOL, "vs re-solve")


def test_batched_hops_float16(flow, prompt, tokens):
    """fp16 (the default's flow, the official vLLM mode): the packed call stays finite (every segment, padding
    too, has a visible key) and agrees with each stream alone and with the fp16 re-solve to within
    a few fp16 steps at the mel's magnitude (the fp16 path's own spread across call shapes)."""
    half = copy.deepcopy(flow).half()
    jobs = _jobs(half, prompt, tokens)
    alone = _alone(half, jobs)
    together, vs_resolve, _ = _together(half, jobs)
    pairs = [(x, y) for a, b in zip(alone, together, strict=True) for x, y in zip(a, b, strict=True) if x is not None]
    d = max(err(x, y) for x, y in pairs)
    rms = max(float((x - y).pow(2).mean().sqrt()) for x, y in pairs)
    assert all(torch.isfinite(m).all() for ms in together for m in ms if m is not None)
    worst = max(max(v) for v in vs_resolve)
    print(f"float16 batched hops: vs alone max {d:.2e} (RMS {rms:.2e}), vs re-solve {worst:.2e}")
    assert within(d, HALF_INCREMENTAL_ATOL, "vs alone") and within(worst, HALF_INCREMENTAL_ATOL, "vs re-solve")


def test_a_refused_hop_fails_alone(flow, prompt, tokens):
    """One stream's bad call (tokens that do not extend its state) comes back as its ValueError, its
    state untouched; the other stream of the same call gets its mel."""
    pool = KVPool(flow, n_blocks=64)
    a, b = (Token2WavStream(flow, None, prompt, StreamingConfig(), stream=True, incremental=True, flow_pool=pool)
            for _ in range(2))
    plan = a.next_plan(tokens.shape[1], lm_finished=False)
    flow_step(flow, a.flow_state, tokens, plan)
    a.advance(plan)
    n_before = a.flow_state.n_tokens
    nxt = a.next_plan(tokens.shape[1], lm_finished=False)
    first = b.next_plan(tokens.shape[1], lm_finished=False)
    outs = incremental_batch(flow, [a.flow_state, b.flow_state], [tokens.flip(1)[:, : nxt.n_tokens],
                             tokens[:, : first.n_tokens]], finalize=[False, False], token_offsets=[nxt.token_offset, 0])
    assert isinstance(outs[0], ValueError) and "extend" in str(outs[0])
    assert a.flow_state.n_tokens == n_before
    assert err(outs[1], flow_batch(flow, [b.flow_item(tokens, first)])[0]) <= INCREMENTAL_ATOL


def test_a_full_pool_refuses_one_stream_of_a_shared_encoder_pass(flow, prompt, tokens):
    """Two streams' first hops in one call (one encoder pass) over a pool that holds one of them: the first
    gets its mel, the second its `PoolFull` with its state and the pool untouched by it."""
    def first_hop(pool):
        s = Token2WavStream(flow, None, prompt, StreamingConfig(), stream=True, incremental=True, flow_pool=pool)
        return s, s.next_plan(tokens.shape[1], lm_finished=False)

    probe_pool = KVPool(flow, n_blocks=64)
    probe, plan = first_hop(probe_pool)
    incremental_batch(flow, [probe.flow_state], [tokens[:, : plan.n_tokens]], finalize=[False], token_offsets=[0])
    need = probe_pool.used_blocks
    pool = KVPool(flow, n_blocks=need)
    (a, _), (b, _) = first_hop(pool), first_hop(pool)
    b_before = b.flow_state.n_tokens
    outs = incremental_batch(flow, [a.flow_state, b.flow_state], [tokens[:, : plan.n_tokens]] * 2,
                             finalize=[False, False], token_offsets=[0, 0])
    assert isinstance(outs[1], PoolFull) and b.flow_state.n_tokens == b_before
    assert pool.used_blocks == need and pool.refused == 1
    assert err(outs[0], flow_batch(flow, [a.flow_item(tokens, plan)])[0]) <= INCREMENTAL_ATOL


@torch.no_grad()
def test_one_encoder_pass_equals_each_stream_alone(flow, prompt, tokens):
    """`prepare_hops` (one padded encoder pass for every stream) gives each stream the mu and leaves it the
    encoder state that its own `prepare_hop` does, in float64: streams of different new-token counts and
    committed edges, a final call (no look-ahead) beside streaming ones, and a refused call among them."""
    f64 = copy.deepcopy(flow).double()
    b = other_voice(prompt)
    causal_final = StreamingConfig(final_call="chunk_causal")  # an incremental final call
    plans = [(prompt, tokens, 1, False), (b, tokens.flip(1), 0, False), (prompt, tokens[:, :60], 1, True),
             (b, tokens, 1, False)]

    def streams():  # each stream advanced by `hops` alone passes first: different committed edges
        out, pool = [], KVPool(f64, n_blocks=96)
        for voice, tok, hops, _ in plans:
            s = Token2WavStream(f64, None, voice, causal_final, stream=True, incremental=True, flow_pool=pool)
            for _ in range(hops):
                p = s.next_plan(tok.shape[1], lm_finished=False)
                flow_step(f64, s.flow_state, tok, p)
                s.advance(p)
            out.append(s)
        return out

    def calls(ss):
        nxt = [s.next_plan(tok.shape[1], lm_finished=fin) for s, (_, tok, _, fin) in zip(ss, plans, strict=True)]
        toks = [tok[:, : p.n_tokens] for (_, tok, _, _), p in zip(plans, nxt, strict=True)]
        toks[3] = toks[3].flip(1)  # does not extend the tokens it started from: refused
        return [s.flow_state for s in ss], toks, [p.finalize for p in nxt], [p.token_offset for p in nxt]

    alone_ss, together_ss = streams(), streams()
    states, toks, fin, offs = calls(alone_ss)
    alone = []
    for st, t, fi, o in zip(states, toks, fin, offs, strict=True):
        try:
            alone.append(prepare_hop(f64, st, t, finalize=fi, token_offset=o))
        except ValueError as e:
            alone.append(e)
    states2, toks2, fin2, offs2 = calls(together_ss)
    assert fin2[2] and not any(fin2[:2]) and len({st.n_tokens for st in states2[:3]}) > 1
    together = prepare_hops(f64, states2, toks2, finalize=fin2, token_offsets=offs2)
    assert isinstance(alone[3], ValueError) and isinstance(together[3], ValueError)
    for a, t in zip(alone[:3], together[:3], strict=True):
        assert a.mu.shape == t.mu.shape and a.est_call.start == t.est_call.start
        assert err(a.mu, t.mu) <= INCREMENTAL_F64_ATOL, err(a.mu, t.mu)
        for stage, (ca, ct) in enumerate(zip(a.calls[:2], t.calls[:2], strict=True)):  # encoder keys/values, tails
            ca.finish()
            ct.finish()
            n = ca.state.length
            assert n == ct.state.length
            kv_a = a.state.est.pool.encoder.committed(stage, a.state.est.table, n)
            kv_t = t.state.est.pool.encoder.committed(stage, t.state.est.table, n)
            assert err(kv_a, kv_t) <= INCREMENTAL_F64_ATOL
            assert all(err(x, y) <= INCREMENTAL_F64_ATOL for sa, sb in zip(ca.state.tails, ct.state.tails, strict=True)
                       for x, y in zip(sa, sb, strict=True))


def test_state_memory_bound_and_dtype(flow, prompt, tokens):
    """A stream's state is whole pool blocks, at most what `blocks_needed` counted before the hop, plus its tail
    slot and conv tails: the encoder stages keep their keys/values in the same blocks as the estimator's frames
    (no buffer of their own); fp16 flows keep fp16 states. Prints bytes per committed frame."""
    for dtype in (torch.float32, torch.float16):
        f = copy.deepcopy(flow).to(dtype)
        pool = KVPool(f, n_blocks=64)
        s = Token2WavStream(f, None, prompt, StreamingConfig(), stream=True, incremental=True, flow_pool=pool)
        per_frame = []
        while not (plan := s.next_plan(tokens.shape[1], lm_finished=True)).finalize:
            need, before = blocks_needed(pool, s.flow_state_or_none, s.n_prompt + plan.n_tokens), pool.used_blocks
            s.flow_mel(tokens, plan)
            st = s.flow_state
            assert pool.used_blocks - before <= need and len(st.est.table) * pool.block_frames >= st.n_frames
            assert len(st.est.table) * pool.encoder.rows[0] >= st.n_tokens
            assert pool.kv.dtype == dtype and all(kv.dtype == dtype for kv in pool.encoder.kv)
            tails = sum(g.nbytes for g in st.stages[:2])
            assert st.nbytes == len(st.est.table) * pool.block_bytes + pool.tail_bytes + tails
            per_frame.append(st.nbytes / st.n_frames)
            s.advance(plan)
        print(f"{dtype}: bytes per committed frame after each hop {[round(b) for b in per_frame]} "
              f"(the pool's K/V alone: {bytes_per_frame(f):.0f})")
