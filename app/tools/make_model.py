"""Write a random-weight CosyVoice2 model folder in the official layout.

    python -m app.tools.make_model OUT --size tiny|full [--seed N] [--tokenizer-from DIR]

`tiny` runs fast on a 2-core CPU and keeps Qwen2 head_dim 64 (vLLM's CPU attention needs it);
`full` has CosyVoice2-0.5B's dimensions (same parameter counts, same FLOPs) for GPU benchmarks.
The folder loads through `app.model.loader.load_model` exactly like the real one. Its audio is
noise by design. Nothing is written outside OUT.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from app.model.flow import CausalFlow
from app.model.hift import HiFTGenerator
from app.model.hparams import load_hparams
from app.model.llm import SpeechLM
from app.tools.model_sizes import SIZES, ModelSize
from app.tools.onnx_standins import write_campplus, write_speech_tokenizer
from app.tools.random_init import calibrate_eos, calibrate_hift, calibration_mel, randomize
from app.tools.tokenizer_files import write_qwen2_tokenizer, write_qwen_config, write_safetensors_skeleton
from app.tools.yaml_template import render_cosyvoice2_yaml

# Published sizes of the official CosyVoice2-0.5B files (cosyvoice_internals.md §1.1, §1.3):
# tensor counts are exact; llm parameters follow exactly from the published shapes (lm_head
# counted separately from the tied embed_tokens); flow/hift are published rounded to 0.1 M.
OFFICIAL_TENSORS = {"llm": 295, "flow": 1121, "hift": 328}
OFFICIAL_PARAMS = {"llm": 641_938_468, "flow": 112_500_000, "hift": 20_800_000}
OFFICIAL_PARAMS_ROUNDING = {"llm": 0, "flow": 50_000, "hift": 50_000}

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
    return report


def _counts(sd: dict[str, torch.Tensor]) -> dict[str, int]:
    return {"tensors": len(sd), "params": sum(v.numel() for v in sd.values())}


def compare_official(report: dict) -> list[str]:
    """Mismatches between a `full` model's counts and the official files' (empty = equal)."""
    bad = []
    for name, counts in report["files"].items():
        if counts["tensors"] != OFFICIAL_TENSORS[name]:
            bad.append(f"{name}: {counts['tensors']} tensors, official {OFFICIAL_TENSORS[name]}")
        if abs(counts["params"] - OFFICIAL_PARAMS[name]) > OFFICIAL_PARAMS_ROUNDING[name]:
            bad.append(f"{name}: {counts['params']:,} parameters, official {OFFICIAL_PARAMS[name]:,}")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.tools.make_model", description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-from", type=Path, default=None,
                   help="copy vocab.json/merges.txt of a real Qwen2 tokenizer instead of building one")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    try:
        report = make_model(args.out, SIZES[args.size], args.seed, args.tokenizer_from, args.force)
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.size == "full":
        mismatches = compare_official(report)
        report["equals_official_counts"] = not mismatches
        for line in mismatches:
            print("MISMATCH", line, file=sys.stderr)
    print(json.dumps(report))
    return 0 if report.get("equals_official_counts", True) else 1


if __name__ == "__main__":
    sys.exit(main())
