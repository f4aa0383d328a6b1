"""Round-to-nearest W4A16 (no llm-compressor): compressed-tensors' own unpacking reads it back, and
the real vLLM CPU engine loads it by config and streams tokens."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from app.model.llm import SPEECH_TOKEN_SIZE, build_lm_ids
from app.model.vllm_export import export_lm_for_vllm, load_head_bias
from app.tools.quantize_rtn import pack_int4, quantize_folder, quantize_weight


def test_packing_matches_compressed_tensors():
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 256, generator=g) * 0.05).to(torch.bfloat16)
    q, scale, zp = quantize_weight(w, 128)
    assert q.min() >= -8 and q.max() <= 7 and zp.min() >= -8 and zp.max() <= 7
    assert torch.equal(unpack_from_int32(pack_int4(q, 1), 4, q.shape, packed_dim=1).to(torch.int8), q)
    assert torch.equal(unpack_from_int32(pack_int4(zp, 0), 4, zp.shape, packed_dim=0).to(torch.int8), zp)
    deq = (q.float().reshape(64, 2, 128) - zp.float()[..., None]) * scale.float()[..., None]
    err = (deq.reshape(64, 256) - w.float()).abs() / scale.float().repeat_interleave(128, dim=1)  # in steps
    # rounding: half a step inside the range; the 16-bit scale and integer zero point can clip the
    # extremes by up to one step; uniform rounding error averages a quarter step
    assert err.max() <= 1.0 + 1e-3 and err.mean() < 0.3, (err.max(), err.mean())


@pytest.fixture(scope="module")
def rtn_dir(tiny_model_dir, tmp_path_factory):
    export = export_lm_for_vllm(tiny_model_dir, tmp_path_factory.mktemp("cache"), dtype="bfloat16")
    out = tmp_path_factory.mktemp("rtn") / "tiny-rtn"
    report = quantize_folder(export, out, group_size=128)
    assert report["linear_bytes_after"] < report["linear_bytes_before"] / 3
    return out


def test_folder_layout(rtn_dir, tiny_model_dir):
    cfg = json.loads((rtn_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and "cosyvoice2_export" in cfg
    assert cfg["quantization_config"]["format"] == "pack-quantized"
    sd = load_file(rtn_dir / "model.safetensors")
    assert "lm_head.weight" in sd and "model.embed_tokens.weight" in sd
    assert "lm_head.bias" not in sd  # vLLM's stock Qwen2 head has none; the bias file travels beside it
    official = torch.load(tiny_model_dir / "llm.pt", weights_only=True)["llm_decoder.bias"]
    assert torch.equal(load_head_bias(rtn_dir)[:official.numel()], official.float())
    assert sd["model.layers.0.mlp.down_proj.weight_packed"].dtype == torch.int32


def test_vllm_loads_rtn_by_config(rtn_dir, tiny_model_dir, tmp_path):
    from app.config import load_config
    from app.engine import vllm_backend
    from app.engine.lm_backend import LMRequest

    cfg = load_config(overrides={
        "model.device": "cpu", "vllm.dtype": "bfloat16", "vllm.enforce_eager": True,
        "vllm.quantized_dir": str(rtn_dir), "vllm.export_cache_dir": str(tmp_path), "vllm.max_model_len": 512,
        "vllm.max_num_seqs": 8, "vllm.cpu_kvcache_space_gib": 1,
        "vllm.cpu_omp_threads_bind": f"0-{(os.cpu_count() or 1) - 1}", "vllm.cpu_num_reserved_cpus": 0})
    prompt = tuple(build_lm_ids(list(range(1000, 1012))))

    async def run() -> tuple[list[int], dict, int]:
        backend = await vllm_backend.VLLMBackend.start(cfg, tiny_model_dir)
        try:
            req = LMRequest("rtn", prompt, min_tokens=16, max_tokens=16, seed=1, sampling=cfg.sampling)
            got = [t async for chunk in backend.stream(req) for t in chunk]
            return got, backend.facts(), backend.n_unfinished()
        finally:
            await backend.aclose()

    env_before = dict(os.environ)
    try:
        got, facts, unfinished = asyncio.run(run())
    finally:
        for key in set(os.environ) - set(env_before):
            del os.environ[key]
    assert facts["quantization"] == "compressed-tensors"
    assert len(got) == 16 and all(0 <= t < SPEECH_TOKEN_SIZE for t in got) and unfinished == 0
