"""One frozen config tree, read from `configs/*.toml` (stdlib tomllib).

`load_config(path, overrides)` reads `configs/default.toml`, then the given file on top (a small
override file such as `configs/cpu.toml`), then dotted overrides from the command line or the
environment (`{"model.device": "cpu"}`). Every section is a frozen dataclass validated in
`__post_init__`; unknown keys are an error so typos never pass silently.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
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

    def __post_init__(self) -> None:
        for k in ("llm_dtype", "flow_dtype", "hift_dtype"):
            if getattr(self, k) not in _DTYPES:
                raise ConfigError(f"model.{k} must be one of {_DTYPES}, got {getattr(self, k)!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"model.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")


@dataclass(frozen=True)
class SamplingConfig:
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    min_len_ratio: float = 2.0  # min speech tokens per tts-text token
    max_len_ratio: float = 20.0  # max speech tokens per tts-text token

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 1 or self.win_size < 1:
            raise ConfigError("sampling.top_k and sampling.win_size must be >= 1")
        if not 0.0 <= self.min_len_ratio <= self.max_len_ratio:
            raise ConfigError("sampling: need 0 <= min_len_ratio <= max_len_ratio")


@dataclass(frozen=True)
class StreamingConfig:
    """Token-to-wave chunking. Defaults reproduce the official CosyVoice2Model.tts schedule."""

    first_hop_tokens: int = 25  # first chunk's new tokens (plus the prompt pad to a chunk edge)
    hop_growth: int = 2  # each later hop = min(max_hop_tokens, hop * hop_growth)
    max_hop_tokens: int = 100
    crossfade: Literal["hamming", "complementary"] = "hamming"  # official window sums to ~1.08
    nsf_noise: bool = True  # HiFT additive NSF noise (False = deterministic, as the parity goldens)

    def __post_init__(self) -> None:
        if self.first_hop_tokens < 1 or self.max_hop_tokens < self.first_hop_tokens:
            raise ConfigError("streaming: need 1 <= first_hop_tokens <= max_hop_tokens")
        if self.hop_growth < 1:
            raise ConfigError("streaming.hop_growth must be >= 1")
        if self.crossfade not in ("hamming", "complementary"):
            raise ConfigError("streaming.crossfade must be 'hamming' or 'complementary'")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    streaming: StreamingConfig = field(default_factory=StreamingConfig)


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
