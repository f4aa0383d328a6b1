"""CosyVoice2 Studio: `python app.py` serves the Gradio studio and its API on one FastAPI server.

    python app.py [--config configs/x.toml] [--model-dir DIR] [--host H] [--port P] [--set key=value ...]

Model: --model-dir, else COSYVOICE_MODEL_DIR, else `[model] dir`, else a download of `[model] repo_id`,
else (offline) a generated tiny random model with a banner. Host/port: flags, else GRADIO_SERVER_NAME /
GRADIO_SERVER_PORT, else `[server]`. Config file: --config, else COSYVOICE_CONFIG, else (no CUDA)
configs/cpu.toml.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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


def build_server(cfg: Config):
    """FastAPI app: the service starts in its lifespan (on the serving loop), Gradio mounted at "/"."""
    import gradio as gr
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from app.engine.service import ASSETS_DIR, StudioService
    from app.ui.handlers import ArrivalStamp
    from app.ui.layout import build_demo

    service = StudioService(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        task = asyncio.create_task(service.start())  # the page is served (with the status) meanwhile
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await service.aclose()

    api = FastAPI(lifespan=lifespan)
    api.add_middleware(ArrivalStamp)

    @api.get("/health")
    def health() -> JSONResponse:  # issue 5 extends this (and adds /metrics)
        body = service.health()
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    demo, i18n = build_demo(service)
    return gr.mount_gradio_app(api, demo, path="/", i18n=i18n, allowed_paths=[str(ASSETS_DIR)],
                               max_file_size=f"{cfg.server.max_upload_mb}mb", ssr_mode=False,
                               footer_links=["api", "gradio", "settings"])


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_from(parse_args(argv))
    # open pages keep an SSE connection: do not wait for them forever on Ctrl+C / SIGTERM
    uvicorn.run(build_server(cfg), host=cfg.server.host, port=cfg.server.port, log_level="info",
                timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
