"""Serving benchmark: a closed-loop concurrency sweep in-process or against a running `python app.py`.

    python -m bench sweep [--url http://host:port | --model-dir DIR] [--config F] [--set k=v ...]
        [--conc 1,4,16,64] [--requests N | --requests-per-stream K] [--fixed-tokens 250]
        [--voice saved|new|saved,new] [--voice-npz FILE] [--texts default|FILE] [--warmup 2]
        [--out report.json] [--png report.png]
    python -m bench plot report.json --png report.png      # re-plot a sweep or memory report
    python -m bench memory --model-dir DIR [--max-model-len 1024,2048] [--gpu-util 0.1,0.3] ...
    python -m bench formats [--seconds 20] [--chunk-s 1.0] [--out formats.json]   # mp3/opus/aac/flac encoders
    python -m bench textstream [--conc 1,16] [--words-per-s 20] ...   # text that streams in (bench/text_stream.py)
    python -m bench aligner [--device cpu|cuda] [--size full|tiny] [--out aligner.json]  # word timings' cost

At concurrency C, C workers issue requests back to back until N have been issued (the last ones
run with fewer neighbours); each level starts with `--warmup` rounds of C requests that are not
counted. In-process drives `StudioService.stream` (no HTTP, no admission slots); `--url` posts
`/v1/audio/speech` (pcm) with httpx. docs/bench.md defines every number. Module level imports only
numpy and app leaves: the offline H200 has no gradio, httpx, matplotlib or soundfile.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import report as rep
from bench.targets import InProcess, MemoryWatch, OverHttp, Reference, default_reference

# one segment each (< 80 Qwen tokens) and no digits (no wetext/inflect needed); request i speaks TEXTS[i % 4]
TEXTS = ("Hello there, how are you today?",
         "The weather is lovely this morning, so we are going for a long walk by the river.",
         "Please remember to bring your notebook, a pen and the printed agenda to the meeting on the third floor.",
         "She opened the old wooden box with great care and found a bundle of letters tied with a faded blue "
         "ribbon, each one written in her grandmother's small and very neat hand.")
VOICES = ("saved", "new")


def int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


# --- the sweep -----------------------------------------------------------------------------------------


async def closed_loop(target: Any, texts: list[str], voice: str, concurrency: int, n: int,
                      counter: itertools.count) -> tuple[list[rep.RequestResult], float]:
    """`concurrency` workers issue requests back to back until `n` were issued; (results, wall s)."""
    issued = itertools.count()
    results: list[rep.RequestResult] = []

    async def worker() -> None:
        while next(issued) < n:
            i = next(counter)  # unique over the whole sweep: seed and reference perturbation
            results.append(await target.request(i, texts[i % len(texts)], voice))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
    return sorted(results, key=lambda r: r.index), time.perf_counter() - t0


async def sweep(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    texts = list(TEXTS) if args.texts == "default" else [
        ln.strip() for ln in Path(args.texts).read_text(encoding="utf-8").splitlines() if ln.strip()]
    ref = Reference(*(default_reference() if args.reference is None else (Path(args.reference), args.transcript)))
    target = OverHttp(args, ref) if args.url else InProcess(args, ref)
    report = {**rep.run_header("sweep", argv), "mode": target.mode}
    counter = itertools.count()
    try:
        await target.start()
        report.update(target.facts())
        report["settings"] = {"concurrency": args.conc, "requests": args.requests,
                              "requests_per_stream": args.requests_per_stream, "fixed_tokens": args.fixed_tokens,
                              "voices": args.voice, "warmup_rounds": args.warmup, "texts": texts,
                              "reference": str(ref.path), "voice_npz": args.voice_npz, "sets": args.set}
        report["levels"] = []
        watch = MemoryWatch(target.sample, args.sample_interval)
        for voice in args.voice:
            for c in args.conc:
                n = args.requests or c * (args.requests_per_stream or 4)
                if args.requests is None and args.requests_per_stream is None:
                    n = max(8, n)
                if args.warmup:
                    await closed_loop(target, texts, voice, c, c * args.warmup, counter)
                before = flow_work(target)
                async with watch.watch():
                    results, wall_s = await closed_loop(target, texts, voice, c, n, counter)
                row = rep.summarize_level(voice, c, results, wall_s, dict(watch.peaks),
                                          rep.flow_work_delta(before, flow_work(target), wall_s))
                report["levels"].append(row)
                print("BENCH", json.dumps({k: row[k] for k in rep.LEVEL_FIELDS}), flush=True)
                if args.out:  # after every level: a run cut short by a time limit still leaves its levels
                    write_outputs({**report, "partial": True}, args.out, None, rep.plot_sweep)
        report["capacity"] = rep.capacity(report["levels"])
        print("CAPACITY", json.dumps(report["capacity"]), flush=True)
    finally:
        await target.aclose()
    return report


def flow_work(target) -> dict[str, float] | None:
    """The engine's flow work totals now (in-process only: /health's facts over HTTP are the start's)."""
    if target.mode != "in-process":
        return None
    return ((target.facts().get("facts") or {}).get("token2wav") or {}).get("flow_work")


