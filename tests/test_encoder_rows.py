"""The incremental encoder's keys/values in the pool's blocks (app/model/flow/incremental/encoder_rows.py): one
batched pass writes exactly its streams' new positions, in their own blocks (never a voice prefix's shared
blocks, never the pad block), and a full pool refuses a stream before its encoder runs."""

from __future__ import annotations

import pytest
import torch
from test_flow_incremental import other_voice

from app.config import StreamingConfig
from app.model.flow import load_flow
from app.model.flow.incremental.encoder_rows import flat_rows
from app.model.flow.incremental.paged import PAD_BLOCK, KVPool, PoolFull
from app.model.flow.incremental.state import build_voice_prefix, prepare_hops
from app.model.hparams import load_hparams
from app.model.token2wav import Token2WavStream, flow_step

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def flow(parity_model_dir):
    return load_flow(parity_model_dir / "flow.pt", load_hparams(parity_model_dir).flow)


def _streams(flow, prompt, tokens, pool):
    """Three streams one hop in: two of one voice from its shared prefix, one of another voice without."""
    prefix = build_voice_prefix(flow, prompt.tokens, prompt.mel, prompt.embedding, pool)
    jobs = [(prompt, tokens, prefix), (prompt, tokens.flip(1), prefix), (other_voice(prompt), tokens, None)]
    out = []
    for voice, tok, pre in jobs:
        s = Token2WavStream(flow, None, voice, StreamingConfig(), stream=True, incremental=True, voice_prefix=pre,
                            flow_pool=pool)
        plan = s.next_plan(tok.shape[1], lm_finished=False)
        flow_step(flow, s.flow_state, tok, plan)
        s.advance(plan)
        out.append((s, tok))
    return out, prefix


@torch.inference_mode()
def test_a_batched_pass_writes_only_its_streams_new_positions(flow, prompt, tokens):
    pool = KVPool(flow, n_blocks=96)
    streams, prefix = _streams(flow, prompt, tokens, pool)
    plans = [s.next_plan(tok.shape[1], lm_finished=False) for s, tok in streams]
    before = [kv.clone() for kv in pool.encoder.kv]
    starts = [(s.flow_state.enc.length, s.flow_state.up.length) for s, _ in streams]
    hops = prepare_hops(flow, [s.flow_state for s, _ in streams], [tok[:, : p.n_tokens] for (_, tok), p in
                                                                    zip(streams, plans, strict=True)],
                        finalize=[False] * 3, token_offsets=[p.token_offset for p in plans])
    assert not any(isinstance(h, Exception) for h in hops)
    up = flow.encoder.up_layer.stride
    for stage, (kv, old, rows) in enumerate(zip(pool.encoder.kv, before, pool.encoder.rows, strict=True)):
        allowed = torch.zeros(kv.shape[2], dtype=torch.bool)
        for (s, _), p, start in zip(streams, plans, starts, strict=True):
            end = (p.n_tokens + s.n_prompt - flow.dims.pre_lookahead_len) * (up if stage else 1)
            allowed[flat_rows(s.flow_state.est.table, rows, end)[start[stage]:]] = True
        # [rows]: any byte of any layer's K/V differs (bytes: untouched rows are uninitialised, NaN != NaN)
        changed = (kv.view(torch.uint8) != old.view(torch.uint8)).flatten(3).any(-1).any(0).any(0)
        assert changed.any() and not (changed & ~allowed).any(), "a write outside the streams' new positions"
        shared = flat_rows(prefix.state.est.table, rows, prefix.n_frames // (1 if stage else up))
        assert not allowed[shared].any(), "a stream's new positions fell in the voice prefix's shared blocks"
        assert not kv[:, :, PAD_BLOCK * rows : (PAD_BLOCK + 1) * rows].any(), "the pad block was written"
    for s, _ in streams:
        s.flow_state.release()


@torch.inference_mode()
def test_a_full_pool_refuses_before_the_encoder_runs(flow, prompt, tokens):
    pool = KVPool(flow, n_blocks=48)
    streams, _ = _streams(flow, prompt, tokens, pool)
    pool.allocate(pool.free_blocks)  # nothing left for anyone's next blocks
    plans = [s.next_plan(tok.shape[1], lm_finished=False) for s, tok in streams]
    before = [kv.clone() for kv in pool.encoder.kv]
    hops = prepare_hops(flow, [s.flow_state for s, _ in streams], [tok[:, : p.n_tokens] for (_, tok), p in
                                                                    zip(streams, plans, strict=True)],
                        finalize=[False] * 3, token_offsets=[p.token_offset for p in plans])
    assert all(isinstance(h, PoolFull) for h in hops), hops
    assert all(torch.equal(kv.view(torch.uint8), old.view(torch.uint8))  # bytes: the pool is uninitialised
               for kv, old in zip(pool.encoder.kv, before, strict=True)), "an encoder ran"
