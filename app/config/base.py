"""What every config module shares: the error type and where the TOML files live."""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "default.toml"


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key."""
