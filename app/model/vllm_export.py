"""Export the speech LM of a CosyVoice2 folder as a Hugging Face-format Qwen2 folder for vLLM.

Design notes: docs/model.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from app.model.hparams import ModelFolderError, load_hparams
from app.model.llm import EOS_TOKEN, N_SPEECH_ROWS, SPEECH_ID_ROWS, TEXT_ID_OFFSET

ARCHITECTURE = "Qwen2ForCausalLM"  # shipped by vLLM and transformers: no plugin
HEAD_BIAS_FILE = "cosyvoice2/lm_head_bias.safetensors"  # not a top-level *.safetensors: vLLM never loads it
HEAD_BIAS_KEY = "lm_head.bias"
VOCAB_MULTIPLE = 64  # vocab rows padded to a multiple of 64 (GPU-friendly lm_head / embedding shapes)
PAD_BIAS = -1.0e4  # finite (fp16-safe) bias of the padded lm_head rows: exp(-1e4) == 0 in every dtype
# bump when the layout below changes (recorded in config.json and in the folder name). 1: architecture
# CosyVoice2ForCausalLM with lm_head.bias in model.safetensors (needed a vLLM plugin); 2: the speech table
# only (prompts as embeddings); 3: this layout.
EXPORT_FORMAT = 3
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_LAYER_PREFIX = "llm.model.model.layers."
_DROPPED = ("llm.model.lm_head.weight",)
_TABLES = ("speech_embedding.weight", "llm_embedding.weight", "llm.model.model.embed_tokens.weight")


def padded_vocab_size(n_rows: int) -> int:
    """Rows of the exported embedding / lm_head: `n_rows` up to a multiple of 64."""
    return -(-n_rows // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def file_sha256(path: Path, chunk_bytes: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def _pad_rows(t: torch.Tensor, n_rows: int, fill: float) -> torch.Tensor:
    """`t [R, ...]` -> `[n_rows, ...]`, new rows set to `fill`."""
    out = torch.full((n_rows, *t.shape[1:]), fill, dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


def lm_tensors(sd: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The exported tensors (HF Qwen2 names) from an official `llm.pt` state dict.

    All in `dtype` except `lm_head.bias`, kept float32: it is added to vLLM's float32 logits, so the
    official fp32 values are used as they are (the head bias for HEAD_BIAS_FILE, not model.safetensors).
    """
    for key in (*_TABLES, "llm_decoder.weight", "llm_decoder.bias", "llm.model.model.norm.weight"):
        if key not in sd:
            raise ModelFolderError(f"llm.pt has no {key}: not a CosyVoice2 speech LM checkpoint")
    rows = sd["speech_embedding.weight"].shape[0]
    if rows != N_SPEECH_ROWS or sd["llm_decoder.weight"].shape[0] != N_SPEECH_ROWS:
        raise ModelFolderError(f"llm.pt speech tables have {rows} rows, expected {N_SPEECH_ROWS}")
    text = sd["llm.model.model.embed_tokens.weight"]
    vocab = padded_vocab_size(TEXT_ID_OFFSET + text.shape[0])
    table = torch.cat([_pad_rows(sd["speech_embedding.weight"], SPEECH_ID_ROWS, 0.0), sd["llm_embedding.weight"],
                       text.to(sd["speech_embedding.weight"].dtype)])
    out = {
        "model.embed_tokens.weight": _pad_rows(table, vocab, 0.0),
        "lm_head.weight": _pad_rows(sd["llm_decoder.weight"], vocab, 0.0),
        "lm_head.bias": _pad_rows(sd["llm_decoder.bias"], vocab, PAD_BIAS),
        "model.norm.weight": sd["llm.model.model.norm.weight"],
    }
    known = {*_TABLES, "llm_decoder.weight", "llm_decoder.bias", "llm.model.model.norm.weight", *_DROPPED}
    for key, t in sd.items():
        if key.startswith(_LAYER_PREFIX):
            out["model.layers." + key[len(_LAYER_PREFIX):]] = t
        elif key not in known:
            raise ModelFolderError(f"llm.pt has an unexpected tensor {key!r}; the export would drop it")
    return {k: v.to(dtype=torch.float32 if k == HEAD_BIAS_KEY else dtype, copy=True).contiguous()
            for k, v in out.items()}


