"""On a CUDA machine: HiFT graphs captured at warm-up only (engine.hift_graphs), as the served pipeline
captures them, then replayed. Prints one JSON line per case and writes a report.

1. Warm-up: the buckets of the official schedule (`schedule_frames`: 27 mel lengths) x rows 1, 2, 4, 8, 16,
   for two worker streams (fast.toml's two token->wave threads): capture seconds, GPU memory, failures.
2. Per case (a first chunk of 62 frames without source cache, mid chunks of 108 and 208 with it; 1, 3,
   4, 13, 16 rows): replay vs the eager batched call on the unpadded rows (max |diff| of the conv_post
   output and of the wave) and vs the eager call on the same padded rows (expected 0.0: the same
   kernels); ms per call (`vocode_rows`, iSTFT included) eager and replayed.
3. Serving: two threads replay on their own worker streams (random buckets, 40 calls each) while a third
   thread runs unrelated CUDA work on the default stream (allocations, host copies, matmuls); every
   output must equal the same call replayed alone, 0 errors; an uncaptured length (a 137-frame final)
   runs eagerly; captures unchanged after warm-up.

    python3 -m bench.gpu.hift_graphs - out/hift_graphs.json   # `full` HiFT (random), as make_model
Expect: captures = buckets x 2, 0 failures; replay == padded eager 0.0; replay vs unpadded eager at the
level of batched vs alone in run L (cuDNN picks per-shape algorithms, TF32 convs); 1 row ~3.6 vs ~11.6 ms,
16 rows ~20-40 ms; serving: 0 errors, outputs equal to alone.
"""

import json
import random
import sys
import threading
import time
from pathlib import Path

import torch

from app.config import StreamingConfig
from app.model.hift_batch import make_row, stack_rows, vocode_rows, vocode_step
from app.model.hift_graphs import HiftGraphs, row_buckets, schedule_frames
from app.model.token2wav import SOURCE_CACHE_SAMPLES
from bench.gpu.hift_batch import build_hift
from bench.gpu.timing import timed


def rows_for(hift, n, frames, seed):
    g = torch.Generator().manual_seed(seed)
    cached = frames > 100
    return [make_row(hift, (torch.randn(1, 80, frames, generator=g) - 5).cuda(),
                     (0.1 * torch.randn(1, 1, SOURCE_CACHE_SAMPLES, generator=g)).cuda() if cached else None,
                     torch.Generator(device="cuda").manual_seed(seed + i)) for i in range(n)]


def serving_check(hift, graphs, streams, frames) -> dict:
    """Two replaying threads on their streams + one thread of unrelated CUDA work; outputs vs alone."""
    rnd = random.Random(0)
    jobs = [[rows_for(hift, rnd.choice((1, 3, 4, 9, 16)), rnd.choice(frames), 1000 * w + k) for k in range(40)]
            for w in range(len(streams))]
    want = []
    for w, js in enumerate(jobs):  # one call at a time, each worker's on its stream (its graph set)
        with torch.cuda.stream(streams[w]), torch.inference_mode():
            want.append([[t.clone() for t in graphs(hift, rows)] for rows in js])
    torch.cuda.synchronize()
    errors, diffs, stop = [], [], threading.Event()

    def worker(w):
        try:
            with torch.cuda.stream(streams[w]), torch.inference_mode():
                for rows, (spec_w, source_w) in zip(jobs[w], want[w], strict=True):
                    spec, source = graphs(hift, rows)
                    d = max((spec - spec_w).abs().max().item(), (source - source_w).abs().max().item())
                    diffs.append((d, len(rows), rows[0].n_frames, w))
        except Exception as e:  # reported
            errors.append(repr(e))

    def noise():
        try:
            while not stop.is_set():
                a = torch.randn(2048, 2048, device="cuda")
                (a @ a).sum().item()
                torch.ones(1 << 20).cuda(non_blocking=False).cpu()
        except Exception as e:  # reported
            errors.append("other thread: " + repr(e))

    before = graphs.stats.captures
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(len(streams))]
    other = threading.Thread(target=noise)
    other.start()
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    other.join()
    eager_before = graphs.stats.eager
    with torch.cuda.stream(streams[0]), torch.inference_mode():
        graphs(hift, rows_for(hift, 2, 137, 7))  # a final's free length: eager
    return {"calls": sum(len(j) for j in jobs), "wall_s": round(time.perf_counter() - t0, 3), "errors": errors,
            "max_diff_vs_alone": max((d[0] for d in diffs), default=None),
            "largest_diffs_rows_frames_worker": sorted(diffs, reverse=True)[:5],
            "captures_after_warm_up": graphs.stats.captures - before,
            "uncaptured_length_ran_eager": graphs.stats.eager == eager_before + 1}


def main(model_dir: str, out: str) -> None:
    hift = build_hift(model_dir).remove_weight_norm().cuda().eval()
    frames = schedule_frames(StreamingConfig())
    rows = row_buckets(16)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    graphs = HiftGraphs()
    torch.cuda.synchronize()
    mem0, t0 = torch.cuda.memory_reserved(), time.perf_counter()
    graphs.capture(hift, rows, frames, streams)
    torch.cuda.synchronize()
    warm = {"buckets": len(rows) * len(frames), "streams": len(streams), "frames": frames,
            "capture_s": round(time.perf_counter() - t0, 2), "captures": graphs.stats.captures,
            "capture_failures": graphs.stats.capture_failures,
            "reserved_gb_added": round((torch.cuda.memory_reserved() - mem0) / 1e9, 2)}
    print(json.dumps(warm), flush=True)
    cases = []
    with torch.cuda.stream(streams[0]), torch.inference_mode():
        for f in (62, 108, 208):
            for n in (1, 3, 4, 13, 16):
                rs = rows_for(hift, n, f, 10 * f + n)
                spec, source = (t.clone() for t in graphs(hift, rs))
                eager_spec, _ = vocode_step(hift, *stack_rows(rs))
                mel, eps, cache, cache_len = stack_rows(rs, spec.shape[0])
                wide = torch.zeros(cache.shape[0], 1, min(SOURCE_CACHE_SAMPLES, 480 * f), device="cuda")
                wide[:, :, : cache.shape[2]] = cache
                padded_spec, padded_source = vocode_step(hift, mel, eps, wide, cache_len)
                graphed, eager = vocode_rows(hift, rs, graphs), vocode_rows(hift, rs)
                case = {"frames": f, "rows": n, "padded_rows": spec.shape[0],
                        "replay_vs_padded_eager": max((spec - padded_spec).abs().max().item(),
                                                      (source - padded_source).abs().max().item()),
                        "replay_vs_eager_spec": (spec[:n] - eager_spec).abs().max().item(),
                        "replay_vs_eager_wave": max((a[0] - b[0]).abs().max().item()
                                                    for a, b in zip(graphed, eager, strict=True)),
                        "wave_rms": float(torch.cat([b[0] for b in eager]).pow(2).mean().sqrt()),
                        "eager_ms": round(timed(lambda rs=rs: vocode_rows(hift, rs)), 2),
                        "graphed_ms": round(timed(lambda rs=rs: vocode_rows(hift, rs, graphs)), 2)}
                cases.append(case)
                print(json.dumps(case), flush=True)
    serving = serving_check(hift, graphs, streams, [62, 108, 208, 98, 50])
    print(json.dumps(serving), flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model_dir": model_dir,
              "warm_up": warm, "cases": cases, "serving": serving, "stats": vars(graphs.stats),
              "max_memory_allocated_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2)}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
