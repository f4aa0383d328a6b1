"""Live panels: memory over time, latency of recent requests, engine facts; refreshed by a `gr.Timer`.

`build_panels(service)` is called inside the layout's `gr.Blocks` and returns its timer (the layout stops it
while the panels are collapsed). Each timer tick (`[ui] panel_refresh_s`, 1 s, while a request runs or
ended within IDLE_AFTER_S; IDLE_TICK_S when idle, so an open idle tab redraws rarely; no queue, so panels
never wait behind synthesis jobs) takes one memory sample through
`service.metrics.memory_snapshot(backend)` and redraws from the metrics' ring buffers. Without
a GPU the memory panels show CPU and RAM and say so. docs/panels.md says where each number comes from.
All of them are server-side; what a listener's browser adds (click -> first byte -> first sound) is on
the low-latency player's line and in its request details.
"""

from __future__ import annotations

import time
from typing import Any

import gradio as gr
import pandas as pd

from app.engine.metrics import Metrics
from app.engine.resources import NO_GPU_NOTE
from app.ui.i18n import lang_of

TICK_S = 1.0
WINDOW = 180  # memory samples plotted (~3 min at one tick a second)
N_REQUESTS = 30  # requests in the latency table's source and the headline
N_PLOTTED = 15  # requests in the per-stage and latency plots (their x labels stay readable)
X_LABEL_ANGLE = -45  # degrees: request labels slanted, so neighbours never overlap
IDLE_AFTER_S = 10.0  # no stream for this long: the panels are idle
IDLE_TICK_S = 10.0  # the timer's period while idle (s)
N_TABLE = 8  # rows of the latency table, newest first
STAGES = (("queue_wait_s", "queue wait"), ("lm_s", "LM"), ("flow_s", "flow"), ("vocoder_s", "vocoder"))
TABLE_COLUMNS = ("#", "request", "ended", "outcome", "TTFA ms", "RTF", "queue s", "LM s", "flow s", "vocoder s",
                 "audio s", "tokens/s")
REQUEST_ID_CHARS = 8  # the table's "request": the start of the request id (X-Request-Id, the page's details)

# for the layout's gr.I18n: merge these into its translations (component labels only)
PANEL_TRANSLATIONS = {
    "en": {"panels_memory": "Memory", "panels_load": "Load", "panels_stages": "Per-stage time",
           "panels_latency": "Latency", "panels_recent": "Recent requests", "panels_facts": "Engine"},
    "zh": {"panels_memory": "内存", "panels_load": "负载", "panels_stages": "各阶段耗时", "panels_latency": "延迟",
           "panels_recent": "最近的请求", "panels_facts": "引擎"},
}


# chart titles, set on every tick in the page's language (gr.I18n covers component labels only)
CHART_TITLES = {
    "en": {"gpu": "GPU {name} memory (MiB)", "ram": f"RAM (MiB) · {NO_GPU_NOTE}",
           "load": "CPU (% of one core) and vLLM KV-cache usage (%)",
           "stages": "Seconds per stage (stacked) of the recent requests",
           "latency": "TTFA (s), RTF and queue wait (s) per request"},
    "zh": {"gpu": "GPU {name} 显存（MiB）", "ram": "内存（MiB）· 没有 GPU：显示 CPU 和内存",
           "load": "CPU（单核百分比）和 vLLM KV 缓存占用（%）", "stages": "最近请求各阶段耗时（秒，堆叠）",
           "latency": "每个请求的首音时间（秒）、实时率和排队时间（秒）"},
}


