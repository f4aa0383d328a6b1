"""A flood run: one client sends 10x its fair share while another streams; what does the other one see?

    python -m bench.flood --url http://127.0.0.1:7860 --share 1 --seconds 60 [--factor 10] [--out flood.json]

The server must tell the two clients apart by address through a trusted proxy: start it with
`--set server.trusted_proxies='"127.0.0.1"'` (and the share to test, e.g. `server.max_streams_per_client=1`);
the clients differ by X-Forwarded-For (198.51.100.1 floods, 198.51.100.2 is the quiet one). Each saves
the example voice (assets/) under its own visitor cookie first. Two phases of `--seconds` each:

    alone   the quiet client streams requests back to back (baseline)
    flood   the same, while the flooder keeps `--factor` x `--share` requests in flight

Reported per phase: the quiet client's requests, errors (non-200, empty), first-audio seconds (request
-> first PCM byte) p50 / p95 / max; in the flood phase also the flooder's requests by status (200 =
admitted within its share, 429 = refused). Loopback only (it is load).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import numpy as np

from bench.examples import example_voices

QUIET, FLOODER = "198.51.100.2", "198.51.100.1"
TEXT = "Hello there, how are you today? The weather is lovely."


async def _client(httpx, url: str, ip: str):
    example = example_voices()[0]
    c = httpx.AsyncClient(base_url=url, timeout=300, headers={"X-Forwarded-For": ip})
    r = await c.post("/v1/voices", files={"audio": ("ref.wav", example["audio"].read_bytes())},
                     data={"transcript": example["transcript"], "name": "flood", "overwrite": "true"})
    r.raise_for_status()
    return c


async def _speak(c, fixed_tokens: int) -> tuple[int, float | None, int]:
    """(status, seconds to the first PCM byte or None, bytes)."""
    body = {"model": "cosyvoice2", "input": TEXT, "voice": "flood", "response_format": "pcm",
            "fixed_tokens": fixed_tokens}
    t0, first, n = time.perf_counter(), None, 0
    async with c.stream("POST", "/v1/audio/speech", json=body) as r:
        async for piece in r.aiter_bytes():
            if piece and first is None:
                first = time.perf_counter() - t0
            n += len(piece)
    return r.status_code, first, n


async def _quiet(c, seconds: float, fixed_tokens: int) -> dict:
    end, ttfa, errors, n = time.monotonic() + seconds, [], 0, 0
    while time.monotonic() < end:
        status, first, size = await _speak(c, fixed_tokens)
        n += 1
        if status != 200 or not size or first is None:
            errors += 1
        else:
            ttfa.append(first)
    q = (lambda p: round(float(np.percentile(ttfa, p)), 3)) if ttfa else (lambda p: None)
    return {"requests": n, "errors": errors, "first_audio_s": {"p50": q(50), "p95": q(95),
                                                               "max": round(max(ttfa), 3) if ttfa else None}}


async def _flood(c, in_flight: int, stop: asyncio.Event, fixed_tokens: int) -> dict:
    statuses: dict[str, int] = {}

    async def loop() -> None:
        while not stop.is_set():
            status, _, _ = await _speak(c, fixed_tokens)
            statuses[str(status)] = statuses.get(str(status), 0) + 1
            if status == 429:
                await asyncio.sleep(0.05)  # a refused flooder retries at once (no back-off: it is a flood)

    await asyncio.gather(*(loop() for _ in range(in_flight)))
    return statuses


async def run(url: str, share: int, factor: int, seconds: float, fixed_tokens: int) -> dict:
    import httpx

    quiet, flooder = await _client(httpx, url, QUIET), await _client(httpx, url, FLOODER)
    try:
        alone = await _quiet(quiet, seconds, fixed_tokens)
        stop = asyncio.Event()
        flood_task = asyncio.create_task(_flood(flooder, factor * share, stop, fixed_tokens))
        await asyncio.sleep(1.0)  # the flood is on before the quiet client starts
        during = await _quiet(quiet, seconds, fixed_tokens)
        stop.set()
        flooder_statuses = await flood_task
        metrics = (await quiet.get("/metrics")).text
        refused = [ln for ln in metrics.splitlines() if ln.startswith("cosyvoice_refused_share_total")]
        return {"url": url, "share": share, "factor": factor, "seconds": seconds, "fixed_tokens": fixed_tokens,
                "alone": alone, "flood": {**during, "flooder_statuses": flooder_statuses},
                "refused_share_metrics": refused}
    finally:
        for c in (quiet, flooder):
            await c.delete("/v1/voices/flood")
            await c.aclose()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:7860")
    ap.add_argument("--share", type=int, default=1, help="the server's [server] max_streams_per_client")
    ap.add_argument("--factor", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--fixed-tokens", type=int, default=100, help="speech tokens per request (4 s of audio)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    host = args.url.split("//", 1)[-1].split(":", 1)[0].split("/", 1)[0]
    if host not in ("127.0.0.1", "localhost", "::1", "[::1]"):
        raise SystemExit("bench.flood talks to loopback servers only (it is load)")
    report = asyncio.run(run(args.url, args.share, args.factor, args.seconds, args.fixed_tokens))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
