"""AWQ W4A16 of the exported speech LM: calibration data, the quantize tool (run in .venv-quant as a
subprocess, its llm-compressor pins clash with vLLM's), and the result in the real vLLM CPU engine,
loaded through `VLLMBackend` by config (`[vllm] quantized_dir`).

Agreement is measured teacher-forced: along the fp32 reference's greedy continuation of a few
text prompts, the next-token argmax of each model is compared position by position (free-running
greedy sequences diverge at the first flip and say little more). The tiny model has random
weights, so its next-token distributions are flat and a small weight change flips the argmax far
more often than it would in the trained model; the numbers go to docs/awq.md as measured.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor

from app.model.hparams import load_hparams
from app.model.llm import N_SPEECH_ROWS, SPEECH_ID_ROWS, SPEECH_TOKEN_SIZE, STOP_TOKENS, SpeechLM, build_lm_ids
from app.model.vllm_export import export_lm_for_vllm, load_head_bias
from app.tools.calibration import calibration_samples, load_export_lm, text_prefixes
from app.tools.quantize import check_shapes, lm_weight_bytes, quantize
from app.tools.quantize_rtn import dequantized_state_dict

REPO = Path(__file__).resolve().parents[1]
QUANT_PYTHON = REPO / ".venv-quant" / "bin" / "python"
PROMPTS = ("Good morning, everyone.", "This is a test of the quantized speech model.", "一二三四五六七八九十。",
           "Short one.")
N_TOKENS = 32  # greedy continuation per prompt


def load_lm(model_dir: Path) -> SpeechLM:
    lm = SpeechLM(load_hparams(model_dir).llm)
    lm.load_state_dict(torch.load(model_dir / "llm.pt", map_location="cpu", weights_only=True), strict=True)
    return lm.eval()


@pytest.fixture(scope="module")
def export_bf16(tiny_model_dir, tmp_path_factory) -> Path:
    return export_lm_for_vllm(tiny_model_dir, tmp_path_factory.mktemp("export"), dtype="bfloat16")


# --- calibration and checks (main venv, no llm-compressor) ---------------------------------------


def test_export_lm_keeps_the_bias(tiny_model_dir, tmp_path):
    """load_export_lm (HF Qwen2 + restored lm_head.bias) gives SpeechLM's log-probs: calibration
    tokens are drawn from the reference model's own distribution."""
    model = load_export_lm(export_lm_for_vllm(tiny_model_dir, tmp_path, dtype="float32"))
    lm = load_lm(tiny_model_dir)
    with torch.inference_mode():
        prefix = lm.build_lm_input(list(range(500, 520)))
        emb = torch.cat([prefix, lm.embed_speech([3, 4000, 6560])], dim=1)
        ref = lm.llm_decoder(lm.hidden(emb)).log_softmax(-1)  # [1, T, 6564]
        got = model(inputs_embeds=emb).logits[..., :N_SPEECH_ROWS].log_softmax(-1)
    assert (got - ref).abs().max().item() < 1e-4


def test_calibration_is_seeded_and_shaped(tiny_model_dir, tmp_path):
    model = load_export_lm(export_lm_for_vllm(tiny_model_dir, tmp_path, dtype="float32"))

    def ids(seed: int) -> Tensor:
        samples = calibration_samples(model, 3, 12, torch.Generator().manual_seed(seed))
        assert [tuple(s) for s in samples] == [("input_ids",)] * 3
        return torch.cat([s["input_ids"] for s in samples])  # [3, 12]

    a, b = ids(0), ids(0)
    assert a.shape == (3, 12) and torch.equal(a, b) and not torch.equal(a, ids(1))
    assert int(a.max()) < SPEECH_TOKEN_SIZE and len(set(a[0].tolist())) > 1

    prefixes = text_prefixes(tiny_model_dir, ("Hello there.", "你好。"))
    samples = calibration_samples(model, 3, 10, torch.Generator().manual_seed(0), prefixes=prefixes)
    for i, s in enumerate(samples):
        p = prefixes[i % 2]
        assert s["inputs_embeds"].shape == (1, p.shape[1] + 10, p.shape[2])
        assert torch.equal(s["inputs_embeds"][:, : p.shape[1]], p)  # the real LM prefix, then speech
        speech = s["inputs_embeds"][0, p.shape[1]:]  # rows of the speech-embedding table
        table = model.get_input_embeddings().weight.detach()[:SPEECH_TOKEN_SIZE]
        assert (speech[:, None] == table[None]).all(-1).any(-1).all()


