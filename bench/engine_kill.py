"""Fault drill: kill -9 the vLLM engine of a running local studio and time how it comes back.

    python -m bench.engine_kill --url http://127.0.0.1:7860 [--voice NAME] [--out drill.json]

Finds the server by its port (so only on this machine, loopback only), kills its EngineCore process
with SIGKILL and measures: how long until /health reports the death (`detect_s`), that a speech
request meanwhile fails at once with 503 `engine_dead` (`refused_in_s`), how long until /health is
ready again (`ready_s`, the in-process restart of app/engine/vllm_backend.py) and until a speech
request is served again (`recover_s`), all from the kill. It also checks that the dead engine's
processes are gone and exactly one new EngineCore runs. Exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.soak import is_loopback_url, server_process, voice_upload

DETECT_LIMIT_S = 10.0  # the death must show in /health within this
READY_LIMIT_S = 300.0  # engine start on a cold GPU compile cache can take minutes


def engine_processes(root: Any) -> tuple[list[Any], set[int]]:
    """(the EngineCore processes, the pids of every vLLM child: core and workers) under `root`."""
    children = root.children(recursive=True)
    return [p for p in children if "EngineCore" in p.name()], {p.pid for p in children if p.name().startswith("VLLM")}


def drill(url: str, speech: dict[str, Any], *, headers: dict[str, str] | None = None,
          while_dead: Callable[[], None] | None = None) -> dict[str, Any]:
    """Kill the engine of the server at `url`, run `while_dead()` once the death shows, wait for the
    restart; returns the timings and checks (raises AssertionError with the facts when a check fails)."""
    import psutil

    root = server_process(url)
    assert root is not None, f"no local process listens on {url}"
    engines, old = engine_processes(root)
    assert len(engines) == 1, [p.name() for p in root.children(recursive=True)]
    before = httpx.get(url + "/health", timeout=10).json()
    t_kill = time.monotonic()
    os.kill(engines[0].pid, signal.SIGKILL)
    while (r := httpx.get(url + "/health", timeout=10)).json()["ready"]:
        assert time.monotonic() - t_kill < DETECT_LIMIT_S, "the death was not noticed"
        time.sleep(0.05)
    detect_s, dead = time.monotonic() - t_kill, r.json()
    assert r.status_code == 503 and dead["status"].startswith("engine died: EngineCore"), dead
    t = time.monotonic()
    r = httpx.post(url + "/v1/audio/speech", json=speech, headers=headers, timeout=30)
    refused_in_s = time.monotonic() - t
    error = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
    assert r.status_code == 503 and error.get("code") == "engine_dead" and int(r.headers["retry-after"]) > 0, r.text
    if while_dead is not None:
        while_dead()
    while not (h := httpx.get(url + "/health", timeout=10).json())["ready"]:
        assert time.monotonic() - t_kill < READY_LIMIT_S, h
        time.sleep(0.2)
    ready_s = time.monotonic() - t_kill
    r = httpx.post(url + "/v1/audio/speech", json=speech, headers=headers, timeout=300)
    assert r.status_code == 200 and len(r.content) > 0, (r.status_code, r.text[:300])
    recover_s = time.monotonic() - t_kill
    engines, _ = engine_processes(root)

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    left = [pid for pid in old if alive(pid)]
    assert len(engines) == 1 and not left, (engines, left)  # the new engine, and nothing of the old one
    deaths = h["faults"]["engine_deaths"] - before["faults"]["engine_deaths"]
    restarts = h["faults"]["engine_restarts"] - before["faults"]["engine_restarts"]
    assert (deaths, restarts) == (1, 1), h["faults"]
    return {"url": url, "detect_s": round(detect_s, 3), "refused_in_s": round(refused_in_s, 3),
            "ready_s": round(ready_s, 2), "recover_s": round(recover_s, 2), "dead_status": dead["status"],
            "faults": h["faults"], "status": h["status"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="the studio's base URL (loopback), e.g. http://127.0.0.1:7860")
    p.add_argument("--voice", default="", help="a saved voice for the check requests (default: one made from "
                   "assets/ for the drill, deleted after)")
    p.add_argument("--api-key", default=os.environ.get("COSYVOICE_API_KEY", ""), help="bearer key for /v1")
    p.add_argument("--out", help="write the report to this JSON file")
    args = p.parse_args(argv)
    if not is_loopback_url(args.url):
        p.error(f"{args.url} is not a loopback address: the drill kills a local process")
    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    voice = args.voice
    if not voice:
        voice, parts = voice_upload("drill")
        r = httpx.post(url + "/v1/voices", headers=headers, timeout=120, **parts)
        if r.status_code != 201:
            raise SystemExit(f"cannot create the drill's voice: HTTP {r.status_code} {r.text[:300]}")
    speech = {"model": "cosyvoice2", "input": "Hello there, how are you?", "voice": voice,
              "response_format": "pcm", "seed": 1}
    try:
        report = drill(url, speech, headers=headers)
    except AssertionError as e:
        report = {"url": url, "failed": str(e)[:2000]}
    finally:
        if not args.voice:
            httpx.delete(f"{url}/v1/voices/{voice}", headers=headers, timeout=30)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 1 if "failed" in report else 0


if __name__ == "__main__":
    sys.exit(main())
