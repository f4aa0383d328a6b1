"""`python -m app.cluster`: the studio page and the API on Ray Serve replicas, one engine per GPU.

Design notes: docs/cluster.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
from pathlib import Path

from app.cli import add_config_args, config_from_cli

REPO = Path(__file__).resolve().parents[2]
LOCAL_OBJECT_STORE_BYTES = 512 * 1024 * 1024  # a local Ray's shared memory: requests and uploads (<= 21 MB) pass it


_EPILOG = """examples:
  python -m app.cluster --replicas 2                      # this host: a local Ray, 2 replicas (2 GPUs)
  python -m app.cluster --address auto --set cluster.max_replicas=8   # the Ray cluster of this host

Config as for app.py; [cluster] sizes the replicas, [server] host/port is Serve's HTTP address.
Runs until SIGINT/SIGTERM. Design notes: docs/cluster.md; deploying: docs/deploy.md."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m app.cluster", description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EPILOG)
    add_config_args(p, server=True)
    p.add_argument("--replicas", type=int, help="a fixed replica count (sets cluster.min_replicas and max_replicas)")
    p.add_argument("--address", help="Ray cluster to join (cluster.address): 'auto' or host:port")
    args = p.parse_args(argv)
    if args.replicas is not None:
        args.set = [*args.set, f"cluster.min_replicas={args.replicas}", f"cluster.max_replicas={args.replicas}"]
    if args.address:
        args.set = [*args.set, f"cluster.address={json.dumps(args.address)}"]
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_from_cli(parse_args(argv))
    import ray
    from ray import serve

    from app.cluster.deploy import APP_NAME, build_app
    from app.cluster.proxy import CALLBACK, CALLBACK_ENV

    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # taken by sigwait below, not by a handler
    local = not cfg.cluster.address
    # workers import `app` from this checkout (on a cluster: the same path on every node), and what the launcher's
    # own PYTHONPATH holds (e.g. a --target install of Ray, as on the H200)
    path = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
    # Serve's HTTP proxy (started by Ray, inheriting this environment) imports our response fix-up
    # (app/cluster/proxy.py) from this checkout
    os.environ.setdefault(CALLBACK_ENV, CALLBACK)
    os.environ["PYTHONPATH"] = path
    ray.init(address=cfg.cluster.address or None, include_dashboard=False,
             object_store_memory=LOCAL_OBJECT_STORE_BYTES if local else None,
             runtime_env={"env_vars": {"PYTHONPATH": path, CALLBACK_ENV: os.environ[CALLBACK_ENV]}})
    try:
        serve.start(http_options={"host": cfg.server.host, "port": cfg.server.port})
        serve.run(build_app(cfg), name=APP_NAME, route_prefix="/")
        logging.info("serving on http://%s:%d (the page at /, /v1, /health, /metrics)", cfg.server.host,
                     cfg.server.port)
        signal.sigwait(stop)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
