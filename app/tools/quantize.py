"""AWQ W4A16 quantization of the exported speech LM with llm-compressor; vLLM loads the result by config.

Runs in `.venv-quant` (scripts/setup_quantize.sh). Design notes: docs/design.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from app.tools.calibration import OFFICIAL_RAS, RASParams, calibration_samples, load_export_lm, source_sampling

SCHEME = "W4A16_ASYM"  # 4-bit weights, 16-bit activations, asymmetric (int zero points)
DEFAULT_GROUP_SIZE = 128  # the W4A16_ASYM preset's group
# vLLM kernel limits (checked in vllm 0.26/0.32 sources): Marlin takes groups 32/64/128, Machete
# 64/128; the CPU kernel (CPUWNA16) needs an even group and in/out dims that are multiples of 32.
GROUP_SIZES = (32, 64, 128)
CPU_DIM_MULTIPLE = 32
REPORT_FILE = "quantize_report.json"


def safetensors_bytes(folder: Path) -> dict[str, int]:
    """Bytes of every tensor in `folder/*.safetensors`, read from the file headers only."""
    sizes: dict[str, int] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                start, end = meta["data_offsets"]
                sizes[name] = end - start
    return sizes


def lm_weight_bytes(folder: Path) -> dict[str, int]:
    """{'total', 'layers' (the quantizable Linears and their scales/zeros), 'other'} in bytes."""
    sizes = safetensors_bytes(folder)
    layers = sum(v for k, v in sizes.items() if k.startswith("model.layers.") and "layernorm" not in k)
    total = sum(sizes.values())
    return {"total": total, "layers": layers, "other": total - layers}


def module_weight_bytes(module: nn.Module) -> dict[str, int]:
    """Bytes of a loaded LM's parameters, split like `lm_weight_bytes`; for vLLM's `apply_model`,
    to measure what an engine holds after repacking for its kernels (buffers such as the rotary
    cos/sin cache are not weights and are left out)."""
    sizes = {name: p.numel() * p.element_size() for name, p in module.named_parameters()}
    layers = sum(v for k, v in sizes.items() if ".layers." in f".{k}" and "layernorm" not in k)
    total = sum(sizes.values())
    return {"total": total, "layers": layers, "other": total - layers}


def check_shapes(model: nn.Module, group_size: int) -> list[str]:
    """Raise if a targeted Linear cannot run on vLLM's W4A16 kernels; returns the GPU-only warnings."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"--group-size must be one of {GROUP_SIZES} (vLLM's Marlin/Machete/CPU kernels)")
    warnings = []
    for name, mod in model.model.layers.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        k, n = mod.in_features, mod.out_features
        if k % group_size:
            raise ValueError(f"layers.{name}: {k} inputs do not split into groups of {group_size}; "
                             f"choose a --group-size from {GROUP_SIZES} that divides it")
        if k % CPU_DIM_MULTIPLE or n % CPU_DIM_MULTIPLE:
            raise ValueError(f"layers.{name} is {k}x{n}: vLLM's CPU W4A16 kernel needs multiples of "
                             f"{CPU_DIM_MULTIPLE}; this model cannot be quantized for it")
        if k % 128 or n % 64:
            warnings.append(f"layers.{name} ({k}x{n}) misses Marlin's tiles (in % 128, out % 64): "
                            "vLLM on GPU falls back to a slower kernel")
    return warnings


@contextlib.contextmanager
def _cpu_only_torch_fixes() -> Iterator[None]:
    """llm-compressor 0.14.0.1 pins AWQ's cached activations with `pin_memory()`, which raises
    'Cannot access accelerator device' on a CPU-only torch; pinning is pointless there, so skip it."""
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        yield
        return
    original = IntermediatesCache.pin_memory
    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = original


