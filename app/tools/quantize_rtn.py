"""Round-to-nearest W4A16 of the exported speech LM, with no extra packages.

    python -m app.tools.quantize_rtn EXPORT_DIR OUT_DIR [--group-size 128]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from app.model.vllm_export import HEAD_BIAS_FILE, HEAD_BIAS_KEY, load_head_bias

NUM_BITS = 4
QMIN, QMAX = -(1 << (NUM_BITS - 1)), (1 << (NUM_BITS - 1)) - 1  # signed int4 range [-8, 7]
PACK = 32 // NUM_BITS  # values per int32
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_weight(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q int8 [out, in] in [-8, 7], scale [out, in/g], zero_point int8 [out, in/g]).

    Asymmetric min/max per group, with 0 kept representable; dequantised w = (q - zp) * scale.
    """
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // group_size, group_size)
    lo = g.amin(dim=2).clamp(max=0.0)
    hi = g.amax(dim=2).clamp(min=0.0)
    scale = ((hi - lo) / (QMAX - QMIN)).clamp(min=torch.finfo(torch.float32).tiny)
    scale = scale.to(w.dtype).float()  # the stored (16-bit) scale is the one dequantisation uses
    zp = (QMIN - torch.round(lo / scale)).clamp(QMIN, QMAX)
    q = (torch.round(g / scale[..., None]) + zp[..., None]).clamp(QMIN, QMAX)
    return q.reshape(out_f, in_f).to(torch.int8), scale.to(w.dtype), zp.to(torch.int8)


