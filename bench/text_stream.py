"""Text that streams in, timed: the WebSocket door's take (bi-streaming) beside a plain request of the same text.

    python -m bench textstream [--model-dir DIR] [--config F] [--set k=v ...] [--conc 1,16]
        [--requests-per-stream 2] [--words-per-s 20] [--fixed-tokens 250] [--tail-tokens 100] [--out r.json]

In-process, as `/v1/audio/speech/stream` runs a take: the text's words arrive as deltas at `--words-per-s`
(0: the whole text in one delta) through `TextFeed` and `bistream.take_tokens` into `StudioService.stream`.
Per take: first delta -> first audio, last delta -> last audio; the plain request's first audio beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import time
from typing import Any

import numpy as np

from app.audio import OUTPUT_SAMPLE_RATE_HZ
from bench import report as rep
from bench.targets import InProcess, Reference, default_reference

# a voice agent's answer: short sentences, so the first is spoken while the rest is still being written
TEXT = ("Sure, here is the plan for tomorrow. We meet at nine in the hotel lobby. Then we take the train to the "
        "coast and walk along the cliffs. Lunch is at a small place by the harbour. We should be back before six.")
COLUMNS = ("kind", "concurrency", "n_ok", "first_audio_ms_p50", "first_audio_ms_p95", "end_after_last_ms_p50",
           "end_after_last_ms_p95", "text_arrival_s", "audio_s", "n_tokens")


def add_parser(sub: Any) -> None:
    t = sub.add_parser("textstream", help="the text-streaming take's latencies beside a plain request's")
    t.add_argument("--model-dir", help="the model folder (else as app.py resolves it)")
    t.add_argument("--config", help="override file (default as app.py: cpu.toml without CUDA)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (TOML value)")
    t.add_argument("--conc", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    t.add_argument("--requests-per-stream", type=int, default=2, help="takes per level = this x concurrency")
    t.add_argument("--warmup", type=int, default=1, help="uncounted rounds of C takes before each level")
    t.add_argument("--words-per-s", type=float, default=20.0, help="the deltas' pace, one word each (0: at once)")
    t.add_argument("--fixed-tokens", type=int, default=250, help="random models: the plain request's speech tokens")
    t.add_argument("--tail-tokens", type=int, default=100,
                   help="random models: the streamed take's last block (its text's blocks come before: 3 a token)")
    t.add_argument("--out", help="JSON report")


def deltas(text: str) -> list[str]:
    """The text as one-word deltas, each with the space after it (a sentence is complete at its last word)."""
    words = text.split(" ")
    return [w + " " for w in words[:-1]] + [words[-1]]


async def streamed_take(service: Any, voice: Any, i: int, words_per_s: float, tail: int) -> dict[str, Any]:
    """One take through the WebSocket door's path; times in ms from the first delta."""
    from app.engine import bistream
    from app.engine.requests import SynthesisRequest

    synth = service.require_ready()
    req = SynthesisRequest(text=TEXT, voice=voice, seed=i, fixed_tokens=tail)
    feed, queue = bistream.TextFeed(synth.model.frontend), asyncio.Queue()
    marks: dict[str, float] = {}

    async def writer() -> None:  # the client's LLM: one word every 1 / words_per_s s
        parts = deltas(TEXT) if words_per_s > 0 else [TEXT]
        for k, delta in enumerate(parts):
            if k and words_per_s > 0:
                await asyncio.sleep(1.0 / words_per_s)
            for ids in feed.add(delta):
                queue.put_nowait(ids)
        for ids in feed.flush():  # the client's close
            queue.put_nowait(ids)
        marks["last_delta"] = time.perf_counter()
        queue.put_nowait(None)

    async def arriving():
        while (ids := await queue.get()) is not None:
            yield ids

    t0 = time.perf_counter()
    write = asyncio.create_task(writer())
    first, stats, n = None, None, 0
    try:
        tokens = bistream.take_tokens(synth, req, arriving(), service.cfg.limits.max_text_chars)
        async with contextlib.aclosing(service.stream(req, tokens=tokens)) as chunks:
            async for chunk in chunks:
                if chunk.samples.size and first is None:
                    first = time.perf_counter()
                n += chunk.samples.size
                stats = chunk.stats or stats
        end = time.perf_counter()
    finally:
        write.cancel()
    last = marks["last_delta"]
    return {"first_audio_ms": (first - t0) * 1e3, "end_after_last_ms": (end - last) * 1e3,
            "text_arrival_s": last - t0, "audio_s": n / OUTPUT_SAMPLE_RATE_HZ, "n_tokens": stats.n_tokens}


async def plain_take(target: InProcess, i: int) -> dict[str, Any]:
    r = await target.request(i, TEXT, "saved")
    if not r.ok:
        raise RuntimeError(r.error)
    return {"first_audio_ms": r.ttfa_ms, "end_after_last_ms": r.wall_s * 1e3, "text_arrival_s": 0.0,
            "audio_s": r.audio_s, "n_tokens": r.n_tokens}


def summarize(kind: str, c: int, takes: list[dict[str, Any]]) -> dict[str, Any]:
    def pct(key: str, q: float) -> float:
        return round(float(np.percentile([t[key] for t in takes], q)), 1)

    row: dict[str, Any] = {"kind": kind, "concurrency": c, "n_ok": len(takes)}
    for key in ("first_audio_ms", "end_after_last_ms"):
        row |= {f"{key}_p50": pct(key, 50), f"{key}_p95": pct(key, 95)}
    return row | {key: pct(key, 50) for key in ("text_arrival_s", "audio_s", "n_tokens")}


async def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    ns = argparse.Namespace(**vars(args), voice=["saved"], voice_npz=None)
    target = InProcess(ns, Reference(*default_reference()))
    report = {**rep.run_header("textstream", argv), "mode": "in-process", "text": TEXT,
              "settings": {k: getattr(args, k) for k in ("conc", "requests_per_stream", "warmup", "words_per_s",
                                                         "fixed_tokens", "tail_tokens", "set")}, "levels": []}
    counter = itertools.count()
    try:
        await target.start()
        report.update(target.facts())
        kinds = {"streamed": lambda i: streamed_take(target.service, target.voice, i, args.words_per_s,
                                                     args.tail_tokens),
                 "plain": lambda i: plain_take(target, i)}
        for c in args.conc:
            for kind, take in kinds.items():
                for rounds, keep in ((args.warmup, False), (args.requests_per_stream, True)):
                    ids = [next(counter) for _ in range(c * rounds)]
                    takes = await closed_loop(take, ids, c)
                    if keep:
                        row = summarize(kind, c, takes)
                        report["levels"].append(row)
                        print("BENCH", json.dumps(row), flush=True)
    finally:
        await target.aclose()
    return report


async def closed_loop(take: Any, ids: list[int], c: int) -> list[dict[str, Any]]:
    """`c` workers run the takes of `ids` back to back."""
    todo, done = iter(ids), []

    async def worker() -> None:
        for i in todo:
            done.append(await take(i))

    await asyncio.gather(*(worker() for _ in range(c)))
    return done
