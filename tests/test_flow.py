"""CausalFlow against the official flow goldens (flow.npz) on the tiny random fixture model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tolerances import BATCH_ATOL, FLOW_MEL_ATOL, FLOW_MU_ATOL, NOISE_ATOL, within

from app.model.flow import CausalFlow, fixed_noise, load_flow
from app.model.flow.encoder import chunk_mask
from app.model.hparams import load_hparams


@pytest.fixture(scope="module")
def flow(parity_model_dir) -> CausalFlow:
    return load_flow(parity_model_dir / "flow.pt", load_hparams(parity_model_dir).flow)


@pytest.fixture(scope="module")
def g(golden) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in golden("flow").items()}


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float() - b.float()).abs().max())


def test_chunk_mask_rule():
    m = chunk_mask(5, 2)
    assert m.tolist() == [[True, True, False, False, False]] * 2 + [[True] * 4 + [False]] * 2 + [[True] * 5]
    left = chunk_mask(6, 2, num_left_chunks=1)
    assert left[5].tolist() == [False, False, True, True, True, True]


@pytest.mark.parity
def test_strict_load_matches_checkpoint_keys(flow, parity_model_dir):
    state = torch.load(parity_model_dir / "flow.pt", weights_only=True)
    assert set(flow.state_dict()) == set(state)
    assert all(not p.is_meta for p in flow.parameters())


@pytest.mark.parity
def test_fixed_noise_is_official_and_leaves_global_rng_alone(g):
    fixed_noise.cache_clear()
    before = torch.random.get_rng_state()
    noise = fixed_noise()
    assert torch.equal(torch.random.get_rng_state(), before)
    assert noise.shape == (1, 80, 15000)
    head = noise[:, :, : g["rand_noise_head"].shape[2]]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):  # ATen's vectorised normal_ kernel,
        assert torch.equal(head, g["rand_noise_head"])  # as on the machine that made the goldens
    else:  # ATen's scalar kernel (ATEN_CPU_CAPABILITY=default, CPUs without AVX2): same uniforms, other rounding
        assert within((head - g["rand_noise_head"]).abs().max(), NOISE_ATOL)


@pytest.mark.parity
def test_encoder_stages(flow, g):
    with torch.inference_mode():
        spks = flow.speaker_embedding(g["embedding"])
        tokens = torch.cat([g["prompt_token"], g["a_tokens"]], dim=1).long()
        h, h_lens = flow.encode(tokens, torch.tensor([tokens.shape[1]]), streaming=False, finalize=True)
        mu = flow.encoder_proj(h)
    assert h_lens.tolist() == [2 * tokens.shape[1]]
    assert within(_max_err(spks, g["a_spks"]), FLOW_MU_ATOL)
    assert within(_max_err(h, g["a_enc_out"]), FLOW_MU_ATOL)
    assert within(_max_err(mu, g["a_mu"]), FLOW_MU_ATOL)


@pytest.mark.parity
def test_estimator_first_call(flow, g):
    args = [g[f"a_est_{k}"] for k in ("x", "mask", "mu", "t", "spks", "cond")]
    with torch.inference_mode():
        v = flow.estimator(*args, streaming=False)
    assert within(_max_err(v, g["a_est_out"]), FLOW_MU_ATOL)


@pytest.mark.parity
def test_cfm_solve(flow, g):
    # the CFG pair's row 0 is exactly the conditional input of solve()
    mu, mask, spks, cond = (g[f"a_est_{k}"][:1] for k in ("mu", "mask", "spks", "cond"))
    x = flow.solve(mu, mask, spks, cond, streaming=False)
    assert x.dtype == torch.float32
    assert within(_max_err(x, g["a_cfm_out"]), FLOW_MEL_ATOL)


@pytest.mark.parity
@pytest.mark.parametrize(("name", "tokens", "streaming", "finalize"), [
    ("a_mel", "a_tokens", False, True),
    ("a2_mel", "a_tokens", True, True),
    ("b_mel", "b_tokens", True, False),
    ("b2_mel", "b_tokens", False, False),
])
def test_inference_mel(flow, g, name, tokens, streaming, finalize):
    mel = flow.inference(g[tokens], g["prompt_token"], g["prompt_feat"], g["embedding"],
                         streaming=streaming, finalize=finalize)
    assert mel.dtype == torch.float32
    assert within(_max_err(mel, g[name]), FLOW_MEL_ATOL)


@pytest.mark.parity
def test_batched_rows_match_single_rows(flow, g):
    """Rows of different lengths in one batch give each row's B=1 result (encoder and estimator)."""
    tok = g["tokens"].long()
    rows = [tok[:, :40], tok[:, 7:30]]
    lengths = torch.tensor([r.shape[1] for r in rows])
    batch = torch.zeros(2, 40, dtype=torch.long)
    for i, r in enumerate(rows):
        batch[i, : r.shape[1]] = r[0]
    with torch.inference_mode():
        h, h_lens = flow.encode(batch, lengths, streaming=True, finalize=False)
        singles = [flow.encode(r, torch.tensor([r.shape[1]]), streaming=True, finalize=False)[0]
                   for r in rows]
        for i, s in enumerate(singles):
            assert h_lens[i] == s.shape[1]
            assert within(_max_err(h[i : i + 1, : s.shape[1]], s), BATCH_ATOL)

        mu = flow.encoder_proj(h).transpose(1, 2)  # [2, 80, T]
        mask = (torch.arange(mu.shape[2])[None, :] < h_lens[:, None]).unsqueeze(1).float()
        x = torch.randn(mu.shape, generator=torch.Generator().manual_seed(1))
        t, spks = torch.full((2,), 0.3), flow.speaker_embedding(g["embedding"]).expand(2, -1)
        cond = torch.zeros_like(mu)
        v = flow.estimator(x, mask, mu * mask, t, spks, cond, streaming=True)
        for i in range(2):
            n = int(h_lens[i])
            vi = flow.estimator(x[i : i + 1, :, :n], mask[i : i + 1, :, :n], mu[i : i + 1, :, :n], t[:1],
                                spks[:1], cond[:1, :, :n], streaming=True)
            assert within(_max_err(v[i : i + 1, :, :n], vi), BATCH_ATOL)
    assert np.isfinite(v.numpy()).all()