def pack_int4(q: torch.Tensor, dim: int) -> torch.Tensor:
    """int8 values in [-8, 7] -> int32, 8 per word along `dim` (first value in the low bits).

    Stored as unsigned nibbles (value + 8), the compressed-tensors convention.
    """
    u = (q.to(torch.int32) - QMIN) & 0xF  # [..] in [0, 15]
    if dim == 0:
        u = u.t()
    rows, cols = u.shape
    assert cols % PACK == 0, (rows, cols)
    u = u.reshape(rows, cols // PACK, PACK)
    shifts = torch.arange(PACK, dtype=torch.int32) * NUM_BITS
    packed = (u << shifts).sum(dim=2, dtype=torch.int64)  # up to 2^32 - 1: wrap into int32 below
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.t().contiguous() if dim == 0 else packed.contiguous()


def unpack_int4(packed: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """Inverse of `pack_int4`: int32 words -> ints in [-8, 7], `n` values along `dim`."""
    words = packed.t() if dim == 0 else packed
    nibbles = (words[..., None] >> torch.arange(0, 32, NUM_BITS)) & 0xF  # [rows, words, 8]
    q = nibbles.reshape(words.shape[0], -1)[:, :n] + QMIN
    return q.t() if dim == 0 else q


def dequantized_state_dict(qdir: Path) -> dict[str, torch.Tensor]:
    """A W4A16 folder's tensors with every packed Linear back as a float32 `weight`, plus the head bias."""
    got = load_file(qdir / "model.safetensors")
    got[HEAD_BIAS_KEY] = load_head_bias(qdir)
    for key in [k for k in got if k.endswith(".weight_packed")]:
        base = key.removesuffix(".weight_packed")
        n_out, n_in = got.pop(base + ".weight_shape").tolist()
        scale = got.pop(base + ".weight_scale").float()  # [out, groups]
        zero = unpack_int4(got.pop(base + ".weight_zero_point"), n_out, dim=0)  # [out, groups]
        group = n_in // scale.shape[1]
        q = unpack_int4(got.pop(key), n_in, dim=1)  # [out, in]
        got[base + ".weight"] = (q - zero.repeat_interleave(group, 1)) * scale.repeat_interleave(group, 1)
    return got


def quantization_config(group_size: int) -> dict:
    weights = {"num_bits": NUM_BITS, "type": "int", "symmetric": False, "strategy": "group",
               "group_size": group_size, "dynamic": False, "actorder": None, "block_structure": None,
               "observer": "minmax", "observer_kwargs": {}, "zp_dtype": "torch.int8", "scale_dtype": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
            "global_compression_ratio": None}


def quantize_folder(export_dir: Path, out_dir: Path, group_size: int = 128, force: bool = False) -> dict:
    """Quantize every decoder Linear of `export_dir` into `out_dir` (atomic); returns a report."""
    t0 = time.perf_counter()
    if out_dir.exists():
        if not force:
            raise FileExistsError(f"{out_dir} exists (use --force)")
        shutil.rmtree(out_dir)
    sd = load_file(export_dir / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    before = after = 0
    for name, t in sd.items():
        stem = name.removesuffix(".weight")
        if name.endswith(".weight") and stem.rsplit(".", 1)[-1] in _LINEARS:
            if t.shape[1] % group_size or t.shape[0] % PACK:
                raise ValueError(f"{name} {tuple(t.shape)}: in must divide by {group_size}, out by {PACK}")
            q, scale, zp = quantize_weight(t, group_size)
            out[f"{stem}.weight_packed"] = pack_int4(q, dim=1)
            out[f"{stem}.weight_scale"] = scale.contiguous()
            out[f"{stem}.weight_zero_point"] = pack_int4(zp, dim=0)
            out[f"{stem}.weight_shape"] = torch.tensor(t.shape, dtype=torch.int64)
            before += t.numel() * t.element_size()
            after += sum(out[f"{stem}.{k}"].numel() * out[f"{stem}.{k}"].element_size()
                         for k in ("weight_packed", "weight_scale", "weight_zero_point"))
        else:
            out[name] = t
    cfg = json.loads((export_dir / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(group_size)
    cfg["cosyvoice2_quantize"] = {"method": "rtn", "group_size": group_size, "source": str(export_dir)}
    tmp = Path(tempfile.mkdtemp(prefix=".rtn-", dir=out_dir.parent))
    try:
        save_file(out, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        (tmp / HEAD_BIAS_FILE).parent.mkdir(parents=True)
        shutil.copyfile(export_dir / HEAD_BIAS_FILE, tmp / HEAD_BIAS_FILE)  # the head's bias, unchanged
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": str(out_dir), "method": "rtn", "group_size": group_size,
            "linear_bytes_before": before, "linear_bytes_after": after,
            "seconds": round(time.perf_counter() - t0, 2)}


@torch.inference_mode()
def token_agreement(model_dir: Path, qdir: Path, n_prompts: int = 4, n_tokens: int = 32, seed: int = 0) -> dict:
    """Teacher-forced top-1 agreement with the fp32 LM of `model_dir`, for the 4-bit weights of
    `qdir` (dequantized, fp32) and, as a floor, for the same LM in bf16.

    The forced sequences are the fp32 model's own greedy continuations of random zero-shot-shaped
    prompts, so agreement = share of positions where the other model's argmax is the same token.
    """
    from app.model.hparams import load_hparams
    from app.model.llm import N_SPEECH_ROWS, SPEECH_TOKEN_SIZE, SpeechLM

    hp = load_hparams(model_dir)
    ref = SpeechLM(hp.llm).eval()
    ref.load_state_dict(torch.load(model_dir / "llm.pt", map_location="cpu", weights_only=True), strict=True)
    quant = SpeechLM(hp.llm).eval()
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    for k, v in dequantized_state_dict(qdir).items():
        if k.startswith("model.layers.") or k == "model.norm.weight":
            sd["llm.model." + k] = v.float()
    sd["llm_decoder.bias"] = load_head_bias(qdir)[:N_SPEECH_ROWS]
    quant.load_state_dict(sd, strict=True)
    half = SpeechLM(hp.llm).eval()
    half.load_state_dict(ref.state_dict(), strict=True)
    half = half.to(torch.bfloat16)
    g = torch.Generator().manual_seed(seed)

    def argmaxes(lm: SpeechLM, prefix: torch.Tensor, forced: list[int]) -> list[int]:
        emb = torch.cat([prefix, ref.embed_speech(forced)], dim=1).to(lm.llm_decoder.weight.dtype)
        logits = lm.llm_decoder(lm.hidden(emb))[0, prefix.shape[1] - 1: -1, :SPEECH_TOKEN_SIZE]
        return logits.argmax(-1).tolist()

    same_q = same_h = total = 0
    for _ in range(n_prompts):
        prefix = ref.build_lm_input(torch.randint(0, 150_000, (20,), generator=g), (),
                                    torch.randint(0, SPEECH_TOKEN_SIZE, (100,), generator=g))
        cache, pending, forced = ref.new_cache(), prefix, []
        for _ in range(n_tokens):
            forced.append(int(ref._feed(pending, cache)[:SPEECH_TOKEN_SIZE].argmax()))
            pending = ref.embed_speech(forced[-1])
        same_q += sum(a == b for a, b in zip(argmaxes(quant, prefix, forced), forced, strict=True))
        same_h += sum(a == b for a, b in zip(argmaxes(half, prefix, forced), forced, strict=True))
        total += n_tokens
    return {"positions": total, "w4a16_vs_fp32_top1": round(same_q / total, 4),
            "bf16_vs_fp32_top1": round(same_h / total, 4)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.tools.quantize_rtn", description=__doc__.split("\n")[0],
                                epilog="Design notes: docs/design.md.")
    p.add_argument("export_dir", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--force", action="store_true")
    p.add_argument("--agreement-model-dir", type=Path, default=None,
                   help="also measure teacher-forced top-1 agreement with this CosyVoice2 folder's fp32 LM")
    args = p.parse_args(argv)
    try:
        report = quantize_folder(args.export_dir, args.out_dir, args.group_size, args.force)
        if args.agreement_model_dir:
            report["agreement"] = token_agreement(args.agreement_model_dir, args.out_dir)
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
