"""Process and device resources (NVML GPU memory, the CUDA allocator, psutil RSS/CPU, vLLM's KV gauges),
sampled on demand by `ResourceProbe.sample(backend)`; nothing heavy imported at import time.
Design notes: docs/design.md.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any

import numpy as np
import prometheus_client

MIB = 1024 * 1024
# vLLM's in-process Prometheus gauges; gpu_cache_usage_perc is the name before vLLM 0.10
KV_USAGE_GAUGES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
RUNNING_GAUGE, WAITING_GAUGE = "vllm:num_requests_running", "vllm:num_requests_waiting"
NO_GPU_NOTE = "no GPU: showing CPU and RAM"


def vllm_gauges(registry: Any = None) -> dict[str, float]:
    """vLLM's KV-cache usage (0..1, mean over engines) and running/waiting requests (sums), from the gauges
    its stat logger keeps in this process's prometheus_client registry; {} when vLLM never ran here."""
    registry = prometheus_client.REGISTRY if registry is None else registry  # vLLM's is the process default
    values: dict[str, list[float]] = {}
    for metric in registry.restricted_registry([*KV_USAGE_GAUGES, RUNNING_GAUGE, WAITING_GAUGE]).collect():
        values.setdefault(metric.name, []).extend(s.value for s in metric.samples if s.name == metric.name)
    out: dict[str, float] = {}  # per key: the first of its gauge names that vLLM has
    for key, names, agg in (("kv_cache_usage", KV_USAGE_GAUGES, np.mean), ("engine_running", [RUNNING_GAUGE], sum),
                            ("engine_waiting", [WAITING_GAUGE], sum)):
        if got := next((values[n] for n in names if values.get(n)), None):
            out[key] = float(agg(got))
    return out


def kv_cache_tokens(backend: Any) -> int | None:
    """KV-cache capacity in tokens (blocks x block size) the vLLM engine reported at start."""
    if backend is None or backend.name != "vllm" or backend.engine is None:  # no engine while it restarts
        return None
    cache = backend.engine.vllm_config.cache_config
    return cache.num_gpu_blocks * cache.block_size if cache.num_gpu_blocks and cache.block_size else None


