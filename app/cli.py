"""One way from command-line flags and environment to the frozen config, for app.py and every CLI.

Design notes: docs/design.md.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from pathlib import Path
from typing import Any

from app.config import CONFIG_DIR, Config, load_config


def add_config_args(p: argparse.ArgumentParser, *, server: bool = False) -> argparse.ArgumentParser:
    p.add_argument("--config", help="override file on top of configs/default.toml, e.g. configs/cpu.toml")
    p.add_argument("--model-dir", help="CosyVoice2-0.5B folder in the official layout")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, value in TOML syntax, e.g. --set server.concurrency_limit=8")
    if server:
        p.add_argument("--host", help="bind address (0.0.0.0 to serve other machines)")
        p.add_argument("--port", type=int)
    else:
        p.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N")
    return p


def parse_sets(items: list[str]) -> dict[str, Any]:
    """`--set key=value` pairs: TOML values, a bare word is a string."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, _, raw = item.partition("=")
        try:
            overrides[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            overrides[key.strip()] = raw
    return overrides


def config_path(given: str | Path | None) -> str | Path | None:
    """The override file: `given`, else COSYVOICE_CONFIG, else configs/cpu.toml without CUDA (None: defaults)."""
    path = given or os.environ.get("COSYVOICE_CONFIG")
    if path is None:
        from app.model.loader import cuda_available

        path = None if cuda_available() else CONFIG_DIR / "cpu.toml"
    return path


SPACE_PROXIES = "10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,100.64.0.0/10,fc00::/7"  # private networks


def config_from_cli(args: argparse.Namespace) -> Config:
    overrides: dict[str, Any] = {}
    if api_key := os.environ.get("COSYVOICE_API_KEY"):
        overrides["server.api_key"] = api_key
    if auth := os.environ.get("COSYVOICE_AUTH"):  # "user:password[,user2:password2]" for the page and /studio
        overrides["server.auth"] = auth
    for env, key in (("COSYVOICE_API_KEYS", "api_keys"), ("COSYVOICE_ADMIN_KEY", "admin_key"),
                     ("COSYVOICE_METRICS_TOKEN", "metrics_token")):
        if value := os.environ.get(env):
            overrides[f"server.{key}"] = value
    if model_dir := getattr(args, "model_dir", None) or os.environ.get("COSYVOICE_MODEL_DIR"):
        overrides["model.dir"] = model_dir
    spaces_host = "0.0.0.0" if os.environ.get("SYSTEM") == "spaces" else None
    if host := getattr(args, "host", None) or os.environ.get("GRADIO_SERVER_NAME") or spaces_host:
        overrides["server.host"] = host
    if port := getattr(args, "port", None) or os.environ.get("GRADIO_SERVER_PORT"):
        overrides["server.port"] = int(port)
    if device := getattr(args, "device", None):
        overrides["model.device"] = device
    overrides.update(parse_sets(getattr(args, "set", None) or []))  # explicit --set wins
    path = config_path(getattr(args, "config", None))
    cfg = load_config(path, overrides)
    found: dict[str, Any] = {}  # what a Space's environment settles, where the config leaves it open
    if os.environ.get("SYSTEM") == "spaces" and cfg.server.trusted_proxies.strip() == "auto":
        # a Space's proxy connects from an internal address and writes the visitor's in X-Forwarded-For;
        # without trusting it every visitor would be one client with one fair share
        found["server.trusted_proxies"] = SPACE_PROXIES
    if (space_host := os.environ.get("SPACE_HOST")) and f"https://{space_host.lower()}" not in cfg.server.origin_list:
        # a Space's page is served from https://<SPACE_HOST> (the frame huggingface.co shows): its own origin,
        # whatever Host its proxy hands on
        found["server.allowed_origins"] = ",".join([*cfg.server.origin_list, f"https://{space_host}"])
    return load_config(path, overrides | found) if found else cfg
