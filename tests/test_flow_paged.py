"""The paged state pool of the incremental flow (app/model/flow/incremental/paged.py) and its static-shape solve
(app/model/flow/incremental/paged_solve.py): equal to the re-solve within the fixture README's tolerances, on
interleaved streams, with a voice's prompt blocks shared by reference, through pool exhaustion (the
re-solve takes over, same mel) and streams ending mid-pool. The CUDA graph capture of the same
static-shape solve runs only where CUDA is (the padded/bucketed eager path it captures is tested here).
"""

from __future__ import annotations

import pytest
import torch
from test_flow_incremental import CAUSAL_FINAL, err, other_voice, unaligned_streaming
from tolerances import FLOW_MEL_ATOL, INCREMENTAL_ATOL, within

from app.config import StreamingConfig
from app.model.flow import CausalFlow, load_flow
from app.model.flow.incremental.batch import incremental_batch
from app.model.flow.incremental.packed import pack, packed_solve
from app.model.flow.incremental.paged import KVPool, PoolFull, bytes_per_frame
from app.model.flow.incremental.paged_graphs import PagedGraphs
from app.model.flow.incremental.state import build_voice_prefix, prepare_hop
from app.model.flow_calls import IncrementalItem, flow_batch
from app.model.hparams import load_hparams
from app.model.token2wav import Token2WavStream, flow_step

pytestmark = pytest.mark.parity
TOL = min(FLOW_MEL_ATOL, INCREMENTAL_ATOL)


@pytest.fixture(scope="module")
def flow(parity_model_dir) -> CausalFlow:
    return load_flow(parity_model_dir / "flow.pt", load_hparams(parity_model_dir).flow)


def _run(flow, prompt, tokens, streaming, pool, prefix=None) -> tuple[list[float], Token2WavStream]:
    """Every streaming hop through the pool vs the re-solve; returns the max diffs and the stream."""
    s = Token2WavStream(flow, None, prompt, streaming, stream=True, incremental=True, voice_prefix=prefix,
                        flow_pool=pool)
    diffs = []
    while not s.done:
        plan = s.next_plan(tokens.shape[1], lm_finished=True)
        if plan.streaming:
            ref = flow_batch(flow, [s.flow_item(tokens, plan)])[0]
            diffs.append(err(flow_step(flow, s.flow_state, tokens, plan), ref))
        s.advance(plan)
    return diffs, s


@pytest.mark.parametrize("schedule", ["official", "unaligned", "chunk_causal_final"])
def test_paged_hops_equal_resolve(flow, prompt, tokens, schedule):
    chunk = flow.dims.encoder.static_chunk_size
    streaming = {"official": StreamingConfig(), "unaligned": unaligned_streaming(prompt, chunk),
                 "chunk_causal_final": CAUSAL_FINAL}[schedule]
    pool = KVPool(flow, n_blocks=64)
    diffs, s = _run(flow, prompt, tokens, streaming, pool)
    print(f"paged {schedule}: max |paged - re-solve| per hop {[f'{d:.1e}' for d in diffs]}")
    assert within(max(diffs), TOL, "paged vs re-solve")
    assert s.flow_state_or_none is None and pool.used_blocks == 0  # the final call gave every block back


def test_shared_prompt_blocks(flow, prompt, tokens):
    """Two streams of one voice start from one prefix: its blocks are computed once and referenced by
    both (no copy), each stream's own blocks follow them, and every count is back to 0 at the end."""
    pool = KVPool(flow, n_blocks=64)
    prefix = build_voice_prefix(flow, prompt.tokens, prompt.mel, prompt.embedding, pool=pool)
    shared = list(prefix.state.est.table)
    assert len(shared) == prefix.n_frames // flow.dims.estimator.static_chunk_size > 0
    assert pool.used_blocks == len(shared) and all(pool.refcount(b) == 1 for b in shared)
    a, b = (Token2WavStream(flow, None, prompt, StreamingConfig(), stream=True, incremental=True,
                            voice_prefix=prefix, flow_pool=pool) for _ in range(2))
    plans = [s.next_plan(tokens.shape[1], lm_finished=False) for s in (a, b)]
    outs = [flow_step(flow, s.flow_state, tokens, p) for s, p in zip((a, b), plans, strict=True)]
    assert all(pool.refcount(x) == 3 for x in shared)
    for s in (a, b):
        assert s.flow_state.est.table[: len(shared)] == shared
        assert s.flow_state.nbytes < (len(s.flow_state.est.table) - len(shared) + 1) * pool.block_bytes
    ref = flow_batch(flow, [a.flow_item(tokens, plans[0])])[0]
    assert within(max(err(o, ref) for o in outs), TOL, "shared-prefix hops vs re-solve")
    a.drop_flow_state()
    assert all(pool.refcount(x) == 2 for x in shared)
    b.drop_flow_state()
    b.drop_flow_state()  # idempotent (the stream's finally may call it again)
    assert all(pool.refcount(x) == 1 for x in shared) and pool.used_blocks == len(shared)
    prefix.release()  # the prompt cache evicts the voice
    assert all(pool.refcount(x) == 0 for x in shared) and pool.used_blocks == 0


