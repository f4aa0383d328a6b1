"""Numbers and output of the serving benchmark (`python -m bench`): per-request results,
per-level summaries, machine facts, the Markdown table and the PNG plots.

Definitions (docs/bench.md has the long form; times in seconds from the request's start unless *_ms):
* TTFA: the first non-empty audio piece in the client's hands (in-process: the chunk out of
  `StudioService.stream`; over HTTP: the first body bytes). With a new voice it includes the frontend.
* RTF: wall (start -> last audio) / audio seconds produced.
* stall: audio piece k (k >= 1) is late when it arrives after the audio before it has finished
  playing, playback starting at the first piece: t_k > t_0 + sum(duration of pieces < k). Per level:
  `stalls` (late pieces), `late_pct` (of the pieces k >= 1), `streams_stalled`, `max_late_ms`.
* continuity: the share of requests whose worst gap is at most CONTINUITY_GAP_MS (vLLM-Omni's benchmark
  counts it so); capacity: the most streams of a sweep served with no late piece and no error.
Nothing here imports matplotlib at import time (the PNG needs it; `bench plot` re-draws from JSON).
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.audio import OUTPUT_SAMPLE_RATE_HZ

REPO = Path(__file__).resolve().parents[1]
GIB = 1024**3
LEVEL_FIELDS = ("voice", "concurrency", "n", "errors", "ttfa_p50_ms", "ttfa_p95_ms", "ttfa_max_ms", "rtf_p50",
                "rtf_p95", "audio_s_per_s", "tokens_per_s", "stalls", "late_pct", "max_late_ms", "continuity_pct",
                "gpu_mem_gb", "rss_gb",
                "first_wait_p50_ms", "flow_tflops", "padding_waste")  # the last three: what each lever moves


CONTINUITY_GAP_MS = 100.0  # a gap a listener barely notices (the field's continuity figure)


@dataclass
class RequestResult:
    """One measured request. `arrivals` are (s since start, samples) of each non-empty audio piece."""

    index: int
    ok: bool
    error: str | None = None
    ttfa_ms: float | None = None
    wall_s: float | None = None
    audio_s: float = 0.0
    n_tokens: int = 0  # LM speech tokens (in-process: RequestStats; HTTP: audio samples / 960)
    n_pieces: int = 0
    stalls: int = 0
    max_late_ms: float = 0.0
    server_ttfa_ms: float | None = None  # in-process: RequestStats.ttfa_ms; HTTP: X-TTFA-Ms
    queue_ms: float | None = None  # HTTP: X-Queue-Ms (waiting for an API slot); in-process: None
    frontend_s: float | None = None  # new voice: reference -> features (HTTP: POST /v1/voices)
    lm_s: float | None = None
    flow_s: float | None = None
    hift_s: float | None = None
    first_token_ms: float | None = None  # in-process: RequestStats.first_token_ms / first_hop_ms
    first_hop_ms: float | None = None
    lm_ms_per_token: float | None = None  # in-process: RequestStats.lm_ms_per_token (the LM's pace in the pipeline)
    first_flow_ms: float | None = None  # in-process: the first chunk's flow call (RequestStats.chunk_flow_ms[0])
    # in-process: per chunk, flow ms per emitted mel frame (RequestStats.chunk_flow_ms / chunk_frames)
    flow_ms_per_frame: list[float] | None = None
    first_wave_ms: float | None = None  # in-process: RequestStats.first_wave_ms / first_hift_ms
    first_hift_ms: float | None = None

    @property
    def first_wait_ms(self) -> float | None:
        """The first chunk's time on the token->wave side that is neither its flow call nor its own HiFT: the
        wait for its worker, and the HiFT of other streams' chunks batched before its own (utterance.py)."""
        parts = (self.first_wave_ms, self.first_hift_ms, self.first_flow_ms, self.first_hop_ms)
        return None if None in parts else parts[0] - parts[1] - parts[2] - parts[3]

    @property
    def first_handoff_ms(self) -> float | None:
        """The first chunk's wave ready on its worker -> the stream yields it (the event loop's hand-off)."""
        return None if None in (self.server_ttfa_ms, self.first_wave_ms) else self.server_ttfa_ms - self.first_wave_ms

    @property
    def rtf(self) -> float | None:
        return self.wall_s / self.audio_s if self.ok and self.audio_s > 0 and self.wall_s is not None else None


def late_pieces(arrivals: list[tuple[float, int]]) -> tuple[int, float]:
    """(pieces ready after the audio before them finished playing, max lateness in ms; 0 if none)."""
    if not arrivals:
        return 0, 0.0
    t_first = arrivals[0][0]
    played_s, stalls, worst_s = 0.0, 0, 0.0
    for t, n in arrivals:
        late_s = t - (t_first + played_s)
        if late_s > 0:
            stalls += 1
            worst_s = max(worst_s, late_s)
        played_s += n / OUTPUT_SAMPLE_RATE_HZ
    return stalls, worst_s * 1e3


