"""bench/gpu/trace_summary.py on a small hand-made trace: per-step phases, kernels, syncs, host time by function."""

import json

from bench.gpu.trace_summary import summarize


def _x(cat, name, ts, dur, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_host_time_by_python_function_within_a_phase(tmp_path):
    events = [
        _x("user_annotation", "gpu_model_runner: forward", 0, 50),
        _x("user_annotation", "gpu_model_runner: forward", 1000, 50),
        _x("user_annotation", "gpu_model_runner: preprocess", 100, 400),
        _x("python_function", "runner.py(1): prepare", 110, 300),  # holds the two below
        _x("python_function", "runner.py(5): copy", 120, 100),
        _x("python_function", "runner.py(9): metadata", 250, 60),
        _x("python_function", "runner.py(9): metadata", 600, 60),  # outside any phase: not counted
        _x("python_function", "other.py(2): elsewhere", 150, 40, tid=2),  # another thread: not counted
        _x("kernel", "gemm", 10, 30),
        _x("cuda_runtime", "cudaEventSynchronize", 105, 4),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    r = summarize(path)
    assert r["steps"] == 2  # one per forward annotation
    pre = r["python_ms_per_step"]["gpu_model_runner: preprocess"]
    # self = own duration less direct children (300 - 100 - 60 us), per step of 2, in ms
    assert pre["self"] == {"runner.py(1): prepare": 0.07, "runner.py(5): copy": 0.05, "runner.py(9): metadata": 0.03}
    assert pre["inclusive"]["runner.py(1): prepare"] == 0.15
    assert "other.py(2): elsewhere" not in pre["self"]
    assert r["host_sync_ms_per_step"] == {"cudaEventSynchronize": 0.002}
    assert r["gpu_kernel_ms_per_step"] == 0.015