def test_interleaved_streams_batched_over_the_pool(flow, prompt, tokens):
    """Three streams (two voices, different schedules, one from a shared prefix) advance together;
    every round's hops share one static-shape solve and each equals its re-solve. One stream ends
    early (dropped mid-utterance): its blocks go back while the others keep going."""
    chunk = flow.dims.encoder.static_chunk_size
    pool = KVPool(flow, n_blocks=96)
    prefix = build_voice_prefix(flow, prompt.tokens, prompt.mel, prompt.embedding, pool=pool)
    jobs = [(prompt, tokens, StreamingConfig(), prefix),
            (prompt, tokens.flip(1), unaligned_streaming(prompt, chunk), None),
            (other_voice(prompt), tokens[:, : 2 * tokens.shape[1] // 3],
             StreamingConfig(first_hop_tokens=chunk, hop_growth=1, max_hop_tokens=chunk, final_call="chunk_causal"),
             None)]
    streams = [Token2WavStream(flow, None, p, o, stream=True, incremental=True, voice_prefix=pre, flow_pool=pool)
               for p, _, o, pre in jobs]
    diffs, sizes, rounds = [], [], 0
    while not all(s.done for s in streams):
        rounds += 1
        if rounds == 3:  # stream 1 stops (client gone): its finally drops the state
            used = pool.used_blocks
            own = len(streams[1].flow_state.est.table)
            streams[1].drop_flow_state()
            streams[1].done = True
            assert pool.used_blocks == used - own
        live = [(i, s, s.next_plan(jobs[i][1].shape[1], lm_finished=True)) for i, s in enumerate(streams) if not s.done]
        hops = [(i, s, p) for i, s, p in live if p.streaming]
        items = [IncrementalItem(lambda s=s: s.flow_state, jobs[i][1][:, : p.n_tokens], p.finalize, p.token_offset)
                 for i, s, p in hops]
        outs = flow_batch(flow, items) if items else []
        sizes.append(len(items))
        for (i, s, p), mel in zip(hops, outs, strict=True):
            diffs.append(err(mel, flow_batch(flow, [s.flow_item(jobs[i][1], p)])[0]))
        for _, s, p in live:
            s.advance(p)
    print(f"paged interleaved (batch sizes {sizes}): max |paged - re-solve| {max(diffs):.2e}")
    assert max(sizes) == 3 and within(max(diffs), TOL, "paged batched vs re-solve")
    assert pool.used_blocks == len(prefix.state.est.table)  # only the voice's prefix is left
    prefix.release()
    assert pool.used_blocks == 0


def test_pool_exhaustion_falls_back_to_resolve(flow, prompt, tokens):
    """A pool too small for the next hop refuses it with `PoolFull` (nothing taken, state unchanged);
    the stream then re-solves and its mel equals the re-solve's."""
    pool = KVPool(flow, n_blocks=7)
    s = Token2WavStream(flow, None, prompt, StreamingConfig(), stream=True, incremental=True, flow_pool=pool)
    fell_back, diffs = False, []
    while not s.done:
        plan = s.next_plan(tokens.shape[1], lm_finished=True)
        ref = flow_batch(flow, [s.flow_item(tokens, plan)])[0]
        if plan.streaming and not fell_back:
            used, n_before = pool.used_blocks, s.flow_state.n_tokens
            (mel,) = incremental_batch(flow, [s.flow_state], [tokens[:, : plan.n_tokens]],
                                       finalize=[plan.finalize], token_offsets=[plan.token_offset])
            if isinstance(mel, PoolFull):  # as the pipeline does: drop the state, re-solve from now on
                assert pool.used_blocks == used and s.flow_state.n_tokens == n_before
                s.drop_flow_state()
                fell_back = True
                mel = flow_batch(flow, [s.flow_item(tokens, plan)])[0]
        else:
            mel = flow_batch(flow, [s.flow_item(tokens, plan)])[0]
        diffs.append(err(mel, ref))
        s.advance(plan)
    assert fell_back and pool.refused >= 1 and pool.used_blocks == 0
    assert within(max(diffs), TOL, "fallback vs re-solve")


@torch.inference_mode()
def test_bucketed_static_solve_equals_tight(flow, prompt, tokens):
    """The padded shapes a CUDA graph captures (more streams, frames, keys and segments than the call
    needs) give the tight call's frames (the eager path graphs replay; on CPU no capture is made)."""
    pool = KVPool(flow, n_blocks=64)
    outs = []
    for pad in (False, True):
        s = Token2WavStream(flow, None, prompt, StreamingConfig(), stream=True, incremental=True, flow_pool=pool)
        mels = []
        while not (plan := s.next_plan(tokens.shape[1], lm_finished=True)).finalize:
            hop = prepare_hop(flow, s.flow_state, tokens[:, : plan.n_tokens], finalize=False,
                              token_offset=plan.token_offset)
            c = hop.est_call
            kw = {"streams": 4, "frames": c.end - c.start + 120, "keys": c.end + 150} if pad else {}
            inp = pack(flow, pool, [c], [hop.mu], [hop.cond], [s.flow_state.spks], **kw)
            x = packed_solve(flow, pool, inp)
            assert torch.isfinite(x).all()
            mels.append(hop.commit(x[:, :, : c.end - c.start].float()))
            s.advance(plan)
        s.drop_flow_state()
        outs.append(mels)
    d = max(err(a, b) for a, b in zip(*outs, strict=True))
    print(f"bucketed (4 streams, +120 frames, +150 keys) vs tight: {d:.2e}")
    assert within(d, TOL, "bucketed vs tight") and pool.used_blocks == 0
    assert PagedGraphs.available(pool) == torch.cuda.is_available()


def test_bytes_per_frame(flow):
    """Pool bytes per committed frame = the K/V formulas: the estimator's layers x K/V x heads x d_head x Euler
    evaluations x CFG rows, and the encoder's (token-stage layers / 2 + frame-stage layers) x K/V x its width,
    fp32 and fp16."""
    pool = KVPool(flow, n_blocks=1)
    chunk = flow.dims.estimator.static_chunk_size
    assert pool.block_bytes == bytes_per_frame(flow) * chunk
    e, enc = flow.dims.estimator, flow.dims.encoder
    per = e.n_blocks * (e.num_mid_blocks + 2) * 2 * e.num_heads * e.attention_head_dim * flow.dims.n_timesteps * 2
    per += (enc.num_blocks + 2 * enc.num_up_blocks) * enc.output_size  # K/V of a token (2 frames) + of a frame
    assert bytes_per_frame(flow) == per * 4 and bytes_per_frame(flow, torch.float16) == per * 2
    print(f"pool bytes per frame on the fixture flow: {bytes_per_frame(flow):.0f} fp32, "
          f"{bytes_per_frame(flow, torch.float16):.0f} fp16; tail slot {pool.tail_bytes} B per stream")


def test_prompt_cache_hit_holds_its_blocks_before_a_racing_discard(flow, prompt):
    """A hit and a racing `discard` (an eviction takes the same path): the discard waits for the cache's
    lock until the stream started from the entry holds its own references, so the prefix's blocks never
    go back to the pool while the stream reads them (before, the stream's start came after the lock)."""
    import threading

    from app.model.flow.incremental.prompt_cache import PromptCache

    pool = KVPool(flow, n_blocks=32)
    cache = PromptCache(max_bytes=1 << 40, pool=pool)
    cache.get("a", flow, prompt.tokens, prompt.mel, prompt.embedding)  # cached: the cache's references
    s = Token2WavStream(flow, None, prompt, StreamingConfig(), stream=True, incremental=True, flow_pool=pool)
    racer, blocks = threading.Thread(target=cache.discard, args=("a",)), []

    def begin(prefix):
        blocks.extend(prefix.state.est.table)
        racer.start()  # the discard, between this hit finding the entry and the stream's start
        racer.join(0.2)
        assert racer.is_alive()  # it waits for the lock
        s.voice_prefix = prefix
        return s.flow_state

    state = cache.start("a", flow, prompt.tokens, prompt.mel, prompt.embedding, begin)
    racer.join()
    assert blocks and len(cache) == 0 and cache.stats.hits == 1
    assert all(pool.refcount(x) == 1 for x in blocks)  # the stream's own references, nothing freed
    assert state.est.table[: len(blocks)] == blocks
    s.drop_flow_state()
    assert pool.used_blocks == 0


def test_prompt_cache_eviction_gives_pooled_blocks_back(flow, prompt):
    """A prompt cache on the pool: an evicted voice drops its references; its blocks go back to the pool
    only once the stream started from it ends (the stream keeps reading them meanwhile)."""
    from app.model.flow.incremental.prompt_cache import PromptCache

    pool = KVPool(flow, n_blocks=32)
    a, b = prompt, other_voice(prompt)
    one = build_voice_prefix(flow, a.tokens, a.mel, a.embedding, pool=pool)
    cache = PromptCache(max_bytes=int(1.5 * one.nbytes), pool=pool)
    one.release()
    first = cache.get("a", flow, a.tokens, a.mel, a.embedding)
    s = Token2WavStream(flow, None, a, StreamingConfig(), stream=True, incremental=True, voice_prefix=first,
                        flow_pool=pool)
    s.flow_state  # noqa: B018  (the stream starts from the prefix: one more reference per block)
    blocks = list(first.state.est.table)
    cache.get("b", flow, b.tokens, b.mel, b.embedding)  # over max_bytes: "a" is evicted
    assert cache.stats.evictions == 1 and len(cache) == 1
    assert all(pool.refcount(x) == 1 for x in blocks)  # the stream's references only
    s.drop_flow_state()
    assert all(pool.refcount(x) == 0 for x in blocks)
    cache.clear()
    assert pool.used_blocks == 0


def test_flow_work_counts_the_shapes_computed(flow, prompt, tokens):
    """`FlowWork` (the bench's achieved TFLOP/s and padding waste): per frame 2 FLOPs per per-frame
    weight (CosyVoice2-0.5B: 132.2 MFLOP, the research's count) and 4 x 512 x 56 per visible key; two
    streams' first paged hops in one packed call count exactly their own frames (no padding) and each
    chunk's queries over its visible keys; a one-row re-solve computes only what it needs."""
    from app.model.flow.estimator import CausalConditionalDecoder
    from app.model.flow.work import FlowWork, flop_rates
    from app.model.hparams import EstimatorDims

    full = EstimatorDims(in_channels=320, out_channels=80, channels=(256,), attention_head_dim=64, n_blocks=4,
                         num_mid_blocks=12, num_heads=8, static_chunk_size=50, num_decoding_left_chunks=-1)
    with torch.device("meta"):
        assert flop_rates(CausalConditionalDecoder(full)) == (132_161_536.0, 114_688.0)
    chunk, block = flow.dims.encoder.static_chunk_size, flow.dims.estimator.static_chunk_size
    work, ref = FlowWork.of(flow), FlowWork.of(flow)
    lin, att = work.linear_flop, work.attention_flop
    pool = KVPool(flow, n_blocks=32)
    jobs = [(prompt, tokens, StreamingConfig()),
            (other_voice(prompt), tokens.flip(1), unaligned_streaming(prompt, chunk))]
    streams = [Token2WavStream(flow, None, p, o, stream=True, incremental=True, flow_pool=pool) for p, _, o in jobs]
    plans = [s.next_plan(t.shape[1], lm_finished=True) for s, (_, t, _) in zip(streams, jobs, strict=True)]
    items = [IncrementalItem(lambda s=s: s.flow_state, t[:, : p.n_tokens], p.finalize, p.token_offset)
             for s, (_, t, _), p in zip(streams, jobs, plans, strict=True)]
    outs = flow_batch(flow, items, work=work)
    n = [p.mel.shape[1] + o.shape[2] for (p, _, _), o in zip(jobs, outs, strict=True)]  # from frame 0: the prompt's too
    pairs = sum(min(block, m - c) * min(m, c + block) for m in n for c in range(0, m, block))  # block-causal
    assert (work.calls, work.frames_computed, work.frames_needed) == (1, sum(n), sum(n))
    assert work.flop == pytest.approx(2 * flow.dims.n_timesteps * (sum(n) * lin + pairs * att))
    flow_batch(flow, [streams[0].flow_item(tokens, plans[0])], work=ref)
    assert ref.frames_needed == ref.frames_computed == n[0] and ref.snapshot()["tflop"] > 0
    for s in streams:
        s.drop_flow_state()
    assert pool.used_blocks == 0


def test_a_taken_block_is_zeroed_and_no_other(flow):
    """A block's unwritten positions are read behind the mask with weight 0, so they must be finite: `allocate`
    zeroes the blocks it gives (in one op) and leaves every other block as it was."""
    pool = KVPool(flow, n_blocks=6)
    first = pool.allocate(3)
    pool.kv.fill_(float("nan"))  # what a released block may hold
    pool.release(first)
    taken = pool.allocate(2)
    assert not pool.allocate(0)
    for b in range(pool.kv.shape[2]):
        block = pool.kv[:, :, b]
        assert (block == 0).all() if b in taken else block.isnan().all(), b
