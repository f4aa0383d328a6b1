"""CosyVoice2 Studio: `python app.py` serves the Gradio studio and its API on one FastAPI server.

    python app.py [--config configs/x.toml] [--model-dir DIR] [--host H] [--port P] [--set key=value ...]

Model: --model-dir, else COSYVOICE_MODEL_DIR, else `[model] dir`, else a download of `[model] repo_id`,
else (offline) a generated tiny random model with a banner. Host/port: flags, else GRADIO_SERVER_NAME /
GRADIO_SERVER_PORT, else `[server]`. Config file: --config, else COSYVOICE_CONFIG, else (no CUDA)
configs/cpu.toml.
"""

from __future__ import annotations

import argparse
import logging
import os
import tomllib

from app.config import CONFIG_DIR, Config, load_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", help="override file on top of configs/default.toml, e.g. configs/cpu.toml")
    p.add_argument("--model-dir", help="CosyVoice2-0.5B folder in the official layout")
    p.add_argument("--host", help="bind address (0.0.0.0 to serve other machines)")
    p.add_argument("--port", type=int)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, value in TOML syntax, e.g. --set server.concurrency_limit=8")
    return p.parse_args(argv)


def config_from(args: argparse.Namespace) -> Config:
    overrides: dict = {}
    for item in args.set:
        key, _, raw = item.partition("=")
        try:
            overrides[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            overrides[key.strip()] = raw  # a bare string
    if api_key := os.environ.get("COSYVOICE_API_KEY"):
        overrides["server.api_key"] = api_key
    if auth := os.environ.get("COSYVOICE_AUTH"):  # "user:password[,user2:password2]" for the page and /studio
        overrides["server.auth"] = auth
    if model_dir := args.model_dir or os.environ.get("COSYVOICE_MODEL_DIR"):
        overrides["model.dir"] = model_dir
    spaces_host = "0.0.0.0" if os.environ.get("SYSTEM") == "spaces" else None
    if host := args.host or os.environ.get("GRADIO_SERVER_NAME") or spaces_host:
        overrides["server.host"] = host
    if port := args.port or os.environ.get("GRADIO_SERVER_PORT"):
        overrides["server.port"] = int(port)
    path = args.config or os.environ.get("COSYVOICE_CONFIG")
    if path is None:
        import torch

        path = None if torch.cuda.is_available() else CONFIG_DIR / "cpu.toml"
    return load_config(path, overrides)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from app.server.main import build_server

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_from(parse_args(argv))
    # open pages keep an SSE connection: do not wait for them forever on Ctrl+C / SIGTERM
    uvicorn.run(build_server(cfg), host=cfg.server.host, port=cfg.server.port, log_level="info",
                timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
