"""HiFT vocoder: strict loading of both hift.pt key styles, parity with the official goldens
(hift.npz, deterministic NSF patch => nsf_noise=False), seeded NSF noise, weight-norm folding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tolerances import (
    BATCH_ATOL,
    DECODE_ATOL,
    F0_ATOL,
    FOLD_SOURCE_ATOL,
    FOLD_WAVE_ATOL,
    SOURCE_ATOL,
    SOURCE_BATCH_ATOL,
    WAVE_MAX_ATOL,
    WAVE_RMS_ATOL,
    within,
)

from app.model.hift import HiFTGenerator, normalize_hift_state_dict
from app.model.hparams import HiftDims, load_hparams

# a small vocoder with the official rates/kernels, for tests that need no fixture set
TINY = HiftDims(
    in_channels=80, base_channels=16, nb_harmonics=8, sampling_rate=24000, nsf_alpha=0.1,
    nsf_sigma=0.003, nsf_voiced_threshold=10.0, upsample_rates=(8, 5, 3),
    upsample_kernel_sizes=(16, 11, 7), istft_n_fft=16, istft_hop_len=4,
    resblock_kernel_sizes=(3, 7, 11), resblock_dilation_sizes=((1, 3, 5),) * 3,
    source_resblock_kernel_sizes=(7, 7, 11), source_resblock_dilation_sizes=((1, 3, 5),) * 3,
    lrelu_slope=0.1, audio_limit=0.99, f0_cond_channels=16,
)


def _err(ours: torch.Tensor, golden: np.ndarray) -> tuple[float, float]:
    """(max abs, RMS) of ours - golden, in float64."""
    d = ours.detach().double() - torch.from_numpy(golden).double()
    assert ours.shape == d.shape, (ours.shape, golden.shape)
    return d.abs().max().item(), d.pow(2).mean().sqrt().item()


def _old_style(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pre-torch-2.1 weight-norm names inside a GAN wrapper, as older hift.pt files are stored."""
    out = {}
    for k, v in sd.items():
        k = k.replace(".parametrizations.weight.original0", ".weight_g")
        k = k.replace(".parametrizations.weight.original1", ".weight_v")
        out["generator." + k] = v
    return out