class ResourceProbe:
    """Takes one memory/CPU sample; keeps NVML's handle and the last CPU times between samples."""

    def __init__(self) -> None:
        self._nvml: Any = None  # the pynvml module once initialised; False when NVML is unavailable
        self._cpu_prev: tuple[float, dict[int, float]] | None = None  # (monotonic s, {pid: cpu s})
        self._n_cpus = os.cpu_count() or 1

    def sample(self, backend: Any = None) -> dict[str, Any]:
        me = os.getpid()
        tree = _process_tree(me)  # {pid: (name + cmdline, rss bytes, cpu seconds)}
        now = time.monotonic()
        cpu_now = {pid: info[2] for pid, info in tree.items()}
        prev_t, prev = self._cpu_prev or (now, {})
        dt = now - prev_t
        self._cpu_prev = (now, cpu_now)
        percent = {pid: (100.0 * max(0.0, c - prev[pid]) / dt if dt > 0 and pid in prev else 0.0)
                   for pid, c in cpu_now.items()}
        device, gpu_mib = self._nvml_sample()
        torch_mem, driver = _torch_allocator()
        device = device or driver  # CUDA without NVML: device totals from the driver
        pids = sorted(set(tree) | set(gpu_mib), key=lambda p: (p != me, p))
        processes = [{"pid": pid, "role": _role(pid, me, tree[pid][0]) if pid in tree else "other",
                      "gpu_mib": gpu_mib.get(pid),
                      "rss_mib": tree[pid][1] / MIB if pid in tree else None,
                      "cpu_percent": percent.get(pid)} for pid in pids]
        ram_used, ram_total = _system_ram()
        gpu = device is not None
        gauges = vllm_gauges() if backend is not None and backend.name == "vllm" else {}
        return {
            "t": time.time(), "gpu": gpu, "note": "" if gpu else NO_GPU_NOTE, "device": device,
            "processes": processes, "torch": torch_mem, "kv_cache_usage": gauges.get("kv_cache_usage"),
            "engine_running": gauges.get("engine_running"), "engine_waiting": gauges.get("engine_waiting"),
            "kv_cache_tokens": kv_cache_tokens(backend),
            "cpu": {"n_cpus": self._n_cpus, "percent": sum(percent.values()),
                    "rss_mib": sum(info[1] for info in tree.values()) / MIB,
                    "ram_used_mib": ram_used / MIB, "ram_total_mib": ram_total / MIB},
        }

    def _nvml_sample(self) -> tuple[dict[str, Any] | None, dict[int, float]]:
        """(device {index, name, used_mib, total_mib}, {pid: used MiB}) or (None, {}) without NVML."""
        if self._nvml is None:
            try:
                import pynvml  # nvidia-ml-py

                pynvml.nvmlInit()
                self._nvml = pynvml
            except Exception:  # not installed, no driver (NVMLError_LibraryNotFound), no device
                self._nvml = False
        if not self._nvml:
            return None, {}
        nv = self._nvml
        # the device this process uses: the first of CUDA_VISIBLE_DEVICES (an index or a UUID), else 0
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        index = int(first) if first.isdigit() else first
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index) if first.isdigit() else nv.nvmlDeviceGetHandleByUUID(first)
            mem = nv.nvmlDeviceGetMemoryInfo(handle)
            name = nv.nvmlDeviceGetName(handle)
            per_pid: dict[int, float] = {}
            procs = list(nv.nvmlDeviceGetComputeRunningProcesses(handle))
            # a CUDA MPS server's clients (where the host runs one), which NVML lists apart: the compute list
            # then holds the server only (none without MPS or where the driver cannot say)
            with contextlib.suppress(nv.NVMLError, AttributeError):
                procs += nv.nvmlDeviceGetMPSComputeRunningProcesses(handle)
            for p in procs:
                used = getattr(p, "usedGpuMemory", None)  # None where the driver does not say (e.g. MIG)
                per_pid[int(p.pid)] = per_pid.get(int(p.pid), 0.0) + (used or 0) / MIB
        except nv.NVMLError:
            return None, {}
        name = name.decode() if isinstance(name, bytes) else str(name)
        return {"index": index, "name": name, "used_mib": mem.used / MIB, "total_mib": mem.total / MIB}, per_pid


def _torch_allocator() -> tuple[dict[str, float] | None, dict[str, Any] | None]:
    """(this process's caching allocator, its device {index, name, used_mib, total_mib} from the driver) once
    CUDA is initialised here (never initialises it); (None, None) before."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None, None
    free, total = torch.cuda.mem_get_info()
    dev = torch.cuda.current_device()
    return ({"allocated_mib": torch.cuda.memory_allocated() / MIB, "reserved_mib": torch.cuda.memory_reserved() / MIB,
             "max_allocated_mib": torch.cuda.max_memory_allocated() / MIB},
            {"index": dev, "name": torch.cuda.get_device_name(dev), "used_mib": (total - free) / MIB,
             "total_mib": total / MIB})


def _role(pid: int, me: int, title: str) -> str:
    if pid == me:
        return "app"
    low = title.lower()  # vLLM names its processes "VLLM::EngineCore", "VLLM::Worker..." (setproctitle)
    return "vLLM engine" if "vllm" in low or "enginecore" in low else "other"


def _process_tree(root: int) -> dict[int, tuple[str, int, float]]:
    """{pid: (name and command line, RSS bytes, user+system CPU seconds)} of `root` and its descendants."""
    import psutil  # a dependency of vLLM, pinned in both requirements files

    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.Error:
        return {}
    out = {}
    for p in procs:
        try:
            with p.oneshot():
                cpu = p.cpu_times()
                out[p.pid] = (f"{p.name()} {' '.join(p.cmdline()[:2])}", p.memory_info().rss, cpu.user + cpu.system)
        except psutil.Error:  # ended between the listing and the read
            continue
    return out


def _system_ram() -> tuple[int, int]:
    """(used, total) bytes of the machine's RAM; used = total - available."""
    import psutil

    vm = psutil.virtual_memory()
    return vm.total - vm.available, vm.total
