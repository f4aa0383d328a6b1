"""The service's sections: [limits], [server], [voices], [ui], [asr], [cluster] (app/config/__init__.py
reads them)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from app.config.base import ConfigError


@dataclass(frozen=True)
class LimitsConfig:
    """What one request may ask for; beyond it the input is refused with a message (app/service/prepare.py)."""

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
    voices_dir: str = "~/.cache/cosyvoice2-studio/voices"  # saved voices (.safetensors), survive restarts
    api_key: str = ""  # bearer token the /v1 API requires ("" = open); COSYVOICE_API_KEY overrides it
    auth: str = ""  # "user:password[,user2:password2]" for the page and /studio ("" = open); COSYVOICE_AUTH
    api_keys: str = ""  # "owner:key[,owner2:key2]": more /v1 keys, each its owner's (COSYVOICE_API_KEYS)
    admin_key: str = ""  # a /v1 key that sees and deletes every voice and reads /health details (COSYVOICE_ADMIN_KEY)
    admin_users: str = ""  # "hf:name,user:name": page users (Hugging Face, login) who see the engine's facts
    metrics_token: str = ""  # bearer token for /metrics besides the login and keys (COSYVOICE_METRICS_TOKEN)
    # fair share per client (signed-in user, API key, else address): "auto" = on for a public bind, off on localhost
    rate_limit_per_minute: int | str = "auto"  # synthesis requests per client and minute (0 = no limit)
    max_streams_per_client: int | str = "auto"  # syntheses one client runs at once (0 = no limit)
    trust_proxy: bool = False  # True: any peer is the one proxy in front; the client: its last X-Forwarded-For entry
    # "ip-or-network[,…]": X-Forwarded-For is taken only from these peers, the client its rightmost entry not one
    # of them (app/server/identity.py:ProxyClient); "auto" = none, except on a Hugging Face Space, whose proxy
    # reaches the app from a private address (app/cli.py)
    trusted_proxies: str = "auto"
    # bench-only request options (/v1's `fixed_tokens`): "auto" = on for a local bind, off on a public one
    # (there they cost GPU time out of proportion to the text); the admin key may always use them
    bench_options: bool | str = "auto"
    ws_idle_timeout_s: float = 30.0  # /v1/audio/speech/stream: a client silent this long is closed (4408)
    # "https://site[:port][,…]": other web pages whose scripts may call this server with a visitor's cookie
    # (CORS, the WebSocket door); the page's own origin always may, a Space's too (app/cli.py adds SPACE_HOST's)
    allowed_origins: str = ""

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
        if any(not u.startswith(("hf:", "user:")) for u in self.admin_owners):
            raise ConfigError('server.admin_users must be "hf:<name>" or "user:<name>" entries separated by commas')
        auth_pairs(self.api_keys, "server.api_keys", "owner:key")
        _ = self.proxy_networks  # raises ConfigError on a malformed trusted_proxies
        if self.ws_idle_timeout_s <= 0:
            raise ConfigError("server.ws_idle_timeout_s must be > 0")
        if self.bench_options not in ("auto", True, False):
            raise ConfigError('server.bench_options must be "auto", true or false')
        for origin in self.origin_list:
            scheme, sep, rest = origin.partition("://")
            if scheme not in ("http", "https") or not sep or not rest or "/" in rest:
                raise ConfigError(f"server.allowed_origins must be origins such as https://example.com[:8443] "
                                  f"separated by commas (no path, no *), got {origin[:80]!r}")

    @property
    def origin_list(self) -> tuple[str, ...]:  # allowed_origins as a list
        return tuple(filter(None, (o.strip().rstrip("/").lower() for o in self.allowed_origins.split(","))))

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
    def admin_owners(self) -> frozenset[str]:  # admin_users as owner ids (app/service/owners.py)
        return frozenset(filter(None, (u.strip() for u in self.admin_users.split(","))))

    @property
    def identities(self) -> bool:  # callers are told apart by a key or a login (on any bind)
        return bool(self.api_key or self.api_keys or self.admin_key or self.auth)

    @property
    def proxied(self) -> bool:  # a proxy in front names the clients (X-Forwarded-For is trusted)
        return self.trust_proxy or bool(self.proxy_networks)

    @property
    def shared_with_others(self) -> bool:  # clients other than this machine's own reach the app
        return self.public or self.proxied

    @property
    def requests_per_minute(self) -> int:  # rate_limit_per_minute, "auto" resolved (on when others reach it)
        v = self.rate_limit_per_minute
        return (PUBLIC_REQUESTS_PER_MINUTE if self.shared_with_others else 0) if v == "auto" else int(v)

    @property
    def streams_per_client(self) -> int:  # max_streams_per_client, "auto" resolved (on when others reach it)
        v = self.max_streams_per_client
        return (PUBLIC_STREAMS_PER_CLIENT if self.shared_with_others else 0) if v == "auto" else int(v)

    @property
    def bench_options_open(self) -> bool:  # bench_options, "auto" resolved (off for a public bind)
        return (not self.public) if self.bench_options == "auto" else bool(self.bench_options)


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
class VoicesConfig:  # who sees a saved voice (app/service/owners.py)
    scope: str = "auto"  # "private": each owner their own | "shared": one store for all | "auto" (see `resolved`)

    def __post_init__(self) -> None:
        if self.scope not in ("auto", "private", "shared"):
            raise ConfigError(f"voices.scope must be auto, private or shared, got {self.scope!r}")

    def resolved(self, server: ServerConfig) -> str:
        """"auto" is private wherever callers can be told apart (a public bind such as a Space, a proxy in front,
        API keys or a login) and shared only on a local bind with none of them."""
        private = server.public or server.proxied or server.identities
        return self.scope if self.scope != "auto" else ("private" if private else "shared")


@dataclass(frozen=True)
class UIConfig:
    title: str = "CosyVoice2 Studio"
    status_refresh_s: float = 1.0  # the loading-status line polls this often until the model is ready
    panel_refresh_s: float = 1.0  # the live panels' gr.Timer period (app/ui/panels.py)
    cache_cleanup_s: int = 3600  # Gradio's cache: this often, delete outputs older than this (the examples stay)

    def __post_init__(self) -> None:
        if self.status_refresh_s <= 0 or self.panel_refresh_s <= 0 or self.cache_cleanup_s < 1:
            raise ConfigError("ui.status_refresh_s and ui.panel_refresh_s must be > 0, ui.cache_cleanup_s >= 1")


@dataclass(frozen=True)
class AsrConfig:
    """Whisper transcription of a reference clip whose transcript is blank (app/service/asr.py)."""

    enabled: bool = True  # False: a blank transcript means cross-lingual mode, as without a model
    model_id: str = "openai/whisper-large-v3-turbo"  # a Hub repo (downloaded on first use, cached) or a folder
    device: str = "auto"  # "auto" = cuda when there is one, else cpu | "cpu" | "cuda" | "cuda:N"
    download: bool = True  # False: only a local folder or the Hugging Face cache, never the network
    language: str = ""  # "" = detected per clip; else a Whisper language code ("en", "zh", ...)
    # the page's word timings (every page take aligned): "auto" = where the aligner runs on a GPU (on a CPU the
    # turbo model takes ~21 s per sentence on 2 cores: docs/timings.md, "Cost") | "on" | "off"
    page_timings: str = "auto"

    def __post_init__(self) -> None:
        if self.page_timings not in ("auto", "on", "off"):
            raise ConfigError(f"asr.page_timings must be auto, on or off, got {self.page_timings!r}")
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