def write_outputs(report: dict[str, Any], out: str | None, png: str | None, plot: Callable) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1))
    if png:
        try:
            plot(report, png)
        except ImportError:
            print(f"matplotlib is missing: no {png}; later run `python -m bench plot {out or 'REPORT'} "
                  f"--png {png}` where it is installed", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sweep", help="closed-loop concurrency sweep (in-process or --url)")
    where = s.add_mutually_exclusive_group()
    where.add_argument("--url", help="a running `python app.py` (else the service runs in this process)")
    where.add_argument("--model-dir", help="in-process: the model folder (else as app.py resolves it)")
    s.add_argument("--config", help="in-process: override file (default as app.py: cpu.toml without CUDA)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="in-process: config override")
    s.add_argument("--conc", type=int_list, default=[1, 4, 16, 64], help="concurrency levels, e.g. 1,4,16,64")
    n = s.add_mutually_exclusive_group()
    n.add_argument("--requests", type=int, help="requests per level (default: max(8, 4 x concurrency))")
    n.add_argument("--requests-per-stream", type=int, help="requests per level = this x concurrency")
    s.add_argument("--fixed-tokens", type=int, default=0, help="exactly N speech tokens per segment (random models)")
    s.add_argument("--voice", type=lambda v: v.split(","), default=["saved"], help="saved, new or saved,new")
    s.add_argument("--voice-npz", help="in-process saved voice: a VoiceStore .safetensors (or an .npz of to_arrays())")
    s.add_argument("--voice-id", help="--url saved voice: an existing voice id (else one is created and deleted)")
    s.add_argument("--reference", help="16-bit WAV reference (default assets/prompt_en.wav)")
    s.add_argument("--transcript", default="", help="the reference's transcript (with --reference)")
    s.add_argument("--texts", default="default", help="'default' or a file with one text per line")
    s.add_argument("--warmup", type=int, default=2, help="uncounted rounds of C requests before each level")
    s.add_argument("--sample-interval", type=float, default=0.5, help="memory sampling period (s)")
    s.add_argument("--api-key", help="--url: bearer key (default $COSYVOICE_API_KEY)")
    s.add_argument("--server-pid", type=int, help="--url: the server's pid, for its RSS (same machine)")
    s.add_argument("--out", help="JSON report")
    s.add_argument("--png", help="PNG plot (needs matplotlib)")
    pl = sub.add_parser("plot", help="draw the PNG of a sweep or memory JSON report")
    pl.add_argument("report")
    pl.add_argument("--png", required=True)
    from bench import aligner as bench_aligner
    from bench import formats as bench_formats
    from bench import memory as bench_memory
    from bench import text_stream

    bench_memory.add_parser(sub)
    bench_formats.add_parser(sub)
    text_stream.add_parser(sub)
    bench_aligner.add_parser(sub)
    args = p.parse_args(argv)
    if args.cmd == "aligner":
        report = bench_aligner.run(args, argv)
        print(rep.format_table(report["rows"], bench_aligner.COLUMNS))
        print(report["facts"])
        write_outputs(report, args.out, None, None)
        return 0
    if args.cmd == "formats":
        report = bench_formats.run(args, argv)
        print(rep.format_table(report["rows"], bench_formats.COLUMNS))
        write_outputs(report, args.out, None, None)
        return 0
    if args.cmd == "textstream":
        report = asyncio.run(text_stream.run(args, argv))
        print(rep.format_table(report["levels"], text_stream.COLUMNS))
        write_outputs(report, args.out, None, None)
        return 0
    if args.cmd == "plot":
        report = json.loads(Path(args.report).read_text())
        (rep.plot_memory if "rows" in report else rep.plot_sweep)(report, args.png)
        return 0
    if args.cmd == "memory":
        report = asyncio.run(bench_memory.run(args, argv))
        print(rep.format_table(report["rows"], bench_memory.COLUMNS))
        write_outputs(report, args.out, args.png, rep.plot_memory)
        return 0
    if bad := set(args.voice) - set(VOICES):
        p.error(f"--voice takes saved and/or new, not {sorted(bad)}")
    report = asyncio.run(sweep(args, argv))
    print(rep.format_table(report["levels"]))
    write_outputs(report, args.out, args.png, rep.plot_sweep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
