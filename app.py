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

from app.cli import add_config_args, config_from_cli


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return add_config_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), server=True).parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from app.server.main import build_server
    from app.server.studio_stream import quiet_access_log

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_access_log()
    cfg = config_from_cli(parse_args(argv))
    server_app = build_server(cfg)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:  # Ctrl+C / SIGTERM: open pages' streams end at once
            super().handle_exit(sig, frame)
            with contextlib.suppress(RuntimeError):  # the loop has already stopped
                asyncio.get_running_loop().call_soon_threadsafe(server_app.state.end_page_streams)

    # open pages keep SSE connections: ended at the signal; 5 s at most in case one does not end. The app
    # decides which proxies to trust (app/server/identity.py:ProxyClient), not uvicorn's loopback default
    Server(uvicorn.Config(server_app, host=cfg.server.host, port=cfg.server.port, log_level="info",
                          timeout_graceful_shutdown=5, proxy_headers=False)).run()


if __name__ == "__main__":
    main()