def load_head_bias(folder: Path) -> torch.Tensor:
    """`[V]` float32 lm_head bias of an export (or quantized) folder; ModelFolderError if it has none."""
    path = Path(folder) / HEAD_BIAS_FILE
    if not path.is_file():
        raise ModelFolderError(f"{folder} has no {HEAD_BIAS_FILE}: not a CosyVoice2 LM export of format "
                               f"{EXPORT_FORMAT} (export again: app.model.vllm_export; quantize again)")
    return load_file(path)[HEAD_BIAS_KEY].float()


def save_head_bias(bias: torch.Tensor, folder: Path) -> None:
    """Write `bias [V]` (as float32) to `folder/HEAD_BIAS_FILE`."""
    path = Path(folder) / HEAD_BIAS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({HEAD_BIAS_KEY: bias.detach().float().contiguous()}, str(path), metadata={"format": "pt"})


def hf_config(model_dir: Path, dtype: str, source_sha256: str, vocab: int) -> dict:
    """config.json: the folder's Qwen2 config with the one id space (`vocab` rows) and an untied head."""
    qwen = load_hparams(model_dir).llm.qwen
    base = json.loads((model_dir / "CosyVoice-BlankEN" / "config.json").read_text(encoding="utf-8"))
    for k in ("bos_token_id", "eos_token_id", "pad_token_id", "transformers_version", "dtype", "torch_dtype"):
        base.pop(k, None)  # no text special ids: stops come from SamplingParams.stop_token_ids
    base.update(
        architectures=[ARCHITECTURE], model_type="qwen2", vocab_size=vocab,
        tie_word_embeddings=False, torch_dtype=dtype,
        hidden_size=qwen.hidden_size, num_hidden_layers=qwen.num_layers, num_attention_heads=qwen.num_heads,
        num_key_value_heads=qwen.num_kv_heads, intermediate_size=qwen.intermediate_size,
        rms_norm_eps=qwen.rms_norm_eps, rope_theta=qwen.rope_theta,
        max_position_embeddings=qwen.max_position_embeddings,
        cosyvoice2_export={"format": EXPORT_FORMAT, "llm_pt_sha256": source_sha256,
                           "n_valid_tokens": N_SPEECH_ROWS, "eos_token": EOS_TOKEN, "pad_bias": PAD_BIAS,
                           "head_bias_file": HEAD_BIAS_FILE, "sos_id": SPEECH_ID_ROWS,
                           "text_id_offset": TEXT_ID_OFFSET},
    )
    return base


def export_lm_for_vllm(model_dir: Path, cache_root: Path, *, dtype: str = "bfloat16") -> Path:
    """Write (once) and return `cache_root/<sha256 of llm.pt, 16 hex>-<dtype>-v<format>/` for vLLM.

    Holds `config.json` (architectures ["Qwen2ForCausalLM"]), `model.safetensors` and
    HEAD_BIAS_FILE (see the module docstring for the tensor map). Idempotent: an existing folder is
    returned as is; a concurrent export of the same key loses the rename race harmlessly.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {dtype!r}")
    model_dir, cache_root = Path(model_dir).expanduser().resolve(), Path(cache_root).expanduser().resolve()
    llm_pt = model_dir / "llm.pt"
    if not llm_pt.is_file():
        raise ModelFolderError(f"missing {llm_pt}")
    if cache_root == model_dir or model_dir in cache_root.parents:
        raise ValueError(f"export cache {cache_root} is inside the model folder {model_dir}; choose another one")
    sha = file_sha256(llm_pt)
    final = cache_root / f"{sha[:16]}-{dtype}-v{EXPORT_FORMAT}"
    if all((final / f).is_file() for f in ("config.json", "model.safetensors", HEAD_BIAS_FILE)):
        return final

    try:
        sd = torch.load(llm_pt, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises many types (pickle, zip, RuntimeError) for bad files
        raise ModelFolderError(f"cannot load {llm_pt}: {e}") from e
    tensors = lm_tensors(sd, _DTYPES[dtype])
    config = hf_config(model_dir, dtype, sha, tensors["lm_head.weight"].shape[0])
    del sd

    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = cache_root / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        save_head_bias(tensors.pop(HEAD_BIAS_KEY), tmp)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        try:
            os.rename(tmp, final)  # atomic on one file system; fails if `final` appeared meanwhile
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