def result_from_arrivals(index: int, arrivals: list[tuple[float, int]], wall_s: float, **extra: Any) -> RequestResult:
    """A successful request's result from its audio arrivals (times in s since its start)."""
    stalls, worst_ms = late_pieces(arrivals)
    n_samples = sum(n for _, n in arrivals)
    return RequestResult(index=index, ok=True, ttfa_ms=arrivals[0][0] * 1e3 if arrivals else None, wall_s=wall_s,
                         audio_s=n_samples / OUTPUT_SAMPLE_RATE_HZ, n_pieces=len(arrivals), stalls=stalls,
                         max_late_ms=worst_ms, **extra)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(float(x), nd)


def flow_work_delta(before: dict[str, float] | None, after: dict[str, float] | None,
                    wall_s: float) -> dict[str, Any]:
    """The flow's work over one level from the engine's `flow_work` facts before and after it (in-process;
    None over HTTP): `flow_tflops` the estimator FLOPs computed (dense attention, padding included, from
    the model's dims: app/model/flow/work.py) per second of the level; `padding_waste` the frames padded
    / the frames computed; `flow_calls` the flow calls; `flow_frames_per_call` rows x frames per call."""
    if not before or not after:
        return {"flow_tflops": None, "padding_waste": None, "flow_calls": None, "flow_frames_per_call": None}
    d = {k: after[k] - before[k] for k in after}
    computed, calls = d["frames_computed"], d["calls"]
    return {"flow_tflops": float(f"{d['tflop'] / wall_s:.4g}") if wall_s > 0 else None,  # 4 digits: tiny on CPU
            "padding_waste": _r(1 - d["frames_needed"] / computed, 3) if computed else None,
            "flow_calls": calls, "flow_frames_per_call": _r(computed / calls, 1) if calls else None}


def summarize_level(voice: str, concurrency: int, results: list[RequestResult], wall_s: float,
                    mem: dict[str, float | None], work: dict[str, Any] | None = None) -> dict[str, Any]:
    """The level's row (LEVEL_FIELDS first, then extras, then every request); `work`: `flow_work_delta`'s."""
    ok = [r for r in results if r.ok]
    ttfa = [r.ttfa_ms for r in ok if r.ttfa_ms is not None]
    rtf = [r.rtf for r in ok if r.rtf is not None]
    audio_s, tokens = sum(r.audio_s for r in ok), sum(r.n_tokens for r in ok)

    def p50(key: str, nd: int = 3) -> float | None:
        return _r(_pct([getattr(r, key) for r in ok if getattr(r, key) is not None], 50), nd)

    errors = [r.error for r in results if not r.ok]
    stalls, can_be_late = sum(r.stalls for r in ok), sum(max(r.n_pieces - 1, 0) for r in ok)  # piece 0 is never late
    return {
        "voice": voice, "concurrency": concurrency, "n": len(results), "errors": len(errors),
        "ttfa_p50_ms": _r(_pct(ttfa, 50)), "ttfa_p95_ms": _r(_pct(ttfa, 95)),
        "ttfa_max_ms": _r(max(ttfa, default=None)),
        "rtf_p50": _r(_pct(rtf, 50), 4), "rtf_p95": _r(_pct(rtf, 95), 4),
        "audio_s_per_s": _r(audio_s / wall_s if wall_s > 0 else None, 3),
        "tokens_per_s": _r(tokens / wall_s if wall_s > 0 else None),
        "stalls": stalls, "late_pct": _r(100 * stalls / can_be_late if can_be_late else 0.0, 2),
        "max_late_ms": _r(max((r.max_late_ms for r in ok), default=0.0)),
        "continuity_pct": _r(100 * sum(r.max_late_ms <= CONTINUITY_GAP_MS for r in ok) / len(ok) if ok else None, 1),
        "gpu_mem_gb": _r(mem.get("gpu_mem_gb"), 2), "rss_gb": _r(mem.get("rss_gb"), 2),
        # extras
        "wall_s": _r(wall_s, 3), "audio_s_total": _r(audio_s, 3), "tokens_total": tokens,
        "streams_stalled": sum(r.stalls > 0 for r in ok),
        "server_ttfa_p50_ms": p50("server_ttfa_ms", 1), "queue_p50_ms": p50("queue_ms", 1),
        "frontend_p50_s": p50("frontend_s"), "lm_p50_s": p50("lm_s"), "flow_p50_s": p50("flow_s"),
        "hift_p50_s": p50("hift_s"), "first_token_p50_ms": p50("first_token_ms", 1),
        "first_hop_p50_ms": p50("first_hop_ms", 1), "first_flow_p50_ms": p50("first_flow_ms", 1),
        "lm_ms_per_token_p50": p50("lm_ms_per_token"),
        # first audio = first_hop + first_wait + first_flow + first_hift + first_handoff (each p50, so ~)
        "first_wait_p50_ms": p50("first_wait_ms", 1), "first_hift_p50_ms": p50("first_hift_ms", 1),
        "first_handoff_p50_ms": p50("first_handoff_ms", 1),
        **(work or flow_work_delta(None, None, wall_s)),
        "kv_cache_usage_peak": _r(mem.get("kv_cache_usage_peak"), 3),
        "gpu_total_gb": _r(mem.get("gpu_total_gb"), 1), "error_examples": sorted(set(errors))[:3],
        "flow_ms_per_frame_by_chunk": flow_by_chunk(ok),
        "requests": [_request_row(r) for r in results],
    }


