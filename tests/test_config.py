"""Sampling defaults come from the checkpoint's cosyvoice2.yaml; the TOML only overrides them."""

from __future__ import annotations

import shutil

import pytest

from app.config import ConfigError, load_config
from app.model.hparams import load_hparams


def test_ras_settings_come_from_the_yaml_unless_overridden(parity_model_dir, tmp_path):
    cfg = load_config()
    assert (cfg.sampling.top_p, cfg.sampling.top_k, cfg.sampling.win_size, cfg.sampling.tau_r) == (None,) * 4
    official = load_hparams(parity_model_dir).llm
    got = cfg.sampling.resolved(official)
    assert (got.top_p, got.top_k, got.win_size, got.tau_r) == (official.top_p, official.top_k, official.win_size,
                                                                official.tau_r)
    # a checkpoint whose yaml samples differently: its values, not the official ones
    folder = tmp_path / "m"
    shutil.copytree(parity_model_dir, folder, ignore=shutil.ignore_patterns("*.pt", "*.onnx", "*.safetensors"))
    yaml = folder / "cosyvoice2.yaml"
    text = yaml.read_text()
    assert "top_k: 25" in text
    yaml.write_text(text.replace("top_k: 25", "top_k: 7"))
    other = load_hparams(folder).llm
    assert cfg.sampling.resolved(other).top_k == 7
    # an explicit TOML/--set value wins over any yaml
    assert load_config(None, {"sampling.top_k": 3}).sampling.resolved(other).top_k == 3
    with pytest.raises(ConfigError):
        load_config(None, {"sampling.top_p": 1.5})


def test_the_flow_defaults_of_every_config():
    """The official vLLM mode by default: the flow in fp16 on the packed O(chunk) path, and fast.toml the same
    path with a 10-token first hop; exact.toml the fp32 flow (the parity reference); the CPU config keeps its
    fp32 re-solve (no fast fp16 on CPUs); each is one override away from the other; HiFT's graphs (CUDA only)
    everywhere; removed keys are refused."""
    default = load_config()
    for path, incremental, dtype in ((None, True, "float16"), ("configs/fast.toml", True, "float16"),
                                     ("configs/exact.toml", True, "float32"), ("configs/cpu.toml", False, "float32")):
        cfg = load_config(path)
        e = cfg.engine
        assert e.flow_incremental is incremental and e.flow_paged_graphs and e.hift_graphs, path
        assert e.flow_encoder_graphs, path
        assert (cfg.model.flow_dtype, cfg.model.hift_dtype) == (dtype, "float32"), path
        if path in ("configs/fast.toml", "configs/exact.toml"):  # one path: only the hop or the dtype differs
            assert e == default.engine and cfg.vllm == default.vllm, path
    assert default.mode == "official fp16 mode, official schedule"
    assert load_config("configs/fast.toml").mode == "official fp16 mode, 10-token first hop"
    assert load_config("configs/exact.toml").mode == "exact mode (fp32 flow), official schedule"
    assert load_config(None, {"engine.flow_incremental": False}).engine.flow_incremental is False
    assert load_config("configs/fast.toml", {"engine.flow_incremental": True}).engine.flow_incremental is True
    with pytest.raises(ConfigError, match="first_chunk_priority"):
        load_config(None, {"engine.first_chunk_priority": False})
    for bad in ({"engine.flow_state_fraction": 1.0}, {"engine.flow_state_max_gib": -1}):
        with pytest.raises(ConfigError):
            load_config(None, bad)


def test_state_pool_sizing():
    """CUDA: the fraction of the memory free after warm-up, at least one 10 s stream (FLOOR_BLOCKS) while
    HEADROOM_BYTES stay free, at most flow_state_max_gib; CPU: flow_state_gib."""
    from app.engine.flow_budget import FLOOR_BLOCKS, HEADROOM_BYTES, pool_bytes

    gib, block = 2**30, 229_376_000  # one fp32 block of CosyVoice2-0.5B (app/model/flow/incremental/paged.py)
    kw = {"fraction": 0.7, "max_gib": 0.0, "cpu_gib": 4.0, "block_bytes": block}
    assert pool_bytes(**kw, free_bytes=None) == 4 * gib
    assert pool_bytes(**kw, free_bytes=110 * gib) == int(0.7 * 110 * gib)  # an H200 after warm-up
    assert pool_bytes(**kw | {"max_gib": 32.0}, free_bytes=110 * gib) == 32 * gib
    assert pool_bytes(**kw | {"fraction": 0.1}, free_bytes=8 * gib) == FLOOR_BLOCKS * block  # the floor
    assert pool_bytes(**kw, free_bytes=4 * gib) == 4 * gib - HEADROOM_BYTES  # floor cut to leave the headroom
    assert pool_bytes(**kw, free_bytes=gib // 2) == int(0.7 * gib // 2)  # nothing left: the fraction only
