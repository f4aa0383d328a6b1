"""Write a random-weight CosyVoice2 model folder in the official layout (`make_model`).

Design notes: docs/model.md.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from app.model.flow import CausalFlow
from app.model.hift import HiFTGenerator
from app.model.hparams import load_hparams
from app.model.llm import SpeechLM
from app.model.random.init import calibrate_eos, calibrate_hift, calibration_mel, randomize
from app.model.random.sizes import ModelSize
from app.model.random.standins import write_campplus, write_speech_tokenizer
from app.model.random.tokenizer_files import write_qwen2_tokenizer, write_qwen_config, write_safetensors_skeleton
from app.model.random.yaml_template import render_cosyvoice2_yaml
from app.model.source import RANDOM_MARKER

BLANK_EN = "CosyVoice-BlankEN"


def _save(sd: dict[str, torch.Tensor], path: Path) -> None:
    torch.save({k: v.detach().contiguous().cpu() for k, v in sd.items()}, path)


def make_model(out: Path, size: ModelSize, seed: int = 0, tokenizer_from: Path | None = None,
               force: bool = False) -> dict:
    """Write the folder; returns a report (parameter and tensor counts per file, seconds)."""
    t0 = time.perf_counter()
    if out.exists() and any(out.iterdir()):
        if not force:
            raise FileExistsError(f"{out} exists and is not empty (use --force to overwrite)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cosyvoice2.yaml").write_text(render_cosyvoice2_yaml(size), encoding="utf-8")
    blank = out / BLANK_EN
    write_qwen2_tokenizer(blank, tokenizer_from)
    write_qwen_config(blank, size)
    write_safetensors_skeleton(blank, size)
    write_campplus(out / "campplus.onnx", seed)
    write_speech_tokenizer(out / "speech_tokenizer_v2.onnx", seed + 1)
    hp = load_hparams(out)

    g = torch.Generator().manual_seed(seed)
    report: dict = {"size": size.name, "seed": seed, "files": {}}

    llm = SpeechLM(hp.llm).eval()
    randomize(llm, g, hidden=hp.llm.qwen.hidden_size)
    calibrate_eos(llm, g)
    sd = llm.state_dict()
    # the official file ties Qwen's (unused) lm_head to embed_tokens: one storage, two keys
    sd["llm.model.lm_head.weight"] = sd["llm.model.model.embed_tokens.weight"]
    _save(sd, out / "llm.pt")
    report["files"]["llm"] = _counts(sd)
    del llm, sd

    flow = CausalFlow(hp.flow).eval()
    randomize(flow, g)
    _save(flow.state_dict(), out / "flow.pt")
    report["files"]["flow"] = _counts(flow.state_dict())
    del flow

    hift = HiFTGenerator(hp.hift, nsf_noise=False).eval()
    randomize(hift, g)
    calibrate_hift(hift, calibration_mel(hp.feat))
    _save(hift.state_dict(), out / "hift.pt")  # torch>=2.1 weight-norm key style, as official
    report["files"]["hift"] = _counts(hift.state_dict())
    report["seconds"] = round(time.perf_counter() - t0, 1)
    # the mark the service reads (app/model/source.py:is_random): /health's random_model, the page's notice
    (out / RANDOM_MARKER).write_text(json.dumps({"random_weights": True, "size": size.name, "seed": seed}),
                                     encoding="utf-8")
    return report


def _counts(sd: dict[str, torch.Tensor]) -> dict[str, int]:
    return {"tensors": len(sd), "params": sum(v.numel() for v in sd.values())}


# Published sizes of the official CosyVoice2-0.5B files (cosyvoice_internals.md §1.1, §1.3):
# tensor counts are exact; llm parameters follow exactly from the published shapes (lm_head
# counted separately from the tied embed_tokens); flow/hift are published rounded to 0.1 M.
OFFICIAL_TENSORS = {"llm": 295, "flow": 1121, "hift": 328}
OFFICIAL_PARAMS = {"llm": 641_938_468, "flow": 112_500_000, "hift": 20_800_000}
OFFICIAL_PARAMS_ROUNDING = {"llm": 0, "flow": 50_000, "hift": 50_000}

def compare_official(report: dict) -> list[str]:
    """Mismatches between a `full` model's counts and the official files' (empty = equal)."""
    bad = []
    for name, counts in report["files"].items():
        if counts["tensors"] != OFFICIAL_TENSORS[name]:
            bad.append(f"{name}: {counts['tensors']} tensors, official {OFFICIAL_TENSORS[name]}")
        if abs(counts["params"] - OFFICIAL_PARAMS[name]) > OFFICIAL_PARAMS_ROUNDING[name]:
            bad.append(f"{name}: {counts['params']:,} parameters, official {OFFICIAL_PARAMS[name]:,}")
    return bad
