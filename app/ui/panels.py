"""Live panels: memory over time, latency of recent requests, engine facts; refreshed by a `gr.Timer`.
Design notes: docs/design.md."""

from __future__ import annotations

import functools
import time
from typing import Any

import gradio as gr
import pandas as pd

from app.service.resources import NO_GPU_NOTE
from app.service.service import Studio
from app.ui.handlers import viewer
from app.ui.i18n import lang_of, locale, say

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
ROLE_SUMS = {"gpu": "gpu_mib", "rss": "rss_mib", "cpu": "cpu_percent"}  # per role: sum -> process field
REQUEST_ID_CHARS = 8  # the table's "request": the start of the request id (X-Request-Id, the page's details)


@functools.cache
def catalog() -> dict[str, Any]:
    """app/ui/locales/panels.toml: labels, chart_titles and text by language, words (English -> Chinese); the
    English no-GPU note is the engine's own NO_GPU_NOTE."""
    cat = locale("panels")
    titles_en = {**cat["chart_titles"]["en"], "ram": f"RAM (MiB) · {NO_GPU_NOTE}"}
    text_en = {**cat["text"]["en"], "no_gpu": NO_GPU_NOTE}
    return {**cat, "chart_titles": {**cat["chart_titles"], "en": titles_en}, "text": {**cat["text"], "en": text_en}}


def word(text: str, lang: str) -> str:
    """A panel word (axis, series, column, outcome, fact) in `lang`; a series "<role> CPU" etc. by its role."""
    if lang != "zh":
        return text
    words = catalog()["words"]
    if text in words:
        return words[text]
    role, _, kind = text.rpartition(" ")
    return f"{words.get(role, role)} {kind}" if role and kind in ("CPU", "RSS", "(NVML)") else text


def build_panels(service: Studio, label: gr.I18n) -> gr.Timer:
    """Create the panel components and their timer inside the current `gr.Blocks` context; returns the timer."""
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
    busy_tick_s = service.cfg.ui.panel_refresh_s
    admins = service.cfg.server.admin_owners
    timer = gr.Timer(busy_tick_s)

    def tick(request: gr.Request, profile: gr.OAuthProfile | None = None) -> tuple[Any, ...]:
        m, recent = service.metrics, service.metrics.recent(1)  # busy: a stream now or within IDLE_AFTER_S
        busy = m.active_streams > 0 or bool(recent and time.time() - recent[-1]["t"] < IDLE_AFTER_S)
        period = busy_tick_s if busy else max(busy_tick_s, IDLE_TICK_S)
        return (*refresh(service, lang_of(request), viewer(request, profile, admins)), gr.Timer(value=period))

    timer.tick(tick, None, [headline, memory, load, stages, latency, table, facts, timer], show_progress="hidden",
               queue=False, api_visibility="private")
    return timer


def refresh(service: Studio, lang: str = "en", owners: frozenset[str] | None = None) -> tuple[Any, ...]:
    """One tick: sample memory once, then redraw every panel from the metrics (chart titles in `lang`). `owners`:
    the requests shown are theirs and the facts the public ones (None: an admin's view, everything)."""
    metrics = service.metrics
    snap = metrics.memory_snapshot(service.backend)
    recent = [r for r in metrics.recent() if owners is None or r["owner"] in owners][-N_REQUESTS:]
    mem_df, load_df = memory_frames(metrics.memory_history(WINDOW), time.time())
    lang = "zh" if lang == "zh" else "en"
    titles, text = catalog()["chart_titles"][lang], catalog()["text"][lang]
    mem_title = titles["gpu"].format(name=snap["device"]["name"]) if snap["gpu"] else titles["ram"]
    stage_df, latency_df = stage_frame(recent[-N_PLOTTED:]), latency_frame(recent[-N_PLOTTED:])
    for df, column in ((mem_df, "series"), (load_df, "series"), (stage_df, "stage"), (latency_df, "series")):
        # the legends; `map` keeps an empty column's dtype: a list would make it float, which Gradio types
        # "quantitative", and the browser then draws a "NaN" gradient legend and no bars, also once data comes
        df[column] = df[column].map(lambda x: word(x, lang))
    ago, req, series = text["seconds ago"], text["request #"], word("series", lang)
    return (
        headline_text(service, snap, lang, text),
        gr.LinePlot(value=mem_df, title=mem_title, x_title=ago, y_title=word("MiB", lang), color_title=series),
        gr.LinePlot(value=load_df, title=titles["load"], x_title=ago, y_title=word("percent", lang),
                    color_title=series),
        gr.BarPlot(value=stage_df, title=titles["stages"], x_title=req, y_title=word("seconds", lang),
                   color_title=word("stage", lang)),
        gr.ScatterPlot(value=latency_df, title=titles["latency"], x_title=req, y_title=word("value", lang),
                       color_title=series),
        table_frame(recent, lang),
        facts_text(service, snap, lang, text, public=owners is not None),
    )


