"""SpeechLM / Qwen2 / RAS against the official goldens (llm.npz, e2e.npz) and self-consistency."""

from __future__ import annotations

import json
from itertools import zip_longest

import numpy as np
import pytest
import torch
from bistream import decode_bistream, greedy_sample
from tolerances import LM_ATOL, LM_INPUT_ATOL, within

from app.config import SamplingConfig
from app.model.hparams import load_hparams
from app.model.llm import EOS_TOKEN, STOP_TOKENS, SpeechLM
from app.model.sampling import ras_distribution, ras_sample

CASES = ("zs", "xl", "ins")


@pytest.fixture(autouse=True)
def _inference_mode():
    with torch.inference_mode():  # tensors made by the model's inference-mode methods
        yield


@pytest.fixture(scope="module")
def lm(parity_model_dir) -> SpeechLM:
    dims = load_hparams(parity_model_dir).llm
    with torch.device("meta"):
        model = SpeechLM(dims)
    state = torch.load(parity_model_dir / "llm.pt", map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def _max_err(a: torch.Tensor, b: np.ndarray) -> float:
    return float((a.float() - torch.from_numpy(b).float()).abs().max())


@pytest.mark.parity
def test_state_dict_keys_match_official(parity_model_dir):
    dims = load_hparams(parity_model_dir).llm
    state = torch.load(parity_model_dir / "llm.pt", map_location="cpu", weights_only=True)
    model = SpeechLM(dims)
    model.load_state_dict(state, strict=True)  # plain copy load works too
    assert set(model.state_dict()) == set(state)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == {
        k: tuple(v.shape) for k, v in state.items()}


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_teacher_forced_steps(lm, golden, manifest, case):
    g = golden("llm")
    prompt = g[f"{case}_prompt_text"], g[f"{case}_prompt_speech_token"]
    lm_input = lm.build_lm_input(g[f"{case}_text"], *prompt)
    assert tuple(lm_input.shape) == g[f"{case}_lm_input"].shape
    assert within(_max_err(lm_input, g[f"{case}_lm_input"]), LM_INPUT_ATOL)

    min_len, _ = SamplingConfig().length_limits(g[f"{case}_text"].shape[1])
    forced = g[f"{case}_forced_tokens"].tolist()
    cache, pending = lm.new_cache(), lm_input
    hidden, logits, logp = [], [], []
    for step in range(len(forced) + 1):
        h = lm.hidden(pending, cache)[0, -1]
        lp = lm.logp(h).clone()
        if step < min_len:
            lp[EOS_TOKEN] = -float("inf")
        hidden.append(h)
        logits.append(lm.llm_decoder(h))
        logp.append(lp)
        if step < len(forced):
            pending = lm.embed_speech(forced[step])
    assert within(_max_err(torch.stack(hidden), g[f"{case}_hidden_last"]), LM_ATOL)
    assert within(_max_err(torch.stack(logits), g[f"{case}_logits"]), LM_ATOL)
    want = torch.from_numpy(g[f"{case}_logp_masked"])
    got = torch.stack(logp)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert within(float((got[finite] - want[finite]).abs().max()), LM_ATOL)

    if f"{case}_logits_fullseq" in g:  # one forward over prefix + forced tokens, no cache
        seq = torch.cat([lm_input, lm.embed_speech(forced)], dim=1)
        h = lm.hidden(seq)[0, lm_input.shape[1] - 1:]
        assert within(_max_err(lm.llm_decoder(h), g[f"{case}_logits_fullseq"]), LM_ATOL)


@pytest.mark.parity
def test_sampled_tokens_exact(lm, golden, manifest):
    """`sampled_tokens` used the English tts text (frontend `a_zs_text`), not llm.npz `zs_text`."""
    g, m = golden("llm"), manifest["llm"]
    text = golden("frontend")["a_zs_text"]
    lm_input = lm.build_lm_input(text, g["zs_prompt_text"], g["zs_prompt_speech_token"])
    # [sos, prompt text + text, task_id, prompt speech]; manifest prefix_len / zs_min_len describe the
    # zs_text run, which may differ in length from this text
    n_prefix = 1 + g["zs_prompt_text"].shape[1] + text.shape[1] + 1 + g["zs_prompt_speech_token"].shape[1]
    assert tuple(lm_input.shape[:2]) == (1, n_prefix)
    min_len, max_len = SamplingConfig().length_limits(text.shape[1])
    assert max_len == m["sampled_max_len"]
    gen = torch.Generator().manual_seed(m["sampled_seed"])
    tokens = list(lm.decode(lm_input, min_len, max_len, gen))
    assert len(tokens) == m["sampled_len"] and tokens == g["sampled_tokens"].tolist()


@pytest.mark.parity
def test_e2e_llm_tokens_exact(lm, golden, manifest, parity):
    """e2e inputs: tts/prompt text ids from text.json, prompt speech tokens from frontend case a."""
    e2e = manifest["e2e"]
    assert e2e["prompt_wav"] == "prompt_24k.wav"  # frontend case `a_*`
    ids = {t["text"]: t["ids"] for t in json.loads((parity / "text.json").read_text())["tokenize"]}
    (tts_text,) = e2e["normalized_tts_text"]
    text, prompt_text = ids[tts_text], ids[e2e["normalized_prompt_text"]]
    front = golden("frontend")
    assert front["a_zs_prompt_text"][0].tolist() == prompt_text
    lm_input = lm.build_lm_input(text, prompt_text, front["a_zs_prompt_speech_token"])
    min_len, max_len = SamplingConfig().length_limits(len(text))
    tokens = list(lm.decode(lm_input, min_len, max_len, torch.Generator().manual_seed(e2e["seed"])))
    want = golden("e2e")
    assert tokens == want["nonstream_llm_tokens"][0].tolist()
    assert tokens == want["stream_llm_tokens"][0].tolist()  # the LLM does not depend on streaming


@pytest.mark.parity
def test_bistream_matches_official(lm, golden):
    """Bistream with argmax sampling: every fed chunk, logits per call, and yielded tokens."""
    g = golden("llm")
    phases = g["bistream_sampling_phase"].tolist()  # 0: eos masked (text streaming), 1: final phase
    n_final = phases.count(1)
    seen: list[int] = []

    def sampler(logp, decoded, generator):
        """The fixture's deterministic sampler: argmax, and eos on the last recorded final call."""
        seen.append(int(torch.isfinite(logp[EOS_TOKEN])))
        return EOS_TOKEN if seen.count(1) == n_final else greedy_sample(logp, decoded, generator)

    fed, logits = [], []
    feed = lm._feed

    def spy(inputs_embeds, cache):
        fed.append(inputs_embeds)
        return feed(inputs_embeds, cache)

    # llm_decoder runs once per backbone call: its output is the golden's per-call logits
    handle = lm.llm_decoder.register_forward_hook(lambda mod, inp, out: logits.append(out.detach().clone()))
    lm._feed = spy
    try:
        pieces = [[int(i)] for i in g["bistream_text_ids"]]  # one id at a time, as upstream feeds them
        tokens = list(decode_bistream(lm, pieces, g["zs_prompt_text"], g["zs_prompt_speech_token"],
                                      torch.Generator(), sampler, max_len=400))
    finally:
        lm._feed = feed
        handle.remove()
    assert [x.shape[1] for x in fed] == g["bistream_input_lens"].tolist()
    assert within(_max_err(torch.cat(fed, dim=1), g["bistream_inputs"]), LM_INPUT_ATOL)
    assert within(_max_err(torch.stack(logits), g["bistream_logits"]), LM_ATOL)
    assert tokens == g["bistream_tokens"].tolist()
    assert seen == phases


def test_ras_distribution_matches_sampler_frequencies():
    gen = torch.Generator().manual_seed(1234)
    logits = torch.randn(12, generator=gen) * 1.5
    logp = logits.log_softmax(0)
    logp[3] = -float("inf")  # a banned id must never come out
    top = logp.argsort(descending=True).tolist()  # banned id 3 sorts last
    decoded = [top[0], top[-2], top[0], top[2], top[-3], top[-2]]
    opts = dict(top_p=0.9, top_k=6, win_size=5, tau_r=0.2)  # window: last 5, any repeat counts
    dist = ras_distribution(logp, decoded, **opts)
    assert abs(float(dist.sum()) - 1.0) < 1e-9 and float(dist[3]) == 0.0
    assert float(dist[top[8]]) > 0  # outside the nucleus (top_k 6): reachable only by a redraw
    n = 20000
    counts = torch.zeros(12, dtype=torch.float64)
    for _ in range(n):
        counts[ras_sample(logp, decoded, gen, **opts)] += 1
    freq = counts / n
    sigma = (dist * (1 - dist) / n).sqrt()
    assert torch.all((freq - dist).abs() <= 5 * sigma + 1e-12), (freq, dist)
    assert float((freq - dist).abs().sum()) < 0.03


def test_ras_repeat_redraw_excludes_repeated_id():
    logp = torch.tensor([5.0, 0.0, 0.0, 0.0]).log_softmax(0)  # nucleus = {0} at top_p 0.8
    gen = torch.Generator().manual_seed(0)
    draws = {ras_sample(logp, [0], gen) for _ in range(200)}
    assert 0 not in draws and draws <= {1, 2, 3}
    dist = ras_distribution(logp, [0])
    assert float(dist[0]) == 0.0 and torch.allclose(dist[1:], torch.full((3,), 1 / 3, dtype=torch.float64))


@pytest.mark.parity
def test_interleaved_requests_match_solo(lm, golden):
    g = golden("llm")
    inputs = [lm.build_lm_input(g[f"{c}_text"], g[f"{c}_prompt_text"], g[f"{c}_prompt_speech_token"])
              for c in ("zs", "xl")]
    seeds, n = (7, 8), 30

    def solo(i):
        return list(lm.decode(inputs[i], 5, n, torch.Generator().manual_seed(seeds[i])))

    alone = [solo(0), solo(1)]
    gens = [lm.decode(inputs[i], 5, n, torch.Generator().manual_seed(seeds[i])) for i in range(2)]
    together: list[list[int]] = [[], []]
    for a, b in zip_longest(*gens):
        for i, tok in enumerate((a, b)):
            if tok is not None:
                together[i].append(tok)
    assert together == alone
    assert all(t not in STOP_TOKENS for seq in alone for t in seq)
