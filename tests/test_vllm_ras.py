"""RAS as a vLLM logits processor: exact math vs `ras_distribution`, batch bookkeeping, the lm_head
bias it adds, engine.

The fast tests need torch only (plus vLLM's own BatchUpdate classes where installed); the
engine tests run the real vLLM CPU engine (vLLM's own Qwen2ForCausalLM, no plugin) on the tiny
model and check the logits and the per-step distribution along real trajectories against the
PyTorch reference.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from app.model.ras_batch import EXTRA_ARGS_KEY, RASBatch, RASParams, ras_log_probs
from app.model.sampling import ras_distribution

VOCAB, N_VALID, EOS = 6592, 6564, 6561


def _logp_rows(n_rows: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    """Engine-like logits `[R, 6592]`: log-probabilities over 6564 ids, padded columns low."""
    g = torch.Generator().manual_seed(seed)
    x = torch.full((n_rows, VOCAB), -1e4)
    x[:, :N_VALID] = (torch.randn(n_rows, N_VALID, generator=g) * scale).log_softmax(dim=-1)
    return x


def _reference(row: torch.Tensor, out: list[int], p: RASParams) -> torch.Tensor:
    """`ras_distribution` on the row's first n_valid ids, eos banned as `SpeechLM.next_token` does."""
    logp = row[: p.n_valid].clone()
    if len(out) < p.min_tokens:
        logp[p.eos] = -float("inf")
    ref = ras_distribution(logp, out, top_p=p.top_p, top_k=p.top_k, win_size=p.win_size, tau_r=p.tau_r)
    return torch.cat([ref, torch.zeros(row.numel() - p.n_valid, dtype=ref.dtype)])


def _check_rows(logits: torch.Tensor, params: list[RASParams], outs: list[list[int]], *,
                dtype: torch.dtype = torch.float64, atol: float = 1e-15, rtol: float = 1e-13) -> None:
    batch = RASBatch.build(params)
    hist, ban = batch.history(outs, "cpu")
    got = ras_log_probs(logits, batch, hist, ban, dtype).double().exp()
    for r, (p, out) in enumerate(zip(params, outs, strict=True)):
        ref = _reference(logits[r], out, p)
        assert torch.equal(got[r] > 0, ref > 0), f"row {r}: support differs"
        torch.testing.assert_close(got[r], ref, atol=atol, rtol=rtol, msg=f"row {r}")


