"""Model-folder loading: strict loads, dims from the yaml, clear errors naming the bad file."""

from __future__ import annotations

import shutil

import pytest
import torch

from app.model.flow import CausalFlow
from app.model.hift import HiFTGenerator
from app.model.hparams import ModelFolderError, load_hparams
from app.model.llm import SpeechLM
from app.model.loader import load_model
from app.model.random.make import OFFICIAL_PARAMS, OFFICIAL_TENSORS, compare_official
from app.model.random.sizes import FULL
from app.model.random.tokenizer_files import write_qwen_config
from app.model.random.yaml_template import render_cosyvoice2_yaml


def test_fixture_hparams(parity_model_dir):
    hp = load_hparams(parity_model_dir)
    assert hp.llm.qwen.hidden_size == 32 and hp.llm.qwen.num_layers == 2
    assert hp.flow.encoder.output_size == 64 and hp.flow.estimator.static_chunk_size == 50  # !ref arithmetic
    assert hp.hift.upsample_factor == 480 and hp.feat.fmax == 8000


def test_load_fixture_model(parity_model_dir):
    m = load_model(parity_model_dir, device="cpu")
    counts = {name: c["params"] for name, c in m.checkpoint_counts.items()}  # as stored, per file
    assert counts["hift"] > 0 and counts["flow"] > 0 and counts["llm"] > 0
    assert len(m.frontend.tokenizer) == 151663


def test_full_size_modules_match_official_counts(tmp_path):
    """The `full` yaml builds modules whose state dicts have the official tensor/parameter counts."""
    (tmp_path / "cosyvoice2.yaml").write_text(render_cosyvoice2_yaml(FULL))
    write_qwen_config(tmp_path / "CosyVoice-BlankEN", FULL)
    hp = load_hparams(tmp_path)
    report = {"files": {}}
    with torch.device("meta"):  # shapes only: no 2.5 GB of weights on the CI box
        for name, module in (("llm", SpeechLM(hp.llm)), ("flow", CausalFlow(hp.flow)),
                             ("hift", HiFTGenerator(hp.hift))):
            sd = module.state_dict()
            report["files"][name] = {"tensors": len(sd), "params": sum(v.numel() for v in sd.values())}
    assert compare_official(report) == [], report
    assert report["files"]["llm"]["params"] == OFFICIAL_PARAMS["llm"]
    assert {k: v["tensors"] for k, v in report["files"].items()} == OFFICIAL_TENSORS


@pytest.mark.parametrize("victim", ["llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2.onnx",
                                    "cosyvoice2.yaml", "CosyVoice-BlankEN/config.json"])
def test_missing_file_is_named(parity_model_dir, tmp_path, victim):
    d = tmp_path / "m"
    shutil.copytree(parity_model_dir, d)
    (d / victim).unlink()
    with pytest.raises(ModelFolderError, match=victim.split("/")[-1].replace(".", r"\.")):
        load_model(d, device="cpu")


@pytest.mark.parametrize("victim", ["llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2.onnx"])
def test_corrupt_file_is_named(parity_model_dir, tmp_path, victim):
    d = tmp_path / "m"
    shutil.copytree(parity_model_dir, d)
    (d / victim).write_bytes(b"not a checkpoint")
    with pytest.raises(ModelFolderError, match=victim.replace(".", r"\.")):
        load_model(d, device="cpu")


def test_wrong_dims_fail_strictly(parity_model_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(parity_model_dir, d)
    y = (d / "cosyvoice2.yaml").read_text().replace("linear_units: 128", "linear_units: 96")
    (d / "cosyvoice2.yaml").write_text(y)
    with pytest.raises(ModelFolderError, match=r"flow\.pt"):
        load_model(d, device="cpu")


def test_weights_only_refuses_pickled_code(parity_model_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(parity_model_dir, d)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"x": Evil()}, d / "hift.pt")
    with pytest.raises(ModelFolderError, match=r"hift\.pt"):
        load_model(d, device="cpu")