def build_panels(service: Any, i18n: gr.I18n | None = None) -> gr.Timer:
    """Create the panel components and their timer inside the current `gr.Blocks` context; returns the timer.

    `service` is the `StudioService`: `metrics` (a `Metrics`), `backend` (None until started),
    `status`, `facts()`.
    """
    label = i18n if i18n is not None else (lambda key: PANEL_TRANSLATIONS["en"][key])
    headline = gr.Markdown("Panels start with the first timer tick...", elem_id="panel_headline")
    with gr.Row():
        memory = gr.LinePlot(x="seconds", y="MiB", color="series", label=label("panels_memory"),
                             x_title="seconds ago", elem_id="memory_plot")
        load = gr.LinePlot(x="seconds", y="percent", color="series", label=label("panels_load"),
                           x_title="seconds ago", elem_id="load_plot")
    with gr.Row():
        stages = gr.BarPlot(x="request", y="seconds", color="stage", label=label("panels_stages"),
                            x_title="request #", x_label_angle=X_LABEL_ANGLE, elem_id="stage_plot")
        # points, not lines: one request is already visible
        latency = gr.ScatterPlot(x="request", y="value", color="series", label=label("panels_latency"),
                                 x_title="request #", x_label_angle=X_LABEL_ANGLE, elem_id="latency_plot")
    table = gr.Dataframe(pd.DataFrame(columns=list(TABLE_COLUMNS)), label=label("panels_recent"),
                         interactive=False, elem_id="latency_table")
    with gr.Accordion(label("panels_facts"), open=False, elem_id="engine_facts_box"):  # ~1,500 px tall
        facts = gr.Markdown(elem_id="engine_facts")
    ui = getattr(getattr(service, "cfg", None), "ui", None)
    busy_tick_s = getattr(ui, "panel_refresh_s", TICK_S)
    timer = gr.Timer(busy_tick_s)

    def tick(request: gr.Request) -> tuple[Any, ...]:
        period = busy_tick_s if busy(service) else max(busy_tick_s, IDLE_TICK_S)
        return (*refresh(service, lang_of(request)), gr.Timer(value=period))

    timer.tick(tick, None, [headline, memory, load, stages, latency, table, facts, timer],
               show_progress="hidden", queue=False, api_visibility="private")
    return timer


def busy(service: Any) -> bool:
    """A request streams now or ended within IDLE_AFTER_S (the panels tick fast then)."""
    m: Metrics = service.metrics
    recent = m.recent(1)
    return m.active_streams > 0 or bool(recent and time.time() - recent[-1]["t"] < IDLE_AFTER_S)


def refresh(service: Any, lang: str = "en") -> tuple[Any, ...]:
    """One tick: sample memory once, then redraw every panel from the metrics (chart titles in `lang`)."""
    metrics: Metrics = service.metrics
    backend = getattr(service, "backend", None)
    snap = metrics.memory_snapshot(backend)
    history = metrics.memory_history(WINDOW)
    recent = metrics.recent(N_REQUESTS)
    now = time.time()
    mem_df, load_df = memory_frames(history, now)
    titles = CHART_TITLES["zh" if lang == "zh" else "en"]
    mem_title = titles["gpu"].format(name=snap["device"]["name"]) if snap["gpu"] else titles["ram"]
    return (
        headline_text(service, snap),
        gr.LinePlot(value=mem_df, title=mem_title),
        gr.LinePlot(value=load_df, title=titles["load"]),
        gr.BarPlot(value=stage_frame(recent[-N_PLOTTED:]), title=titles["stages"]),
        gr.ScatterPlot(value=latency_frame(recent[-N_PLOTTED:]), title=titles["latency"]),
        table_frame(recent),
        facts_text(service, snap),
    )