def _tiny_model(seed: int, *, nsf_noise: bool = False) -> HiFTGenerator:
    """Default-initialised TINY vocoder; the global RNG is used for the init only and restored."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = HiFTGenerator(TINY, nsf_noise=nsf_noise).eval()
    with torch.no_grad():
        model.f0_predictor.classifier.bias.fill_(150.0)  # voiced f0 (~150 Hz), so the sines matter
    return model


def _tiny_mel(frames: int = 12, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 80, frames, generator=g) - 4.0




@pytest.fixture(scope="module")
def hift_sd(parity_model_dir) -> dict[str, torch.Tensor]:
    return torch.load(parity_model_dir / "hift.pt", weights_only=True, map_location="cpu")


@pytest.fixture(scope="module")
def hift(parity_model_dir, hift_sd) -> HiFTGenerator:
    model = HiFTGenerator(load_hparams(parity_model_dir).hift, nsf_noise=False).eval()
    model.load_state_dict(normalize_hift_state_dict(hift_sd), strict=True)
    return model


@pytest.fixture(scope="module")
def g_hift(golden) -> dict[str, np.ndarray]:
    return golden("hift")


# --- loading ----------------------------------------------------------------------------------


@pytest.mark.parity
def test_state_dict_keys_are_hift_pt_keys(hift, hift_sd):
    ours = {k: tuple(v.shape) for k, v in hift.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in hift_sd.items()}
    assert ours == theirs
    assert any(".parametrizations.weight.original1" in k for k in hift_sd)


@pytest.mark.parity
def test_strict_load_of_weight_g_v_style_with_generator_prefix(parity_model_dir, hift, hift_sd):
    old = _old_style(hift_sd)
    assert any(k.endswith(".weight_g") for k in old) and all(k.startswith("generator.") for k in old)
    model = HiFTGenerator(load_hparams(parity_model_dir).hift, nsf_noise=False)
    model.load_state_dict(normalize_hift_state_dict(old), strict=True)
    for (k, a), b in zip(model.state_dict().items(), hift.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_normalize_is_identity_on_new_style_and_strict_load_rejects_strays():
    model = HiFTGenerator(TINY)
    sd = model.state_dict()
    assert normalize_hift_state_dict(sd).keys() == sd.keys()
    assert normalize_hift_state_dict(_old_style(sd)).keys() == sd.keys()
    bad = dict(sd)
    bad["m_source.l_linear.extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError):
        HiFTGenerator(TINY).load_state_dict(normalize_hift_state_dict(bad), strict=True)


# --- parity (deterministic NSF) ---------------------------------------------------------------


@pytest.mark.parity
def test_f0_matches_golden(hift, g_hift):
    with torch.inference_mode():
        f0 = hift.f0(torch.from_numpy(g_hift["mel"]))
    mx, _ = _err(f0, g_hift["f0"])
    assert within(mx, F0_ATOL)


@pytest.mark.parity
def test_source_matches_golden(hift, g_hift):
    with torch.inference_mode():
        s = hift.source(torch.from_numpy(g_hift["f0"]))
    mx, _ = _err(s, g_hift["source"])
    assert within(mx, SOURCE_ATOL)


@pytest.mark.parity
def test_decode_with_provided_source(hift, g_hift):
    with torch.inference_mode():
        wav = hift.decode(torch.from_numpy(g_hift["mel"]), torch.from_numpy(g_hift["provided_source"]))
    mx, _ = _err(wav, g_hift["decode_wav"])
    assert within(mx, DECODE_ATOL)


@pytest.mark.parity
def test_inference_wav_and_source(hift, g_hift):
    wav, src = hift.inference(torch.from_numpy(g_hift["mel"]))
    mx, rms = _err(wav, g_hift["wav"])
    assert within(mx, WAVE_MAX_ATOL, "max") and within(rms, WAVE_RMS_ATOL, "rms")
    assert within(_err(src, g_hift["source"])[0], SOURCE_ATOL, "source")


@pytest.mark.parity
def test_inference_with_cache_source(hift, g_hift):
    cache = torch.from_numpy(g_hift["cache_source"])
    wav, src = hift.inference(torch.from_numpy(g_hift["mel"]), cache)
    assert torch.equal(src[:, :, : cache.shape[-1]], cache)
    mx, rms = _err(wav, g_hift["cached_wav"])
    assert within(mx, WAVE_MAX_ATOL, "max") and within(rms, WAVE_RMS_ATOL, "rms")
    assert within(_err(src, g_hift["cached_source_out"])[0], SOURCE_ATOL, "source")


@pytest.mark.parity
def test_inference_on_flow_mel(hift, g_hift, golden):
    wav, _ = hift.inference(torch.from_numpy(golden("flow")["a_mel"]))
    mx, rms = _err(wav, g_hift["flow_a_wav"])
    assert within(mx, WAVE_MAX_ATOL, "max") and within(rms, WAVE_RMS_ATOL, "rms")


# --- behaviour (no fixture needed) ------------------------------------------------------------


def test_shapes_and_cache_validation():
    model = _tiny_model(5)
    mel = _tiny_mel(10)
    wav, src = model.inference(mel)
    assert wav.shape == (1, 4800) and src.shape == (1, 1, 4800)
    assert wav.abs().max() <= TINY.audio_limit
    with pytest.raises(ValueError):
        model.inference(mel, torch.zeros(1, 1, 4801))
    with pytest.raises(ValueError):
        model.inference(mel[:, :40])


def test_nsf_noise_follows_the_generator():
    noisy = HiFTGenerator(TINY, nsf_noise=True).eval()
    # constant 200 Hz f0 (voiced) and 0 Hz (unvoiced) frames: both noise amplitudes are exercised
    f0 = torch.tensor([[200.0] * 6 + [0.0] * 4])

    def run(seed: int) -> torch.Tensor:
        with torch.inference_mode():
            return noisy.source(f0, torch.Generator().manual_seed(seed))

    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a, b)
    assert (a - c).abs().max() > 1e-3
    clean = HiFTGenerator(TINY, nsf_noise=False).eval()
    clean.load_state_dict(noisy.state_dict())
    with torch.inference_mode():
        assert (clean.source(f0) - a).abs().max() > 1e-3
        assert torch.equal(clean.source(f0), clean.source(f0))
    # whole-pipeline audio: same seed same wav, different seed different wav
    mel = _tiny_mel(10)
    w1, _ = noisy.inference(mel, generator=torch.Generator().manual_seed(7))
    w2, _ = noisy.inference(mel, generator=torch.Generator().manual_seed(7))
    w3, _ = noisy.inference(mel, generator=torch.Generator().manual_seed(8))
    assert torch.equal(w1, w2) and not torch.equal(w1, w3)


def test_global_rng_is_not_used():
    model = HiFTGenerator(TINY, nsf_noise=True).eval()
    before = torch.get_rng_state()
    model.inference(_tiny_mel(6), generator=torch.Generator().manual_seed(0))
    model.inference(_tiny_mel(6))  # no generator: a fresh OS-seeded one, still not the global RNG
    assert torch.equal(before, torch.get_rng_state())


def test_remove_weight_norm_keeps_outputs():
    model = _tiny_model(3)
    # a fresh instance, not copy.deepcopy: torch's parametrised classes are shared between a
    # module and its deepcopy, and folding one deletes the other's `weight` property
    folded = HiFTGenerator(TINY, nsf_noise=False).eval()
    folded.load_state_dict(model.state_dict())
    folded.remove_weight_norm()
    assert not any("parametrizations" in k for k in folded.state_dict())
    mel = _tiny_mel(10)
    wa, sa = model.inference(mel)
    wb, sb = folded.inference(mel)
    assert within((sa - sb).abs().max(), FOLD_SOURCE_ATOL, "source")
    assert within((wa - wb).abs().max(), FOLD_WAVE_ATOL, "wave")


def test_batch_rows_match_single_rows():
    model = _tiny_model(4)
    mels = torch.cat([_tiny_mel(8, seed=1), _tiny_mel(8, seed=2)])
    wav, src = model.inference(mels)
    for b in range(2):
        w1, s1 = model.inference(mels[b : b + 1])
        assert within((wav[b : b + 1] - w1).abs().max(), BATCH_ATOL, "wave")
        assert within((src[b : b + 1] - s1).abs().max(), SOURCE_BATCH_ATOL, "source")
