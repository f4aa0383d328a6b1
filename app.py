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

from app.cli import add_config_args, config_from_cli


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return add_config_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), server=True).parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from app.server.main import build_server

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_from_cli(parse_args(argv))
    # open pages keep an SSE connection: do not wait for them forever on Ctrl+C / SIGTERM
    uvicorn.run(build_server(cfg), host=cfg.server.host, port=cfg.server.port, log_level="info",
                timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