def capacity(levels: list[dict[str, Any]]) -> dict[str, int | None]:
    """Per voice, the most concurrent streams of a sweep's levels served with no late piece and no error
    (None: every level had one)."""
    best: dict[str, int | None] = {}
    for lv in levels:
        clean = lv["stalls"] == 0 and lv["errors"] == 0 and lv["n"] > 0
        best.setdefault(lv["voice"], None)
        if clean and (best[lv["voice"]] or 0) < lv["concurrency"]:
            best[lv["voice"]] = lv["concurrency"]
    return best


def flow_by_chunk(results: list[RequestResult]) -> list[float] | None:
    """p50 over requests of the flow ms per emitted mel frame, by chunk position (None over HTTP)."""
    rows = [r.flow_ms_per_frame for r in results if r.flow_ms_per_frame]
    if not rows:
        return None
    return [_r(_pct([row[i] for row in rows if i < len(row)], 50), 3) for i in range(max(map(len, rows)))]


def _request_row(r: RequestResult) -> dict[str, Any]:
    """A request as JSON: ms to 0.1, seconds to 0.1 ms."""
    row = {k: (_r(v, 1 if k.endswith("_ms") else 4) if isinstance(v, float) else v) for k, v in asdict(r).items()}
    return {**row, "rtf": _r(r.rtf, 4), "first_wait_ms": _r(r.first_wait_ms, 1),
            "first_handoff_ms": _r(r.first_handoff_ms, 1)}


# --- facts about the run ----------------------------------------------------------------------------


def git_commit() -> str | None:
    """HEAD of the checkout (+ "-dirty" with uncommitted changes); $GIT_COMMIT where there is no .git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("GIT_COMMIT")


def gpu_name() -> str | None:
    """The first GPU's name: torch where it already runs CUDA here, else nvidia-smi, else None."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] or None
    return None


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"hostname": platform.node(), "cpu": cpu, "n_cpus": os.cpu_count(), "gpu": gpu_name(),
            "python": platform.python_version()}


def run_header(kind: str, argv: list[str]) -> dict[str, Any]:
    import shlex

    return {"tool": f"bench {kind}", "command": shlex.join(["python", "-m", "bench", *argv]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": git_commit(), "machine": machine_info()}


# --- table and plots --------------------------------------------------------------------------------


def format_table(rows: list[dict[str, Any]], columns: tuple[str, ...] = LEVEL_FIELDS) -> str:
    """A Markdown table of `columns` (None -> "-")."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join("-" if row.get(c) is None else str(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(report: dict[str, Any], path: str | Path) -> None:
    """2x2 panels against concurrency, one line per voice mode: TTFA, RTF, throughput, memory."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [(axes[0][0], ("ttfa_p50_ms", "ttfa_p95_ms"), "time to first audio (ms)"),
              (axes[0][1], ("rtf_p50", "rtf_p95"), "real-time factor per request"),
              (axes[1][0], ("audio_s_per_s",), "audio seconds produced per second"),
              (axes[1][1], ("gpu_mem_gb", "rss_gb"), "memory (GB): device used / app RSS")]
    voices = sorted({row["voice"] for row in report["levels"]})
    levels = sorted({row["concurrency"] for row in report["levels"]})
    for ax, keys, title in panels:
        for color, voice in enumerate(voices):
            rows = [r for r in report["levels"] if r["voice"] == voice]
            for style, key in zip(("-", "--"), keys, strict=False):  # first key solid, second dashed
                pts = [(r["concurrency"], r[key]) for r in rows if r.get(key) is not None]
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, marker="o", color=f"C{color}",
                            label=f"{key} ({voice} voice)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    machine = report.get("machine", {})
    fig.suptitle(f"{machine.get('gpu') or machine.get('cpu')} | {report.get('date', '')[:10]} | "
                 f"fixed_tokens={report.get('settings', {}).get('fixed_tokens')} | {report.get('commit') or ''}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory(report: dict[str, Any], path: str | Path) -> None:
    """KV-cache capacity and memory in use against the memory knob, one line per max_model_len."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    knob = report["knob"]
    for mml in sorted({r["max_model_len"] for r in report["rows"]}):
        rows = [r for r in report["rows"] if r["max_model_len"] == mml and r.get("kv_cache_tokens")]
        if not rows:
            continue
        xs = [r["knob_value"] for r in rows]
        axes[0].plot(xs, [r["kv_cache_tokens"] for r in rows], marker="o", label=f"max_model_len {mml}")
        mem_key = "device_used_gb" if report.get("gpu") else "rss_gb"
        axes[1].plot(xs, [r[mem_key] for r in rows], marker="o", label=f"max_model_len {mml}")
    axes[0].set_title("KV-cache capacity (tokens)")
    axes[1].set_title("device memory used (GB)" if report.get("gpu") else "app + engine RSS (GB)")
    for ax in axes:
        ax.set_xlabel(knob)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"{report['machine'].get('gpu') or report['machine'].get('cpu')} | {report['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