def _stub_processor():
    """oneshot insists on a processor whenever a dataset is given, and the export has no tokenizer
    (its vocabulary is speech tokens); our calibration batches are already model inputs, so an
    empty tokenizer satisfies it. It is never saved (oneshot gets no output_dir)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))


def _recipe(group_size: int) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    if group_size == DEFAULT_GROUP_SIZE:
        quant = QuantizationModifier(ignore=["lm_head"], scheme=SCHEME, targets=["Linear"])
    else:
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        weights = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=group_size, symmetric=False)
        quant = QuantizationModifier(ignore=["lm_head"], config_groups={
            "group_0": QuantizationScheme(targets=["Linear"], weights=weights)})
    # AWQ searches per-channel scales that move activation outliers into the weights before rounding
    return [AWQModifier(), quant]


@torch.inference_mode()
def _speech_logp(model: nn.Module, samples: list[dict[str, Tensor]], n_valid: int) -> list[Tensor]:
    """log-probs `[T, n_valid]` (float32) of the next token at every position of each sample."""
    return [model(**s).logits[0, :, :n_valid].float().log_softmax(dim=-1) for s in samples]


def _agreement(before: list[Tensor], after: list[Tensor]) -> dict[str, float]:
    """Teacher-forced top-1 agreement and mean KL(before || after) over all positions."""
    b, a = torch.cat(before), torch.cat(after)
    kl = (b.exp() * (b - a)).sum(dim=-1)
    return {"top1_agreement": round(float((b.argmax(-1) == a.argmax(-1)).float().mean()), 4),
            "kl_mean": round(float(kl.mean()), 6), "positions": int(b.shape[0])}


def _write_config(export_dir: Path, out: Path, meta: dict) -> None:
    """config.json = the export's (architectures, vocab, cosyvoice2_export) + quantization_config."""
    saved = json.loads((out / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" not in saved:
        raise RuntimeError("llm-compressor saved no quantization_config; the folder would load unquantized")
    config = json.loads((export_dir / "config.json").read_text(encoding="utf-8"))
    config["quantization_config"] = saved["quantization_config"]
    config["cosyvoice2_quantize"] = meta
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _save(model: nn.Module, export_dir: Path, out_dir: Path, meta: dict) -> None:
    """save_pretrained(save_compressed=True) into a temp folder, fix it up, then rename into place.

    The head is saved bias-free (vLLM's stock Qwen2 head has no bias parameter and would refuse one);
    the export's bias file goes beside it unchanged.
    """
    from app.model.vllm_export import HEAD_BIAS_FILE

    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    biased = model.lm_head
    head = nn.Linear(biased.in_features, biased.out_features, bias=False, dtype=biased.weight.dtype)
    head.weight = biased.weight  # the same tensor (not quantized: the recipe ignores lm_head)
    try:
        model.lm_head = head
        with contextlib.redirect_stdout(sys.stderr):
            model.save_pretrained(str(tmp), save_compressed=True)
        (tmp / "generation_config.json").unlink(missing_ok=True)  # vLLM would read sampling defaults from it
        if "lm_head.bias" in safetensors_bytes(tmp) or "lm_head.weight" not in safetensors_bytes(tmp):
            raise RuntimeError("the saved head is not the bias-free lm_head.weight vLLM's Qwen2 loads")
        (tmp / HEAD_BIAS_FILE).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(export_dir / HEAD_BIAS_FILE, tmp / HEAD_BIAS_FILE)
        _write_config(export_dir, tmp, meta)
        if out_dir.exists():
            shutil.rmtree(out_dir)  # only with --force (quantize checked it)
        os.rename(tmp, out_dir)
    finally:
        model.lm_head = biased
        shutil.rmtree(tmp, ignore_errors=True)


def _calibration(model: nn.Module, n_samples: int, n_eval: int, seq_len: int, seed: int,
                 prefixes: list[Tensor] | None, ras: RASParams) -> tuple[list[dict], list[dict]]:
    """Sampled calibration sequences and held-out ones, in the export's dtype, the model back on the CPU."""
    # on a GPU if there is one; on CPU in float32 (torch's CPU bf16 matmuls are ~100x slower at decode
    # batch sizes). bf16/fp16 -> fp32 -> back is exact: AWQ sees the export's weights.
    dtype, device = model.dtype, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device, torch.float32 if device.type == "cpu" else dtype)
    generator = torch.Generator().manual_seed(seed)
    samples = calibration_samples(model, n_samples + n_eval, seq_len, generator, prefixes=prefixes, ras=ras)
    model.to("cpu", dtype)  # llm-compressor moves one layer at a time to its device
    samples = [{k: v.to(dtype) if v.is_floating_point() else v for k, v in s.items()} for s in samples]
    return samples[:n_samples], samples[n_samples:]


def quantize(export_dir: Path, out_dir: Path, *, model_dir: Path | None = None, n_samples: int = 64,
             seq_len: int = 256, seed: int = 0, group_size: int = DEFAULT_GROUP_SIZE, n_eval: int = 4,
             force: bool = False) -> dict:
    """Write the W4A16 folder `out_dir` from the export `export_dir`; returns the report dict."""
    t0 = time.perf_counter()
    export_dir, out_dir = Path(export_dir).resolve(), Path(out_dir).resolve()
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise FileExistsError(f"{out_dir} exists and is not empty (use --force to replace it)")
    if out_dir == export_dir:
        raise ValueError("OUT_DIR must differ from EXPORT_DIR")
    model = load_export_lm(export_dir)
    export_cfg = json.loads((export_dir / "config.json").read_text(encoding="utf-8"))
    n_valid = int(export_cfg.get("cosyvoice2_export", {}).get("n_valid_tokens", 6564))
    warnings = check_shapes(model, group_size)
    ras, prefixes = OFFICIAL_RAS, None
    if model_dir is not None:
        ras, prefixes = source_sampling(Path(model_dir), export_dir, export_cfg)
    t_load = time.perf_counter()

    calib, held_out = _calibration(model, n_samples, n_eval, seq_len, seed, prefixes, ras)
    logp_before = _speech_logp(model, held_out, n_valid)
    t_data = time.perf_counter()

    # llm-compressor logs to the stdout of its import time; keep stdout for the JSON report
    with contextlib.redirect_stdout(sys.stderr), _cpu_only_torch_fixes():
        from llmcompressor import oneshot
        from torch.utils.data import DataLoader

        # batch_size=None: each sample is already a batch of one (input_ids or inputs_embeds)
        oneshot(model=model, processor=_stub_processor(), dataset=DataLoader(calib, batch_size=None),
                recipe=_recipe(group_size))
    t_awq = time.perf_counter()
    quality = _agreement(logp_before, _speech_logp(model, held_out, n_valid)) if held_out else {}

    meta = {"scheme": SCHEME, "group_size": group_size, "samples": n_samples, "seq_len": seq_len, "seed": seed,
            "calibration": "text-prefixed" if prefixes else "speech-ids", "source_export": export_dir.name}
    _save(model, export_dir, out_dir, meta)
    t_end = time.perf_counter()

    before, after = lm_weight_bytes(export_dir), lm_weight_bytes(out_dir)
    report = {
        "export_dir": str(export_dir), "out_dir": str(out_dir), "dtype": export_cfg.get("torch_dtype"),
        **meta, "eval_samples": len(held_out),
        "lm_weight_bytes_before": before, "lm_weight_bytes_after": after,
        "layers_compression": round(before["layers"] / after["layers"], 2),
        "held_out": quality, "warnings": warnings,
        "seconds": {"load": round(t_load - t0, 2), "calibration_data": round(t_data - t_load, 2),
                    "awq": round(t_awq - t_data, 2), "save": round(t_end - t_awq, 2),
                    "total": round(t_end - t0, 2)},
    }
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.tools.quantize", description=__doc__.split("\n\n")[0],
                                epilog="Runs in the separate .venv-quant (scripts/setup_quantize.sh). Prints a JSON "
                                "report (also saved as quantize_report.json). Design notes: docs/design.md.")
    p.add_argument("export_dir", type=Path, help="folder written by app.model.vllm_export.export_lm_for_vllm")
    p.add_argument("out_dir", type=Path, help="where the W4A16 folder goes (must not exist or be empty)")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="the CosyVoice2 folder of the export: calibrate on real text-prefixed LM inputs")
    p.add_argument("--samples", type=int, default=64, help="calibration sequences (default 64)")
    p.add_argument("--seq-len", type=int, default=256, help="sampled speech tokens per sequence (default 256)")
    p.add_argument("--seed", type=int, default=0, help="seed of the calibration sampler")
    p.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE, choices=GROUP_SIZES,
                   help="inputs per scale/zero point (default 128)")
    p.add_argument("--eval-samples", type=int, default=4,
                   help="extra sampled sequences held out to measure agreement before/after (default 4)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0 = torch's default; 1 is fastest for tiny models on a busy box)")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    args = p.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.samples < 1 or args.seq_len < 2 or args.eval_samples < 0:
        p.error("need --samples >= 1, --seq-len >= 2, --eval-samples >= 0")
    try:
        report = quantize(args.export_dir, args.out_dir, model_dir=args.model_dir, n_samples=args.samples,
                          seq_len=args.seq_len, seed=args.seed, group_size=args.group_size,
                          n_eval=args.eval_samples, force=args.force)
    except (FileExistsError, ValueError, OSError) as e:
        print(f"quantize: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