def memory_frames(history: list[dict[str, Any]], now: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Long-form frames (seconds, MiB|percent, series) of the memory and load series."""
    mem_rows, load_rows = [], []
    for s in history:
        x = s["t"] - now  # <= 0: seconds ago
        by_role: dict[str, dict[str, float]] = {}
        for p in s["processes"]:
            acc = by_role.setdefault(p["role"], dict.fromkeys(ROLE_SUMS, 0.0))
            for k, field in ROLE_SUMS.items():
                acc[k] += p[field] or 0.0
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


def table_frame(recent: list[dict[str, Any]], lang: str = "en") -> pd.DataFrame:
    """The newest N_TABLE requests; a stopped or cancelled one shows what was measured until its end."""
    def num(x: float | None, digits: int) -> str:
        return "" if x is None else f"{x:.{digits}f}"

    rows = [(r["seq"], r["request_id"][:REQUEST_ID_CHARS], time.strftime("%H:%M:%S", time.localtime(r["t"])),
             word("stopped" if r["stopped"] else r["outcome"], lang), num(r["ttfa_ms"], 0), num(r["rtf"], 3),
             num(r["queue_wait_s"], 3), num(r["lm_s"], 3), num(r["flow_s"], 3), num(r["vocoder_s"], 3),
             num(r["audio_s"], 2), num(r["tokens_per_s"], 1))
            for r in reversed(recent[-N_TABLE:])]
    return pd.DataFrame(rows, columns=[word(c, lang) for c in TABLE_COLUMNS])


def headline_text(service: Studio, snap: dict[str, Any], lang: str, w: dict[str, str]) -> str:
    m = service.metrics
    parts = [f"**{say(service.status, lang)}**", w["active"].format(n=m.active_streams)]
    if snap["gpu"]:
        d = snap["device"]
        parts.append(w["gpu"].format(name=d["name"], used=d["used_mib"] / 1024, total=d["total_mib"] / 1024))
        if snap["torch"] is not None:
            parts.append(w["torch"].format(allocated=snap["torch"]["allocated_mib"],
                                           reserved=snap["torch"]["reserved_mib"]))
    else:
        c = snap["cpu"]
        parts.append(f"{w['no_gpu']} · " + w["cpu"].format(
            percent=c["percent"], n_cpus=c["n_cpus"], rss=c["rss_mib"] / 1024, used=c["ram_used_mib"] / 1024,
            total=c["ram_total_mib"] / 1024))
    if snap["kv_cache_usage"] is not None:
        parts.append(w["kv"].format(percent=100 * snap["kv_cache_usage"]))
    ttfa, rtf = m.percentiles("ttfa_ms"), m.percentiles("rtf")
    if ttfa["p50"] is not None:
        parts.append(w["ttfa"].format(**ttfa))
    if rtf["p50"] is not None:
        parts.append(w["rtf"].format(**rtf))
    return " · ".join(parts)


def facts_text(service: Studio, snap: dict[str, Any], lang: str, w: dict[str, str], public: bool = False) -> str:
    """A two-column Markdown table: service facts, live engine numbers, request counters (names in `lang`).
    `public`: what anybody may know (`public_health`: no paths, engine arguments or environment)."""
    try:
        facts = dict(service.public_health() if public else service.facts())
    except Exception as e:  # the service is still loading or failed: show why, keep the panel alive
        facts = {"facts": w["unavailable"].format(error=f"{type(e).__name__}: {e}")}
    counters = service.metrics.counters()  # what /health and /metrics read
    live: dict[str, Any] = {"status": say(service.status, lang), "active streams": counters["active_streams"]}
    if service.backend is not None and service.backend.name == "vllm":  # the vLLM engine's own count
        live["unfinished engine requests"] = service.backend.health().unfinished
    live.update({k.replace("_", " "): int(snap[k]) for k in ("engine_running", "engine_waiting")
                 if snap[k] is not None})
    if snap["kv_cache_tokens"] is not None:
        live["KV-cache capacity"] = w["tokens"].format(n=snap["kv_cache_tokens"])
    live["requests"] = ", ".join(f"{word(k, lang)} {v}" for k, v in counters["outcomes"].items())
    live["audio produced"] = w["audio"].format(s=counters["audio_s_total"])
    return "\n".join([f"| {word('fact', lang)} | {word('value', lang)} |", "|---|---|",
                      *(f"| {word(key, lang)} | {_cell(value)} |" for key, value in {**live, **facts}.items())])


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        return "<br>".join(f"{k}: {_cell(v)}" for k, v in value.items()) or "–"
    text = str(value).replace("|", "\\|")  # a bar would end the table cell
    return f"`{text}`" if isinstance(value, (str, bool, list, tuple)) and text else text
