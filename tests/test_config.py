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
