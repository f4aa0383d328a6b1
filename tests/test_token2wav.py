"""Streaming token->wave against the official CosyVoice2Model.tts goldens (stream.npz, e2e.npz)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from t2w_chunks import run_chunk
from tolerances import BATCH_ATOL, BATCH_SOLVE_ATOL, FLOW_MEL_ATOL, PREFIX_ATOL, WAVE_MAX_ATOL, WAVE_RMS_ATOL, within

from app.config import StreamingConfig
from app.model.flow import CausalFlow
from app.model.flow_calls import FlowPrompt
from app.model.hift import HiFTGenerator, normalize_hift_state_dict
from app.model.hparams import load_hparams
from app.model.loader import load_strict
from app.model.token2wav import Token2WavStream

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def modules(parity_model_dir):
    hp = load_hparams(parity_model_dir)
    flow = CausalFlow(hp.flow)
    load_strict(flow, parity_model_dir / "flow.pt")
    hift = HiFTGenerator(hp.hift, nsf_noise=False)  # the goldens were made with zero NSF noise
    load_strict(hift, parity_model_dir / "hift.pt", transform=normalize_hift_state_dict)
    hift.remove_weight_norm()
    return flow.eval(), hift.eval()


def run_all(flow, hift, prompt, tokens: torch.Tensor, *, stream: bool, speed: float = 1.0,
            streaming: StreamingConfig | None = None):
    """Feed all tokens at once (the official vc path) and collect every chunk and plan (each through
    the pipeline's flow job and finish: `run_chunk`)."""
    s = Token2WavStream(flow, hift, prompt, streaming or StreamingConfig(), stream=stream, speed=speed)
    plans, chunks = [], []
    while not s.done:
        plan = s.next_plan(tokens.shape[1], lm_finished=True)
        plans.append(plan)
        chunks.append(run_chunk(s, tokens, plan))
    return plans, chunks


def assert_audio_close(ours: torch.Tensor, ref: np.ndarray, what: str) -> None:
    ref = torch.from_numpy(ref).reshape(-1)
    ours = ours.reshape(-1)
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    err = (ours - ref).abs()
    rms = err.pow(2).mean().sqrt().item()
    assert within(err.max(), WAVE_MAX_ATOL, f"{what} max") and within(rms, WAVE_RMS_ATOL, f"{what} rms"), what


def test_stream_schedule_and_chunks(modules, prompt, golden, manifest):
    flow, hift = modules
    g = golden("stream")
    tokens = torch.from_numpy(g["tokens"]).long()
    plans, chunks = run_all(flow, hift, prompt, tokens, stream=True)
    got = [(p.n_tokens, p.streaming, p.finalize) for p in plans]
    want = [(c["n_token"], c["streaming"], c["finalize"]) for c in manifest["stream_schedule"]]
    assert got == want
    assert [c.shape[0] for c in chunks] == [c["speech_len"] for c in manifest["stream_schedule"]]
    for i, chunk in enumerate(chunks):
        assert_audio_close(chunk, g[f"stream_{i}_speech"], f"stream chunk {i}")
    assert_audio_close(torch.cat(chunks), g["stream_speech_concat"], "stream concat")


def test_stream_flow_and_hift_inputs(modules, prompt, golden, manifest):
    """Stage by stage: the flow mel and the HiFT input mel of every chunk."""
    flow, hift = modules
    g = golden("stream")
    tokens = torch.from_numpy(g["tokens"]).long()
    s = Token2WavStream(flow, hift, prompt, StreamingConfig(), stream=True)
    for i in range(len(manifest["stream_schedule"])):
        plan = s.next_plan(tokens.shape[1], lm_finished=True)
        with torch.inference_mode():
            full = flow.inference(tokens[:, : plan.n_tokens], prompt.tokens, prompt.mel, prompt.embedding,
                                  streaming=plan.streaming, finalize=plan.finalize)
        assert within(np.abs(full.numpy() - g[f"stream_{i}_flow_mel"]).max(), FLOW_MEL_ATOL, f"flow mel {i}")
        hift_mel_before = s._mel_cache
        new_mel = s.flow_mel(tokens, plan)
        hift_in = new_mel if hift_mel_before is None else torch.cat([hift_mel_before, new_mel], dim=2)
        assert hift_in.shape == g[f"stream_{i}_hift_mel"].shape
        assert within(np.abs(hift_in.numpy() - g[f"stream_{i}_hift_mel"]).max(), FLOW_MEL_ATOL, f"hift mel {i}")
        s.vocode(new_mel, plan)
        s.advance(plan)
    assert s.done


def test_unaligned_small_first_hop(modules, prompt, golden):
    """streaming.first_hop_tokens = 10 with align_first_hop = false: the first chunk needs exactly
    10 + 3 look-ahead tokens (the official schedule adds the pad to a 25-token edge), later hops
    double and end on chunk edges; the chunks still add up to the same audio length, and the mel of
    the chunks wholly before the first cut equals the official first call's (block-causal masks)."""
    flow, hift = modules
    tokens = torch.from_numpy(golden("stream")["tokens"]).long()
    n_p = prompt.tokens.shape[1] - (prompt.tokens.shape[1] + 5) % 25  # the fixture prompt cut to pad 5
    assert n_p > 0 and n_p % 25 == 20
    prompt = FlowPrompt(tokens=prompt.tokens[:, :n_p], mel=prompt.mel[:, :2 * n_p], embedding=prompt.embedding)
    streaming = StreamingConfig(first_hop_tokens=10, align_first_hop=False)
    plans, chunks = run_all(flow, hift, prompt, tokens, stream=True, streaming=streaming)
    n = tokens.shape[1]
    want, offset, hop = [], 0, 10
    this = hop  # hops after the first grow from `hop` and are rounded to end on a chunk edge of n_p + generated
    while offset + this + 3 <= n:
        want.append(offset + this + 3)
        offset, hop = offset + this, min(100, 2 * hop)
        this = hop + -(n_p + offset + hop) % 25
    assert [p.n_tokens for p in plans] == [*want, n] and plans[-1].finalize
    assert all((n_p + p.n_tokens - 3) % 25 == 0 for p in plans[1:-1])
    _, ref_chunks = run_all(flow, hift, prompt, tokens, stream=True)
    assert sum(c.shape[0] for c in chunks) == sum(c.shape[0] for c in ref_chunks)
    official = Token2WavStream(flow, hift, prompt, StreamingConfig(), stream=True)
    first = official.next_plan(n, lm_finished=True)
    pad = -prompt.tokens.shape[1] % 25
    assert first.n_tokens == 25 + pad + 3 and official.prompt_pad == pad
    small = Token2WavStream(flow, hift, prompt, streaming, stream=True).flow_mel(tokens, plans[0])  # [1, 80, 20]
    full = official.flow_mel(tokens, first)
    edge = 2 * pad  # frames before the prompt's chunk edge: their chunk is whole in both calls
    assert pad == 5 and small.shape[2] == 20
    assert within((small[:, :, :edge] - full[:, :, :edge]).abs().max(), PREFIX_ATOL)
    assert (small[:, :, edge:] - full[:, :, edge:20]).abs().max() > FLOW_MEL_ATOL  # the cut chunk saw less


def test_nonstream_and_speed(modules, prompt, golden, manifest):
    flow, hift = modules
    g = golden("stream")
    tokens = torch.from_numpy(g["tokens"]).long()
    plans, chunks = run_all(flow, hift, prompt, tokens, stream=False)
    want = [(c["n_token"], c["finalize"]) for c in manifest["nonstream_schedule"]]
    assert [(p.n_tokens, p.finalize) for p in plans] == want
    assert_audio_close(chunks[0], g["nonstream_speech_concat"], "nonstream")
    _, fast = run_all(flow, hift, prompt, tokens, stream=False, speed=1.5)
    assert_audio_close(fast[0], g["speed15_speech"], "speed 1.5")


@pytest.mark.parametrize("kind", ["nonstream", "stream"])
def test_e2e_tokens_to_speech(modules, prompt, golden, manifest, kind):
    flow, hift = modules
    e = golden("e2e")
    tokens = torch.from_numpy(e[f"{kind}_llm_tokens"]).long()
    plans, chunks = run_all(flow, hift, prompt, tokens, stream=kind == "stream")
    want = [(c["n_token"], c["streaming"], c["finalize"]) for c in manifest[f"e2e_{kind}_schedule"]]
    assert [(p.n_tokens, p.streaming, p.finalize) for p in plans] == want
    assert [c.shape[0] for c in chunks] == e[f"{kind}_chunk_lens"].tolist()
    assert_audio_close(torch.cat(chunks), e[f"{kind}_speech"], f"e2e {kind}")


def test_interleaved_requests_match_solo(modules, prompt, golden):
    """Two streams advanced alternately give exactly the audio each gives alone."""
    flow, hift = modules
    g = golden("stream")
    tok_a = torch.from_numpy(g["tokens"]).long()
    tok_b = torch.flip(tok_a, dims=[1])[:, :100]
    prompt_b = FlowPrompt(tokens=prompt.tokens[:, :60], mel=prompt.mel[:, :120], embedding=-prompt.embedding)
    solo_a = torch.cat(run_all(flow, hift, prompt, tok_a, stream=True)[1])
    solo_b = torch.cat(run_all(flow, hift, prompt_b, tok_b, stream=True)[1])
    sa = Token2WavStream(flow, hift, prompt, StreamingConfig(), stream=True)
    sb = Token2WavStream(flow, hift, prompt_b, StreamingConfig(), stream=True)
    out_a, out_b = [], []
    # token arrival interleaved: each stream sees its tokens grow 10 at a time
    for n in range(10, max(tok_a.shape[1], tok_b.shape[1]) + 10, 10):
        for s, tok, out in ((sa, tok_a, out_a), (sb, tok_b, out_b)):
            avail = min(n, tok.shape[1])
            while (plan := s.next_plan(avail, lm_finished=avail == tok.shape[1])) is not None:
                out.append(run_chunk(s, tok, plan))
    assert sa.done and sb.done
    assert torch.equal(torch.cat(out_a), solo_a)
    assert torch.equal(torch.cat(out_b), solo_b)


def test_hop_does_not_leak_between_requests(modules, prompt, golden, manifest):
    """Upstream's bug: a second request started on the same model got a 100-token first hop."""
    flow, hift = modules
    tokens = torch.from_numpy(golden("stream")["tokens"]).long()
    first = run_all(flow, hift, prompt, tokens, stream=True)[0]
    second = run_all(flow, hift, prompt, tokens, stream=True)[0]
    want = [c["n_token"] for c in manifest["stream_schedule"]]
    assert [p.n_tokens for p in first] == [p.n_tokens for p in second] == want


def test_complementary_crossfade_option(modules, prompt, golden):
    flow, hift = modules
    tokens = torch.from_numpy(golden("stream")["tokens"]).long()
    streaming = StreamingConfig(crossfade="complementary")
    _, chunks = run_all(flow, hift, prompt, tokens, stream=True, streaming=streaming)
    _, official = run_all(flow, hift, prompt, tokens, stream=True)
    assert [c.shape for c in chunks] == [c.shape for c in official]
    assert torch.equal(chunks[0][:30000], official[0][:30000])  # before the first join: identical
    assert not torch.equal(torch.cat(chunks), torch.cat(official))


@pytest.mark.parametrize("streaming,finalize", [(True, False), (False, True)])
def test_batched_flow_equals_each_row_alone(modules, prompt, golden, streaming, finalize):
    """Rows of different prompt and token lengths in one flow call == each call alone (padding is masked)."""
    from app.model.flow_calls import FlowItem, flow_batch

    flow, _ = modules
    tokens = torch.from_numpy(golden("stream")["tokens"]).long()
    short = FlowPrompt(tokens=prompt.tokens[:, :20], mel=prompt.mel[:, :40], embedding=prompt.embedding.flip(1))
    items = [FlowItem(tokens[:, :31], prompt, streaming, finalize, token_offset=0),
             FlowItem(tokens[:, :56], short, streaming, finalize, token_offset=25),
             FlowItem(tokens[:, :13], short, streaming, finalize, token_offset=5)]
    batched = flow_batch(flow, items)
    for i, it in enumerate(items):
        alone = flow_batch(flow, [it])[0]
        assert batched[i].shape == alone.shape, (i, batched[i].shape, alone.shape)
        assert within((batched[i] - alone).abs().max(), BATCH_SOLVE_ATOL), i
    with pytest.raises(ValueError, match="same"):
        flow_batch(flow, [items[0], FlowItem(tokens[:, :31], prompt, not streaming, finalize, 0)])


@pytest.mark.parametrize("streaming,finalize", [(True, False), (False, True)])
def test_frames_padded_to_a_graph_bucket_give_the_same_mel(modules, prompt, golden, streaming, finalize):
    """engine.flow_cuda_graphs pads the solve's frames to a bucket (mask 0 after the valid frames) and a
    batch's rows to a power of two; the estimator is exact under right padding and rows never mix, so
    the mel equals the unpadded one (here: on the CPU, where
    the padding applies and the estimator runs eagerly; the graph replay itself is checked on a GPU by
    bench/gpu/flow_graphs.py)."""
    from app.model.flow.graphs import EstimatorGraphs
    from app.model.flow_calls import FlowItem, flow_batch

    flow, _ = modules
    tokens = torch.from_numpy(golden("stream")["tokens"]).long()
    graphs = EstimatorGraphs(flow.decoder["estimator"], bucket_frames=64)
    short = FlowPrompt(tokens=prompt.tokens[:, :20], mel=prompt.mel[:, :40], embedding=prompt.embedding.flip(1))
    items = [FlowItem(tokens[:, :31], prompt, streaming, finalize, token_offset=0),
             FlowItem(tokens[:, :56], short, streaming, finalize, token_offset=25)]
    padded_any = False
    for it in items:
        frames = 2 * (it.prompt.tokens.shape[1] + it.tokens.shape[1] - (0 if finalize else 3))
        padded_any |= graphs.padded_length(frames) > frames
        exact, padded = flow_batch(flow, [it])[0], flow_batch(flow, [it], graphs=graphs)[0]
        assert padded.shape == exact.shape
        assert within((padded - exact).abs().max(), BATCH_ATOL, "frames padded")
    assert padded_any
    steps = flow.dims.n_timesteps
    assert (graphs.stats.eager, graphs.stats.captures, graphs.stats.replays) == (2 * steps, 0, 0)  # CPU: no graphs
    pad = 64 - 300 % 64  # rows of a batched solve padded the same way (what `solve` does with graphs)
    mu, cond = torch.randn(2, 80, 300, generator=torch.Generator().manual_seed(1)).split(1)
    spks, mask = torch.randn(1, 80), torch.ones(1, 1, 300)
    exact = flow.solve(mu, mask, spks, cond, streaming)
    padded = flow.solve(mu, mask, spks, cond, streaming, graphs)
    assert graphs.padded_length(300) == 300 + pad and within((exact - padded).abs().max(), BATCH_ATOL, "solve padded")
    # a batch of 3 pads its rows to 4 (copies of the last row) and its frames to the bucket
    items.append(FlowItem(tokens[:, :40], short, streaming, finalize, token_offset=0))
    assert graphs.padded_rows(3) == 4 and graphs.padded_rows(16) == 16 and graphs.padded_rows(1) == 1
    batched, batched_g = flow_batch(flow, items), flow_batch(flow, items, graphs=graphs)
    assert graphs.stats.eager == 4 * steps
    for a, b in zip(batched, batched_g, strict=True):
        assert a.shape == b.shape and within((a - b).abs().max(), BATCH_ATOL, "rows padded")