def memory_frames(history: list[dict[str, Any]], now: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Long-form frames (seconds, MiB|percent, series) of the memory and load series."""
    mem_rows, load_rows = [], []
    for s in history:
        x = s["t"] - now  # <= 0: seconds ago
        by_role: dict[str, dict[str, float]] = {}
        for p in s["processes"]:
            acc = by_role.setdefault(p["role"], {"gpu": 0.0, "rss": 0.0, "cpu": 0.0})
            acc["gpu"] += p["gpu_mib"] or 0.0
            acc["rss"] += p["rss_mib"] or 0.0
            acc["cpu"] += p["cpu_percent"] or 0.0
        if s["gpu"]:
            mem = {"device used": s["device"]["used_mib"], "device total": s["device"]["total_mib"]}
            mem.update({f"{role} (NVML)": v["gpu"] for role, v in by_role.items() if v["gpu"] > 0})
            if s["torch"] is not None:
                mem["app torch reserved"] = s["torch"]["reserved_mib"]
                mem["app torch allocated"] = s["torch"]["allocated_mib"]
        else:
            mem = {f"{role} RSS": v["rss"] for role, v in by_role.items()}
            mem["all RSS"] = s["cpu"]["rss_mib"]
        load = {f"{role} CPU": v["cpu"] for role, v in by_role.items() if role != "other" or v["rss"] > 0}
        if s["kv_cache_usage"] is not None:
            load["KV cache"] = 100.0 * s["kv_cache_usage"]
        mem_rows += [(x, v, k) for k, v in mem.items()]
        load_rows += [(x, v, k) for k, v in load.items()]
    return (pd.DataFrame(mem_rows, columns=["seconds", "MiB", "series"]),
            pd.DataFrame(load_rows, columns=["seconds", "percent", "series"]))


def stage_frame(recent: list[dict[str, Any]]) -> pd.DataFrame:
    rows = [(f"{r['seq']:04d}", r[key] or 0.0, name) for r in recent if r["lm_s"] is not None for key, name in STAGES]
    return pd.DataFrame(rows, columns=["request", "seconds", "stage"])


def latency_frame(recent: list[dict[str, Any]]) -> pd.DataFrame:
    rows = []
    for r in recent:
        if r["ttfa_ms"] is not None:
            rows += [(f"{r['seq']:04d}", r["ttfa_ms"] / 1000, "TTFA s"),
                     (f"{r['seq']:04d}", r["queue_wait_s"], "queue wait s")]
        if r["rtf"] is not None:
            rows.append((f"{r['seq']:04d}", r["rtf"], "RTF"))
    return pd.DataFrame(rows, columns=["request", "value", "series"])


def table_frame(recent: list[dict[str, Any]]) -> pd.DataFrame:
    def num(x: float | None, digits: int) -> str:
        return "" if x is None else f"{x:.{digits}f}"

    rows = [(r["seq"], r["request_id"][:REQUEST_ID_CHARS], time.strftime("%H:%M:%S", time.localtime(r["t"])),
             r["outcome"], num(r["ttfa_ms"], 0), num(r["rtf"], 3), num(r["queue_wait_s"], 3), num(r["lm_s"], 3),
             num(r["flow_s"], 3), num(r["vocoder_s"], 3), num(r["audio_s"], 2), num(r["tokens_per_s"], 1))
            for r in reversed(recent[-N_TABLE:])]
    return pd.DataFrame(rows, columns=list(TABLE_COLUMNS))


def headline_text(service: Any, snap: dict[str, Any]) -> str:
    m: Metrics = service.metrics
    parts = [f"**{getattr(service, 'status', '?')}**", f"active streams **{m.active_streams}**"]
    if snap["gpu"]:
        d = snap["device"]
        parts.append(f"GPU {d['name']}: **{d['used_mib'] / 1024:.1f} / {d['total_mib'] / 1024:.1f} GiB** used")
        if snap["torch"] is not None:
            parts.append(f"app torch {snap['torch']['allocated_mib']:.0f} MiB allocated, "
                         f"{snap['torch']['reserved_mib']:.0f} MiB reserved")
    else:
        c = snap["cpu"]
        parts.append(f"{NO_GPU_NOTE} · CPU **{c['percent']:.0f} %** of {c['n_cpus']} cores · RSS "
                     f"**{c['rss_mib'] / 1024:.2f} GiB** (RAM {c['ram_used_mib'] / 1024:.1f} / "
                     f"{c['ram_total_mib'] / 1024:.1f} GiB used)")
    if snap["kv_cache_usage"] is not None:
        parts.append(f"KV cache **{100 * snap['kv_cache_usage']:.1f} %**")
    ttfa, rtf = m.percentiles("ttfa_ms"), m.percentiles("rtf")
    if ttfa["p50"] is not None:
        parts.append(f"TTFA p50 {ttfa['p50']:.0f} ms / p95 {ttfa['p95']:.0f} ms")
    if rtf["p50"] is not None:
        parts.append(f"RTF p50 {rtf['p50']:.2f}")
    return " · ".join(parts)


def facts_text(service: Any, snap: dict[str, Any]) -> str:
    """A two-column Markdown table: service facts, live engine numbers, request counters."""
    try:
        facts = dict(service.facts())
    except Exception as e:  # the service is still loading or failed: show why, keep the panel alive
        facts = {"facts": f"unavailable ({type(e).__name__}: {e})"}
    backend = getattr(service, "backend", None)
    live: dict[str, Any] = {"status": getattr(service, "status", "?"), "active streams": service.metrics.active_streams}
    n_unfinished = getattr(backend, "n_unfinished", None)
    if callable(n_unfinished):
        live["unfinished engine requests"] = n_unfinished()
    for key, name in (("engine_running", "engine running"), ("engine_waiting", "engine waiting")):
        if snap[key] is not None:
            live[name] = int(snap[key])
    if snap["kv_cache_tokens"] is not None:
        live["KV-cache capacity"] = f"{snap['kv_cache_tokens']:,} tokens"
    counters = service.metrics.counters()
    live["requests"] = ", ".join(f"{k} {v}" for k, v in counters["outcomes"].items())
    live["audio produced"] = f"{counters['audio_s_total']:.1f} s"
    lines = ["| fact | value |", "|---|---|"]
    for key, value in {**live, **facts}.items():
        lines.append(f"| {key} | {_cell(value)} |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        return "<br>".join(f"{k}: {_cell(v)}" for k, v in value.items()) or "–"
    text = str(value).replace("|", "\\|")  # a bar would end the table cell
    return f"`{text}`" if isinstance(value, (str, bool, list, tuple)) and text else text