def test_checks_before_any_work(export_bf16, tmp_path):
    model = load_export_lm(export_bf16)
    assert check_shapes(model, 128) == []  # tiny dims are multiples of 32 and split into 128-groups
    with pytest.raises(ValueError, match="--group-size"):
        check_shapes(model, 96)
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(200, 128)
    with pytest.raises(ValueError, match="groups of 32"):
        check_shapes(model, 32)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("")
    with pytest.raises(FileExistsError, match="--force"):
        quantize(export_bf16, tmp_path / "out")


# --- the quantize tool (.venv-quant) -------------------------------------------------------------


@pytest.fixture(scope="module")
def quantized(export_bf16, tiny_model_dir, tmp_path_factory) -> tuple[Path, dict, float]:
    """(OUT_DIR, report, seconds) of `python -m app.tools.quantize` run in .venv-quant."""
    if not QUANT_PYTHON.is_file():
        msg = f"{QUANT_PYTHON} missing: run `bash scripts/setup_quantize.sh` (scripts/test.sh does)"
        if os.environ.get("CI"):  # CI's setup builds it: a missing venv there is a setup error
            pytest.fail(msg)
        pytest.skip(msg)
    out = tmp_path_factory.mktemp("awq") / "tiny-w4a16"
    cmd = [str(QUANT_PYTHON), "-m", "app.tools.quantize", str(export_bf16), str(out), "--model-dir",
           str(tiny_model_dir), "--samples", "16", "--seq-len", "64", "--seed", "0", "--threads", "1"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\nquantize: {seconds:.1f} s wall; report {json.dumps(report)}")
    return out, report, seconds


def test_quantized_folder_loads_by_config(quantized, export_bf16):
    out, report, _ = quantized
    cfg, src = (json.loads((d / "config.json").read_text()) for d in (out, export_bf16))
    q = cfg.pop("quantization_config")
    assert cfg.pop("cosyvoice2_quantize")["calibration"] == "text-prefixed"
    assert cfg == src  # architectures Qwen2ForCausalLM, vocab 6592, cosyvoice2_export: all kept
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "pack-quantized"
    assert q["ignore"] == ["lm_head"]
    w = q["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["group_size"], w["symmetric"], w["strategy"]) == (4, 128, False, "group")
    assert not (out / "generation_config.json").exists()

    got, ref = load_file(out / "model.safetensors"), load_file(export_bf16 / "model.safetensors")
    for key in ("lm_head.weight", "model.embed_tokens.weight"):
        assert torch.equal(got[key], ref[key]), key  # kept in the export's dtype, untouched
    assert "lm_head.bias" not in got  # vLLM's stock Qwen2 head has no bias: the bias file goes beside it
    assert torch.equal(load_head_bias(out), load_head_bias(export_bf16))
    assert got["model.layers.0.mlp.down_proj.weight_packed"].dtype == torch.int32
    assert "model.layers.0.mlp.down_proj.weight" not in got
    assert report["lm_weight_bytes_after"] == lm_weight_bytes(out)
    assert report["layers_compression"] > 3.5  # bf16 -> 4 bits + group scales/zeros
    assert report["held_out"]["top1_agreement"] > 0.5


# --- the quantized folder in the real vLLM CPU engine --------------------------------------------


def dequantized_lm(model_dir: Path, qdir: Path) -> SpeechLM:
    """SpeechLM (fp32) holding the W4A16 folder's weights, dequantized: (q - zero) * scale per group."""
    sd = torch.load(model_dir / "llm.pt", map_location="cpu", weights_only=True)
    got = dequantized_state_dict(qdir)
    for key, t in got.items():
        if (key.startswith("model.layers.") and key.endswith((".weight", ".bias"))) or key == "model.norm.weight":
            sd["llm.model." + key] = t.float()
    sd["speech_embedding.weight"] = got["model.embed_tokens.weight"][:N_SPEECH_ROWS].float()
    sd["llm_decoder.weight"] = got["lm_head.weight"][:N_SPEECH_ROWS].float()
    sd["llm_decoder.bias"] = got["lm_head.bias"][:N_SPEECH_ROWS].float()
    lm = SpeechLM(load_hparams(model_dir).llm)
    lm.load_state_dict(sd, strict=True)
    return lm.eval()


@torch.inference_mode()
def greedy(lm: SpeechLM, prefix: Tensor, n: int) -> list[int]:
    """Argmax continuation over speech ids (stop ids banned) of `prefix [1, T, D]`."""
    cache, pending, out = lm.new_cache(), prefix, []
    for _ in range(n):
        out.append(int(lm._feed(pending, cache)[:SPEECH_TOKEN_SIZE].argmax()))
        pending = lm.embed_speech(out[-1])
    return out


@torch.inference_mode()
def teacher_forced_argmax(lm: SpeechLM, prefix: Tensor, tokens: list[int]) -> list[int]:
    """Argmax over speech ids after prefix + tokens[:k], for k = 0..len-1 (one forward)."""
    emb = torch.cat([prefix, lm.embed_speech(tokens)], dim=1).to(lm.llm_decoder.weight.dtype)
    logits = lm.llm_decoder(lm.hidden(emb))[0, prefix.shape[1] - 1: -1, :SPEECH_TOKEN_SIZE]
    return logits.argmax(-1).tolist()


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


@pytest.fixture(scope="module")
def awq_engine(quantized, tiny_model_dir, tmp_path_factory):
    """The one VLLMBackend of this module, started from `[vllm] quantized_dir` (bf16 activations)."""
    pytest.importorskip("vllm")
    from app.config import load_config
    from app.engine import vllm_backend

    out, *_ = quantized
    cfg = load_config(overrides={
        "model.device": "cpu", "vllm.dtype": "bfloat16", "vllm.enforce_eager": True,
        "vllm.quantized_dir": str(out), "vllm.quantization": "",  # "" = as config.json says
        "vllm.export_cache_dir": str(tmp_path_factory.mktemp("vllm_cache")), "vllm.max_model_len": 512,
        "vllm.max_num_seqs": 16, "vllm.cpu_kvcache_space_gib": 1,
        "vllm.cpu_omp_threads_bind": f"0-{(os.cpu_count() or 1) - 1}", "vllm.cpu_num_reserved_cpus": 0})
    # apply_model ships a function to the worker; vLLM refuses pickled callables without this
    env_before = dict(os.environ)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    with asyncio.Runner() as runner:
        t0 = time.perf_counter()
        backend = runner.run(vllm_backend.VLLMBackend.start(cfg, tiny_model_dir))
        print(f"\nvLLM start on the AWQ folder: {time.perf_counter() - t0:.1f} s; facts {backend.facts()}")
        try:
            yield runner, backend, cfg
        finally:
            runner.run(backend.aclose())
            for key in set(os.environ) - set(env_before):  # the VLLM_CPU_* the backend set, too
                del os.environ[key]
            os.environ.update(env_before)


def test_awq_streams_through_the_backend(awq_engine, tiny_model_dir):
    from app.engine.lm_backend import LMRequest

    runner, backend, cfg = awq_engine
    facts = backend.facts()
    assert facts["quantization"] == "compressed-tensors" and facts["dtype"] == "bfloat16"
    prompt = tuple(build_lm_ids(list(range(1000, 1012))))
    req = LMRequest("awq-ras", prompt, min_tokens=20, max_tokens=20, seed=3, sampling=cfg.sampling)

    async def collect() -> list[int]:
        return [t async for chunk in backend.stream(req) for t in chunk]

    got = runner.run(collect())
    assert 1 <= len(got) <= 20 and all(0 <= t < SPEECH_TOKEN_SIZE for t in got)
    assert backend.n_unfinished() == 0


def test_awq_token_agreement_and_memory(awq_engine, quantized, export_bf16, tiny_model_dir):
    from vllm import SamplingParams

    from app.tools.quantize import module_weight_bytes

    runner, backend, _ = awq_engine
    out, report, seconds = quantized
    lm = load_lm(tiny_model_dir)
    deq = dequantized_lm(tiny_model_dir, out)
    bf16 = load_lm(tiny_model_dir).to(torch.bfloat16)
    prefixes = text_prefixes(tiny_model_dir, PROMPTS)  # [1, T, D] fp32: sos, text, task_id
    refs = [greedy(lm, p, N_TOKENS) for p in prefixes]  # fp32 unquantized: the reference
    params = SamplingParams(temperature=0.0, max_tokens=1, min_tokens=1, stop_token_ids=sorted(STOP_TOKENS),
                            detokenize=False)

    from app.model.tokenizer import SpeechTextTokenizer

    tokenizer = SpeechTextTokenizer.from_dir(tiny_model_dir / "CosyVoice-BlankEN")
    prompt_ids = [build_lm_ids(tokenizer.encode(t)) for t in PROMPTS]  # the prefixes' rows, as ids

    async def next_token(ids: list[int], rid: str) -> int:
        last = None
        async for o in backend.engine.generate({"prompt_token_ids": ids}, params, request_id=rid):
            last = o
        return last.outputs[0].token_ids[0]

    async def teacher_forced() -> list[list[int]]:
        jobs = [next_token(p + r[:k], f"tf{i}-{k}")
                for i, (p, r) in enumerate(zip(prompt_ids, refs, strict=True)) for k in range(N_TOKENS)]
        flat = await asyncio.gather(*jobs)
        return [flat[i * N_TOKENS:(i + 1) * N_TOKENS] for i in range(len(prefixes))]

    t0 = time.perf_counter()
    awq = runner.run(teacher_forced())
    dt = time.perf_counter() - t0
    deq_tf = [teacher_forced_argmax(deq, p, r) for p, r in zip(prefixes, refs, strict=True)]
    bf16_tf = [teacher_forced_argmax(bf16, p.to(torch.bfloat16), r) for p, r in zip(prefixes, refs, strict=True)]
    kernel = agreement(awq, deq_tf)  # vLLM's W4A16 kernel vs the same 4-bit weights in torch fp32
    vs_fp32 = agreement(awq, refs)  # what 4 bits cost against the unquantized model
    floor = agreement(bf16_tf, refs)  # what bf16 alone costs (torch)
    fake_quant = agreement(deq_tf, refs)

    engine_bytes = runner.run(backend.engine.collective_rpc("apply_model", args=(module_weight_bytes,)))[0]
    before, after = report["lm_weight_bytes_before"], report["lm_weight_bytes_after"]
    print(f"\nAWQ tiny, teacher-forced greedy top-1 over {len(prefixes)}x{N_TOKENS} positions ({dt:.2f} s): "
          f"vLLM AWQ vs fp32 {vs_fp32:.3f}; torch bf16 vs fp32 {floor:.3f}; torch dequantized-AWQ vs fp32 "
          f"{fake_quant:.3f}; vLLM AWQ vs torch dequantized-AWQ {kernel:.3f}")
    print(f"LM weight bytes: export bf16 {before} -> AWQ file {after} -> in the vLLM engine {engine_bytes}; "
          f"quantize {seconds:.1f} s wall, report seconds {report['seconds']}")
    assert kernel >= 0.9  # the engine reads the checkpoint as we do (a misread would be ~0)
    assert vs_fp32 >= 0.5  # random tiny weights: flat distributions (docs/awq.md)
    assert engine_bytes["layers"] < before["layers"] / 3  # the engine keeps 4-bit weights
    # embed_tokens, lm_head, final norm; the engine's head keeps the speech rows only (app.vllm_lm.model)
    head = load_file(out / "model.safetensors")["lm_head.weight"]
    trimmed = (head.shape[0] - SPEECH_ID_ROWS) * head.shape[1] * head.element_size()
    assert engine_bytes["other"] == before["other"] - trimmed
    assert sys.modules.get("llmcompressor") is None  # the main venv never imports the quant stack
