"""One frozen config tree, read from `configs/*.toml` (stdlib tomllib).

Design notes: docs/design.md.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.config.base import CONFIG_DIR, DEFAULT_CONFIG, ConfigError
from app.config.model import EngineConfig, ModelConfig, SamplingConfig, StreamingConfig, VLLMConfig
from app.config.serving import (
    LOCAL_HOSTS,
    AsrConfig,
    ClusterConfig,
    LimitsConfig,
    ServerConfig,
    UIConfig,
    VoicesConfig,
    auth_pairs,
)

__all__ = ["CONFIG_DIR", "DEFAULT_CONFIG", "LOCAL_HOSTS", "AsrConfig", "ClusterConfig", "Config", "ConfigError",
           "EngineConfig", "LimitsConfig", "ModelConfig", "SamplingConfig", "ServerConfig", "StreamingConfig",
           "UIConfig", "VLLMConfig", "VoicesConfig", "auth_pairs", "load_config"]


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

    @property
    def mode(self) -> str:
        """The precision and schedule in words (/health's facts, the Engine panel): the official vLLM example's
        fp16 flow, or the exact fp32 one; the official 25-token first hop, or a shorter one."""
        m, s = self.model, self.streaming
        flow = {"float16": "official fp16 mode", "float32": "exact mode (fp32 flow)"}.get(
            m.flow_dtype, f"{m.flow_dtype} flow")
        hop = "official schedule" if (s.first_hop_tokens, s.align_first_hop) == (25, True) else \
            f"{s.first_hop_tokens}-token first hop"
        return f"{flow}, {hop}"


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