SETTINGS = [  # top_p, top_k, win_size, tau_r, min_tokens
    (0.8, 25, 10, 0.1, 0),  # the official yaml
    (0.8, 25, 10, 0.1, 50),  # eos banned
    (0.5, 25, 10, 0.1, 0),
    (0.95, 40, 10, 0.2, 0),  # a repeat needs 2 hits
    (1.0, 25, 5, 0.1, 0),
    (0.8, 3, 10, 0.1, 0),
    (0.3, 25, 20, 0.1, 0),
    (0.99, 100, 10, 0.35, 0),  # 4 hits
]


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])  # flat, mid, peaked distributions
def test_batched_equals_reference_row_by_row(scale: float) -> None:
    logits = _logp_rows(len(SETTINGS) * 3, seed=int(scale * 10), scale=scale)
    params, outs = [], []
    for r in range(logits.shape[0]):
        top = logits[r, :N_VALID].topk(40).indices.tolist()
        kind = r % 3  # no history / repeats of likely ids / random ids without repeats
        out = [] if kind == 0 else [top[i % 6] for i in range(r + 3)] if kind == 1 else list(range(100, 100 + r))
        params.append(RASParams(*SETTINGS[r // 3]))
        outs.append(out)
    _check_rows(logits, params, outs)
    # float32 (the engine's setting): relative error of a float32 mixture
    _check_rows(logits, params, outs, dtype=torch.float32, atol=1e-7, rtol=5e-6)


def test_repeats_and_eos_change_the_distribution() -> None:
    logits = _logp_rows(1, seed=3)
    best = int(logits[0, :N_VALID].argmax())
    p = RASParams(min_tokens=2)
    batch = RASBatch.build([p])
    fresh = ras_log_probs(logits, batch, *batch.history([[]], "cpu"), torch.float64).exp()[0]
    again = ras_log_probs(logits, batch, *batch.history([[best, 7, 9]], "cpu"), torch.float64).exp()[0]
    assert fresh[EOS] == 0 and again[EOS] > 0  # eos allowed from min_tokens on
    assert again[best] < fresh[best]  # a repeated draw is redrawn elsewhere
    assert (fresh[N_VALID:] == 0).all() and (again[N_VALID:] == 0).all()
    assert fresh.sum().item() == pytest.approx(1.0, abs=1e-12)
    assert again.sum().item() == pytest.approx(1.0, abs=1e-12)


def test_ties_follow_the_stable_sort() -> None:
    # quantised logits: many equal probabilities at the nucleus edge
    logits = _logp_rows(4, seed=5)
    logits[:, :N_VALID] = (logits[:, :N_VALID] * 2).round().log_softmax(dim=-1)
    outs = [[], [int(logits[1, :N_VALID].argmax())], list(range(10)), []]
    _check_rows(logits, [RASParams(top_p=tp) for tp in (0.8, 0.8, 0.5, 0.99)], outs)


def test_placeholders_and_window() -> None:
    batch = RASBatch.build([RASParams(win_size=3, min_tokens=4), RASParams(win_size=5)])
    hist, ban = batch.history([[1, 2, 3, 4, -1], [7]], "cpu")
    assert hist.tolist() == [[-1, -1, 2, 3, 4], [-1, -1, -1, -1, 7]]
    assert ban.flatten().tolist() == [False, False]  # 4 real tokens, the -1 placeholder is not counted
    assert RASParams(win_size=10, tau_r=0.1).min_count == 1
    assert RASParams(win_size=10, tau_r=0.15).min_count == 2


def test_history_starts_the_window() -> None:
    """A request's window reaches back into `history` (earlier bi-streaming blocks, fills incl.) until its
    own outputs fill it; the eos ban counts its own outputs only; the distribution is the reference's on
    history + outputs."""
    params = [RASParams(win_size=4, min_tokens=2, history=(9, 8, 7, 6, 5)), RASParams(win_size=3, history=(1,))]
    batch = RASBatch.build(params)
    hist, ban = batch.history([[4], [2, 3, 4, 5]], "cpu")
    assert hist.tolist() == [[7, 6, 5, 4], [-1, 3, 4, 5]] and ban.flatten().tolist() == [True, False]
    logits = _logp_rows(3, seed=11)
    top = [logits[r, :N_VALID].topk(3).indices.tolist() for r in range(3)]
    history = [(top[0][0], top[0][1], 6563), (top[1][0],) * 3, tuple(top[2])]  # block edge: outputs, the fill
    outs = [[top[0][0]], [], [top[2][1], 17]]
    params = [RASParams(min_tokens=m, history=h) for m, h in zip((0, 5, 1), history, strict=True)]
    batch = RASBatch.build(params)
    got = ras_log_probs(logits, batch, *batch.history(outs, "cpu"), torch.float64).exp()
    alone = RASBatch.build([replace(p, history=()) for p in params])
    without = ras_log_probs(logits, alone, *alone.history(outs, "cpu"), torch.float64).exp()
    for r, (p, out) in enumerate(zip(params, outs, strict=True)):  # (min_tokens: the same ban either way)
        ref = _reference(logits[r], [*p.history, *out], p)
        torch.testing.assert_close(got[r], ref, atol=1e-15, rtol=1e-13)
        assert not torch.allclose(without[r], got[r]), f"row {r}: the history changed nothing"


def test_params_from_extra_args() -> None:
    assert RASParams.from_extra_args(None) is None
    assert RASParams.from_extra_args({"other": 1}) is None
    p = RASParams.from_extra_args({EXTRA_ARGS_KEY: {"top_p": 0.7, "top_k": 20, "min_tokens": 3, "history": [5, 6563]}})
    assert p == RASParams(top_p=0.7, top_k=20, min_tokens=3, history=(5, 6563))
    bad_args = ({"top_p": 0.0}, {"top_k": 0}, {"win": 3}, {"top_k": 2.5}, {"eos": 7000}, {"top_p": "0.8"},
                {"top_k": True}, {"history": 5}, {"history": "12"}, {"history": [1.5]}, {"history": [7000]},
                {"history": [-1]})
    for bad in bad_args:
        with pytest.raises(ValueError):
            RASParams.from_extra_args({EXTRA_ARGS_KEY: bad})


# --- the vLLM processor: batch bookkeeping with vLLM's own BatchUpdate classes ---------------


def _ras_sp(**ras):
    from vllm import SamplingParams

    return SamplingParams(seed=0, extra_args={EXTRA_ARGS_KEY: ras})


def test_processor_tracks_the_persistent_batch() -> None:
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdateBuilder, MoveDirectionality

    from app.vllm_lm.ras import RASLogitsProcessor

    proc = RASLogitsProcessor(None, torch.device("cpu"), False)
    assert proc.is_argmax_invariant() is False
    reqs = {  # name -> (SamplingParams, its output-token list, RASParams or None)
        "a": (_ras_sp(top_p=0.8, min_tokens=3), [], RASParams(top_p=0.8, min_tokens=3)),
        "b": (SamplingParams(seed=1), [], None),
        "c": (_ras_sp(top_p=0.5, top_k=10, win_size=4), [5, 6], RASParams(top_p=0.5, top_k=10, win_size=4)),
        "d": (_ras_sp(), [], RASParams()),
    }
    builder = BatchUpdateBuilder()

    def step(layout: list[str], seed: int) -> None:
        proc.update_state(builder.get_and_reset(len(layout)))
        logits = _logp_rows(len(layout), seed=seed)
        got = proc.apply(logits.clone())
        for row, name in enumerate(layout):
            _, out, ras = reqs[name]
            if ras is None:
                assert torch.equal(got[row], logits[row]), f"{name} must be untouched"
                continue
            batch = RASBatch.build([ras])
            want = ras_log_probs(logits[row:row + 1], batch, *batch.history([out], "cpu"))[0]
            assert torch.equal(got[row], want), f"row {row} is not request {name}"

    def add(index: int, name: str) -> None:
        sp, out, _ = reqs[name]
        builder.added.append((index, sp, None, out))

    for i, name in enumerate("abc"):
        add(i, name)
    step(["a", "b", "c"], seed=1)
    best = int(_logp_rows(3, seed=2)[0, :N_VALID].argmax())
    reqs["a"][1].extend([best, best, 4])  # vLLM appends in place: history and min_tokens follow
    step(["a", "b", "c"], seed=2)
    builder.removed_append(0)  # a finishes; condense moves c (2) into the hole
    builder.pop_removed()
    builder.moved.append((2, 0, MoveDirectionality.UNIDIRECTIONAL))
    step(["c", "b"], seed=3)
    builder.moved.append((0, 1, MoveDirectionality.SWAP))
    step(["b", "c"], seed=4)
    builder.removed_append(0)  # b leaves, d takes its slot
    add(builder.pop_removed(), "d")
    step(["d", "c"], seed=5)
    builder.removed_append(1)  # c leaves
    step(["d"], seed=6)
    assert sorted(proc.rows) == [0]


def test_processor_validation_and_loading() -> None:
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns

    from app.vllm_lm.ras import RASLogitsProcessor

    fqcn = "app.vllm_lm.ras:RASLogitsProcessor"
    assert _load_logitsprocs_by_fqcns([fqcn]) == [RASLogitsProcessor]
    RASLogitsProcessor.validate_params(SamplingParams(top_k=25))  # not a RAS request: anything goes
    RASLogitsProcessor.validate_params(_ras_sp(min_tokens=4))
    ras = {EXTRA_ARGS_KEY: {}}
    for clash in (dict(top_k=25), dict(top_p=0.8), dict(min_tokens=2), dict(temperature=0.7),
                  dict(repetition_penalty=1.1)):
        with pytest.raises(ValueError):
            RASLogitsProcessor.validate_params(SamplingParams(extra_args=ras, **clash))
    with pytest.raises(ValueError):
        RASLogitsProcessor.validate_params(SamplingParams(extra_args={EXTRA_ARGS_KEY: {"top_p": 2.0}}))
    for extra in (None, ras):  # prompt logprobs skip logits processors: they would miss the bias
        with pytest.raises(ValueError, match="lm_head bias"):
            RASLogitsProcessor.validate_params(SamplingParams(prompt_logprobs=1, extra_args=extra))


def test_processor_adds_the_head_bias_to_every_row(tiny_model_dir, tmp_path) -> None:
    """Every row gets the export's float32 lm_head bias, RAS or not, before RAS sees it."""
    from vllm.v1.sample.logits_processor import BatchUpdateBuilder

    from app.model.vllm_export import export_lm_for_vllm, load_head_bias
    from app.vllm_lm.ras import RASLogitsProcessor

    folder = export_lm_for_vllm(tiny_model_dir, tmp_path, dtype="bfloat16")
    bias = load_head_bias(folder)[:VOCAB]  # the engine's head: the speech rows (app.vllm_lm.model)
    config = SimpleNamespace(model_config=SimpleNamespace(model=str(folder), get_vocab_size=lambda: VOCAB))
    proc = RASLogitsProcessor(config, torch.device("cpu"), False)
    assert proc.head_bias.dtype == torch.float32 and torch.equal(proc.head_bias, bias)
    raw = _logp_rows(2, seed=7)
    assert torch.equal(proc.apply(raw.clone()), raw + bias)  # no RAS request yet: bias only
    builder = BatchUpdateBuilder()
    builder.added.append((1, _ras_sp(), None, [5, 6]))
    proc.update_state(builder.get_and_reset(2))
    got = proc.apply(raw.clone())
    assert torch.equal(got[0], raw[0] + bias)
    batch = RASBatch.build([RASParams()])
    assert torch.equal(got[1], ras_log_probs((raw + bias)[1:], batch, *batch.history([[5, 6]], "cpu"))[0])
    for rows in (VOCAB - 64, 10**6):  # fewer than the speech rows, more than the file has
        config.model_config.get_vocab_size = lambda rows=rows: rows
        with pytest.raises(ValueError, match="export the LM again"):
            RASLogitsProcessor(config, torch.device("cpu"), False)


# --- the real vLLM CPU engine: same per-step distribution as the PyTorch reference ----------
# The tiny random LM is nearly uniform over 6564 ids (top-25 mass ~0.3), so top_p never cuts
# and repeats are rare. The engine tests use a variant: lm_head x2 (peaked: top-1 ~0.4, top_p
# binds) plus 0.06 x speech_embedding (favours recently fed tokens, so repeats get redrawn).

RAS_ARGS = {"top_p": 0.8, "top_k": 25, "win_size": 10, "tau_r": 0.1, "min_tokens": 8, "eos": EOS, "n_valid": N_VALID}
STOPS = [6561, 6562, 6563]
PROB_ATOL = 2e-5  # |P_engine - P_reference| per id, fp32 engine vs fp32 torch: measured <= 1.8e-6 (docs/sampling.md)


@pytest.fixture(scope="module")
def sharp_lm(tiny_model_dir, tmp_path_factory):
    """(folder, SpeechLM) of the sharpened, repetition-prone tiny LM."""
    from app.model.hparams import load_hparams
    from app.model.llm import SpeechLM
    from app.model.loader import load_strict

    out = tmp_path_factory.mktemp("sharp")
    sd = torch.load(tiny_model_dir / "llm.pt", map_location="cpu", weights_only=True)
    sd["llm_decoder.weight"] = sd["llm_decoder.weight"] * 2 + 0.06 * sd["speech_embedding.weight"]
    sd["llm_decoder.bias"] = sd["llm_decoder.bias"] * 2
    torch.save(sd, out / "llm.pt")
    (out / "cosyvoice2.yaml").write_bytes((tiny_model_dir / "cosyvoice2.yaml").read_bytes())
    (out / "CosyVoice-BlankEN").symlink_to(tiny_model_dir / "CosyVoice-BlankEN")
    llm = SpeechLM(load_hparams(out).llm)
    load_strict(llm, out / "llm.pt")
    return out, llm.eval()


@pytest.fixture(scope="module")
def engine(sharp_lm, tmp_path_factory):
    """One fp32 vLLM engine with the RAS processor, the model as the app's engine sees it (the id space's
    table, a head of the speech rows); logprobs are the processed (post-RAS) ones."""
    from vllm import LLM

    from app.model.vllm_export import export_lm_for_vllm
    from app.vllm_lm import model as vllm_model

    folder = export_lm_for_vllm(sharp_lm[0], tmp_path_factory.mktemp("export"), dtype="float32")
    vllm_model.register()
    overrides = vllm_model.hf_overrides(json.loads((folder / "config.json").read_text()))
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, os.environ.get(k, v))
        mp.setenv("VLLM_PLUGINS", "someone_elses_plugin")  # no plugin of ours
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        llm = LLM(model=str(folder), skip_tokenizer_init=True, enable_prompt_embeds=True, dtype="float32",
                  enforce_eager=True, hf_overrides=overrides, max_model_len=256, max_num_seqs=64, seed=0,
                  max_logprobs=-1, logprobs_mode="processed_logprobs",
                  logits_processors=["app.vllm_lm.ras:RASLogitsProcessor"])
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def _prompts(lm, n: int) -> list[torch.Tensor]:
    """Different zero-shot LM prefixes `[T, D]`."""
    return [lm.build_lm_input(list(range(100 + 7 * i, 112 + 7 * i)), list(range(300, 306)),
                              list(range(40 * i, 40 * i + 20)))[0] for i in range(n)]


def _dense(step_logprobs: dict, vocab: int = VOCAB) -> torch.Tensor:
    """vLLM's {id: Logprob} of one step -> probabilities `[vocab]` float64."""
    p = torch.zeros(vocab, dtype=torch.float64)
    for tok, lp in step_logprobs.items():
        p[tok] = math.exp(lp.logprob)
    return p


def _reference_logp(lm, prefix: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Teacher-forced log-probs `[len(tokens), 6564]` of each step of a trajectory."""
    x = torch.cat([prefix[None], lm.embed_speech(tokens[:-1])], dim=1) if len(tokens) > 1 else prefix[None]
    return lm.logp(lm.hidden(x)[0, prefix.shape[0] - 1:])


def _top_k_distribution(logp: torch.Tensor, n_out: int, min_tokens: int, k: int = 25) -> torch.Tensor:
    """upstream's vLLM sampler: min_tokens bans all stop ids, then softmax over the top k."""
    x = logp.double().clone()
    if n_out < min_tokens:
        x[STOPS] = -float("inf")
    top = x.topk(k)
    out = torch.zeros(VOCAB, dtype=torch.float64)
    out[top.indices] = top.values.softmax(dim=0)
    return out


def _run(engine, prompts: list[torch.Tensor], params: list) -> list[tuple[list[int], list[dict] | None]]:
    outs = engine.generate([{"prompt_embeds": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


LOGIT_ATOL = 1e-4  # |logit_engine - logit_reference|, fp32 (test_vllm_backend's export check); measured 9.5e-6


def test_engine_logits_equal_the_reference(engine, sharp_lm) -> None:
    """Plain requests (no RAS): vLLM's processed log-probs are log_softmax(Qwen2 head + our bias) over
    all 6592 ids, which must be SpeechLM's logits (llm_decoder with its bias) up to the row's constant;
    the padded ids carry PAD_BIAS and so no probability."""
    from vllm import SamplingParams

    lm = sharp_lm[1]
    assert engine.llm_engine.vllm_config.model_config.architectures == ["CosyVoice2ForCausalLM"]
    g = torch.Generator().manual_seed(3)
    teacher = torch.randint(0, EOS, (12,), generator=g).tolist()
    prompts = []
    with torch.inference_mode():
        for prefix in _prompts(lm, 2):
            for t in range(0, 12, 4):  # the prefix, then prefix + t fed-back speech tokens
                prompts.append(torch.cat([prefix, lm.embed_speech(teacher[:t])[0]]) if t else prefix)
        ref = torch.stack([lm.llm_decoder(lm.hidden(p[None]))[0, -1] for p in prompts]).double()  # [R, 6564]
    params = [SamplingParams(seed=0, max_tokens=1, detokenize=False, temperature=1.0, logprobs=-1) for _ in prompts]
    worst = 0.0
    for (_, logprobs), want in zip(_run(engine, prompts, params), ref, strict=True):
        got = torch.tensor([logprobs[0][i].logprob for i in range(VOCAB)], dtype=torch.float64)
        assert (got[N_VALID:] < -9000).all()  # PAD_BIAS rows
        diff = got[:N_VALID] - want  # = -logsumexp of the row: one constant
        worst = max(worst, (diff - diff.mean()).abs().max().item())
    print(f"\nlogits vs SpeechLM, {len(prompts)} rows: max |diff| {worst:.2e} (up to each row's constant)")
    assert worst < LOGIT_ATOL, f"max |logit_vllm - logit_ref| (up to the row constant) = {worst:.2e}"


def test_engine_window_starts_in_the_history(engine, sharp_lm) -> None:
    """`history` in the request's extra_args reaches the engine's processor: step 0's distribution is the
    reference's with the history as the decoded tokens (bi-streaming's earlier blocks), not a fresh one's."""
    from vllm import SamplingParams

    lm = sharp_lm[1]
    prefix = _prompts(lm, 1)[0]
    with torch.inference_mode():
        logp = _reference_logp(lm, prefix, [0])[0]
    history = [*logp.topk(2).indices.tolist(), 6563]  # the likeliest ids, then a block's fill
    ras = RASParams(**RAS_ARGS, history=tuple(history))
    params = SamplingParams(seed=0, max_tokens=1, stop_token_ids=STOPS, detokenize=False, temperature=1.0,
                            logprobs=-1, extra_args={EXTRA_ARGS_KEY: {**RAS_ARGS, "history": history}})
    got = _dense(_run(engine, [prefix], [params])[0][1][0])
    want, fresh = _reference(logp, history, ras), _reference(logp, [], ras)
    assert (got[:N_VALID] - want).abs().max().item() < PROB_ATOL
    assert (want - fresh).abs().max().item() > 100 * PROB_ATOL  # the history matters here


@pytest.mark.slow
def test_engine_samples_the_reference_ras_distribution(engine, sharp_lm) -> None:
    from vllm import SamplingParams

    lm, ras = sharp_lm[1], RASParams(**RAS_ARGS)
    prompts = _prompts(lm, 4)
    params = [SamplingParams(seed=10 + i, max_tokens=40, stop_token_ids=STOPS, detokenize=False, temperature=1.0,
                             logprobs=-1, extra_args={EXTRA_ARGS_KEY: RAS_ARGS}) for i in range(len(prompts))]
    worst, n_steps, n_redraws = 0.0, 0, 0
    for prefix, (tokens, logprobs) in zip(prompts, _run(engine, prompts, params), strict=True):
        ref_logp = _reference_logp(lm, prefix, tokens)
        for t, tok in enumerate(tokens):
            got, want = _dense(logprobs[t]), _reference(ref_logp[t], tokens[:t], ras)
            assert (got[N_VALID:] == 0).all() and got[tok] > 0
            assert t >= ras.min_tokens or got[EOS] == 0
            worst = max(worst, (got[:N_VALID] - want).abs().max().item())
            n_steps += 1
            n_redraws += bool((want > 0).sum() > ras.top_k)  # a kept id was repeated: full-vocab redraw
    assert worst < PROB_ATOL, f"max |P_vllm - P_ref| = {worst:.2e} over {n_steps} steps"
    assert n_steps >= 60 and n_redraws >= 5, (n_steps, n_redraws)  # both paths exercised


@pytest.mark.slow
def test_engine_step0_frequencies(engine, sharp_lm) -> None:
    """Seeded draws at step 0 follow the RAS distribution (chi-square, 1000 draws)."""
    from vllm import SamplingParams

    lm, ras, n = sharp_lm[1], RASParams(**RAS_ARGS), 1000
    prefix = _prompts(lm, 1)[0]
    params = [SamplingParams(seed=s, max_tokens=1, stop_token_ids=STOPS, detokenize=False, temperature=1.0,
                             extra_args={EXTRA_ARGS_KEY: RAS_ARGS}) for s in range(n)]
    drawn = torch.tensor([tokens[0] for tokens, _ in _run(engine, [prefix] * n, params)])
    want = _reference(_reference_logp(lm, prefix, [0])[0], [], ras)
    counts = torch.bincount(drawn, minlength=VOCAB)[:N_VALID].double()
    support = want > 0
    assert counts[~support].sum() == 0, "drew an id outside the nucleus"
    expected = n * want[support]
    chi2 = ((counts[support] - expected) ** 2 / expected).sum().item()
    dof = int(support.sum()) - 1
    # Wilson-Hilferty: the chi-square quantile at z = 3.7 (p ~ 1e-4)
    limit = dof * (1 - 2 / (9 * dof) + 3.7 * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, f"chi2 {chi2:.1f} >= {limit:.1f} (dof {dof})"


@pytest.mark.slow
def test_engine_plain_top_k_differs_from_ras(engine, sharp_lm) -> None:
    """Upstream's vLLM sampling (top_k 25, min_tokens on all stop ids) is reproduced, and is not RAS."""
    from vllm import SamplingParams

    lm, ras = sharp_lm[1], RASParams(**RAS_ARGS)
    prompts = _prompts(lm, 2)
    params = [SamplingParams(seed=20 + i, max_tokens=40, stop_token_ids=STOPS, detokenize=False, top_k=25,
                             min_tokens=ras.min_tokens, logprobs=-1) for i in range(len(prompts))]
    worst, tvs = 0.0, []
    for prefix, (tokens, logprobs) in zip(prompts, _run(engine, prompts, params), strict=True):
        ref_logp = _reference_logp(lm, prefix, tokens)
        for t in range(len(tokens)):
            top_k = _top_k_distribution(ref_logp[t], t, ras.min_tokens)
            worst = max(worst, (_dense(logprobs[t]) - top_k).abs().max().item())
            with_ras = _reference(ref_logp[t], tokens[:t], ras)
            tvs.append(0.5 * (with_ras - top_k[:N_VALID]).abs().sum().item())
    assert worst < PROB_ATOL, f"plain top-k: max |P_vllm - P_ref| = {worst:.2e}"
    assert sum(tvs) / len(tvs) > 0.02, f"RAS vs top-k 25: mean total variation {sum(tvs) / len(tvs):.3f}"
