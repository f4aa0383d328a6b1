"""Autoscaling of the Ray Serve scale-out on this machine: `[cluster] min_replicas = 1, max_replicas = 2,
target_ongoing_requests = 1` with a 1 s upscale delay; three long streams at once make Serve start the
second replica (its own cluster: tests/test_cluster.py's runs a fixed 2). Serve's autoscaling metrics are
pushed every second here (its RAY_SERVE_*_AUTOSCALING_METRIC_PUSH_INTERVAL_S, 10 s by default).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from studio import REPO, free_port, stop_server
from test_cluster import START_TIMEOUT_S, _health, _save, _sets, _wait_ready, need_ray_serve

UPSCALE_TIMEOUT_S = 600  # the average ongoing count rises, Serve decides, the new replica loads its model
LONG_TOKENS = 1500  # 60 s of audio per stream: still running when Serve decides to upscale


def _upscale_logged(tmp: Path) -> bool:
    """Serve's controller logged its decision to go from 1 to 2 replicas (Ray's temp dir is RAY_TMPDIR/ray)."""
    logs = (tmp / "ray" / "ray").glob("session_*/logs/serve/controller_*.log")
    return any("from 1 to 2 replicas" in p.read_text(errors="replace") for p in logs)


@pytest.mark.slow
def test_concurrent_streams_start_a_second_replica(tiny_model_dir: Path):
    need_ray_serve()
    tmp = Path(tempfile.mkdtemp(prefix="autoscale-"))  # short: Ray's unix sockets live under RAY_TMPDIR
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if k not in ("COSYVOICE_API_KEY", "COSYVOICE_AUTH")},
           "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "RAY_TMPDIR": str(tmp / "ray"),
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
           "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1"}
    scaling = {"cluster.min_replicas": "1", "cluster.max_replicas": "2", "cluster.target_ongoing_requests": "1",
               "cluster.upscale_delay_s": "1", "cluster.downscale_delay_s": "600"}
    cmd = [sys.executable, "-m", "app.cluster", "--config", "configs/cpu.toml", "--model-dir", str(tiny_model_dir),
           "--host", "127.0.0.1", "--port", str(port), *_sets(tmp),
           *[arg for k, v in scaling.items() for arg in ("--set", f"{k}={v}")]]
    log = tmp / "cluster.log"
    base = f"http://127.0.0.1:{port}"
    stop = threading.Event()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            t0 = time.monotonic()
            _wait_ready(base, 1, START_TIMEOUT_S, proc, log)
            print(f"\n1 replica ready in {time.monotonic() - t0:.0f} s")
            assert _save(base, "scale").status_code == 201

            def long_stream() -> None:  # read until the test has seen the second replica, then hang up
                body = {"model": "cosyvoice2", "voice": "scale", "input": "Keep talking for a while.",
                        "response_format": "pcm", "fixed_tokens": LONG_TOKENS}
                try:
                    with httpx.stream("POST", f"{base}/v1/audio/speech", json=body, timeout=600) as r:
                        for _ in r.iter_bytes():
                            if stop.is_set():
                                return
                except httpx.HTTPError:
                    pass  # a stream cut at teardown

            threads = [threading.Thread(target=long_stream, daemon=True) for _ in range(3)]
            for t in threads:
                t.start()
            t1 = time.monotonic()
            deadline = t1 + UPSCALE_TIMEOUT_S
            while not _upscale_logged(tmp) and _health(base).get("replicas_ready") != 2:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(1.0)
            # Serve decided (its target is now 2; downscale_delay_s keeps it there): the streams hang up, so the new
            # replica loads its model on cores free of three streams' compute, and the teardown is quicker
            stop.set()
            print(f"upscale decided {time.monotonic() - t1:.0f} s after 3 streams began")
            h = _wait_ready(base, 2, UPSCALE_TIMEOUT_S, proc, log)
            print(f"second replica ready {time.monotonic() - t1:.0f} s after 3 streams began")
            assert len({r["id"] for r in h["replicas"]}) == 2
        finally:
            stop.set()
            stop_server(proc)
            shutil.rmtree(tmp, ignore_errors=True)
