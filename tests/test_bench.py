"""The serving benchmark `python -m bench` on CPU (tiny model, real vLLM CPU engine): the
in-process sweep, the same sweep over HTTP against `python app.py`, and the memory experiment.

Each benchmark runs as its own process (as users run it) in its own process group, killed in
`finally`; one vLLM engine at a time. ~3.5 min on 2 cores, almost all of it engine starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from app.audio import TOKEN_RATE_HZ
from bench.report import LEVEL_FIELDS, late_pieces

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIXED_TOKENS = 30
RUN_TIMEOUT_S = 300


def cpu_sets(tmp: Path) -> list[str]:
    n_cpu = os.cpu_count() or 1
    sets = {"vllm.cpu_omp_threads_bind": f'"0-{n_cpu - 1}"', "vllm.cpu_num_reserved_cpus": "0",
            "vllm.max_num_seqs": "8", "vllm.export_cache_dir": json.dumps(str(tmp / "export"))}
    return [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]


def run_bench(args: list[str], tmp: Path) -> str:
    """`python -m bench ARGS` in its own process group; its output (asserting exit 0)."""
    log = tmp / "bench.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "bench", *args], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
        try:
            rc = proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the engine processes too, whatever happened
    text = log.read_text()
    assert rc == 0, text[-4000:]
    return text


def check_sweep(report: dict, voices: list[str], conc: list[int], n: int) -> None:
    for key in ("machine", "date", "commit", "command", "facts", "model_dir", "settings"):
        assert key in report, key
    assert report["machine"]["cpu"] and report["command"].startswith("python -m bench sweep")
    assert [(lv["voice"], lv["concurrency"]) for lv in report["levels"]] == [(v, c) for v in voices for c in conc]
    expected_audio_s = FIXED_TOKENS / TOKEN_RATE_HZ  # one segment per text
    for lv in report["levels"]:
        assert set(LEVEL_FIELDS) <= set(lv), set(LEVEL_FIELDS) - set(lv)
        assert lv["n"] == n == len(lv["requests"]) and lv["errors"] == 0, lv["error_examples"]
        assert 0 < lv["ttfa_p50_ms"] <= lv["ttfa_p95_ms"] <= lv["ttfa_max_ms"]
        assert 0 < lv["rtf_p50"] <= lv["rtf_p95"]
        assert lv["audio_s_per_s"] > 0 and lv["tokens_per_s"] > 0 and lv["stalls"] >= 0 and lv["max_late_ms"] >= 0
        assert lv["gpu_mem_gb"] is None and lv["rss_gb"] > 0.1  # CPU: no device; app + engine RSS
        for r in lv["requests"]:
            assert abs(r["audio_s"] - expected_audio_s) <= 1 / TOKEN_RATE_HZ, r  # within one token
            # wall_s and ttfa_ms are both rounded to 0.1 ms: equal when the first audio came with the last
            assert r["n_tokens"] == FIXED_TOKENS and round(r["wall_s"] * 1e3, 1) >= r["ttfa_ms"] > 0
            assert (r["frontend_s"] is not None) == (lv["voice"] == "new")
        # warm-up requests come first and are not counted: every level's indices follow the last level's
    indices = [r["index"] for lv in report["levels"] for r in lv["requests"]]
    assert len(set(indices)) == len(indices)


def test_late_pieces_definition():
    # playback starts with the first piece at 0.1 s; 1 s pieces
    assert late_pieces([]) == (0, 0.0)
    on_time = [(0.1, 24_000), (1.05, 24_000), (2.1, 24_000)]  # the third arrives exactly as the second ends
    assert late_pieces(on_time) == (0, 0.0)
    stalls, worst_ms = late_pieces([(0.1, 24_000), (1.3, 12_000), (1.5, 24_000), (2.4, 2_400)])
    assert stalls == 1 and worst_ms == pytest.approx(200.0)  # piece 2 is due at 1.1 s; the rest are in time


def test_late_pieces_per_level():
    """A level's late pieces: summed, and as a share of the pieces that can be late (every piece after a
    request's first), for the issue 26 goal "late pieces <= 1 %"."""
    from bench.report import result_from_arrivals, summarize_level

    late = result_from_arrivals(0, [(0.1, 24_000), (1.3, 12_000), (1.5, 24_000), (2.4, 2_400)], 2.5)
    on_time = result_from_arrivals(1, [(0.1, 24_000), (1.05, 24_000), (2.1, 24_000)], 2.2)
    level = summarize_level("saved", 2, [late, on_time], 2.5, {})
    assert level["stalls"] == 1 and level["late_pct"] == pytest.approx(100 / 5, abs=0.01)  # 1 of 3 + 2 pieces
    assert level["streams_stalled"] == 1 and level["max_late_ms"] == pytest.approx(200.0)
    assert summarize_level("saved", 1, [on_time], 2.2, {})["late_pct"] == 0.0
    # continuity: the worst gap of each request at most 100 ms (the 200 ms one fails it, a 60 ms one passes)
    assert level["continuity_pct"] == 50.0
    slight = result_from_arrivals(2, [(0.1, 24_000), (1.16, 24_000)], 2.2)
    assert summarize_level("saved", 2, [slight, on_time], 2.2, {})["continuity_pct"] == 100.0


def test_capacity_is_the_most_streams_with_no_late_piece():
    from bench.report import capacity

    def lv(voice, c, stalls, errors=0):
        return {"voice": voice, "concurrency": c, "stalls": stalls, "errors": errors, "n": 2 * c}

    levels = [lv("saved", 16, 0), lv("saved", 32, 0), lv("saved", 48, 3), lv("saved", 64, 0, errors=1),
              lv("new", 16, 2)]
    assert capacity(levels) == {"saved": 32, "new": None}


def test_level_reports_the_first_audio_path_and_lm_pace():
    """Per level: the LM's ms per token inside the pipeline, time to first token, first hop all in and the
    first flow call, medians of the in-process requests' RequestStats (None over HTTP)."""
    from bench.report import RequestResult, summarize_level

    rows = [RequestResult(index=i, ok=True, ttfa_ms=200.0 + i, wall_s=2.0, audio_s=4.0, first_token_ms=40.0 + i,
                          first_hop_ms=100.0 + i, first_flow_ms=80.0 + i, lm_ms_per_token=1.0 + i)
            for i in range(3)]
    lv = summarize_level("saved", 3, rows, wall_s=2.5, mem={})
    assert (lv["lm_ms_per_token_p50"], lv["first_token_p50_ms"], lv["first_hop_p50_ms"],
            lv["first_flow_p50_ms"]) == (2.0, 41.0, 101.0, 81.0)
    over_http = summarize_level("saved", 1, [RequestResult(index=0, ok=True, ttfa_ms=1.0, wall_s=1.0)], 1.0, {})
    assert over_http["lm_ms_per_token_p50"] is None and over_http["first_hop_p50_ms"] is None
    assert over_http["first_wait_p50_ms"] is None and over_http["first_handoff_p50_ms"] is None


def test_the_first_audio_path_adds_up_to_ttfa():
    """first hop + wait for a worker + flow call + HiFT + hand-off = the server's TTFA, per request."""
    from bench.report import RequestResult, summarize_level

    rows = [RequestResult(index=i, ok=True, ttfa_ms=300.0, wall_s=2.0, audio_s=4.0, server_ttfa_ms=290.0 + i,
                          first_hop_ms=100.0, first_flow_ms=80.0 + i, first_hift_ms=10.0, first_wave_ms=250.0 + i)
            for i in range(3)]
    lv = summarize_level("saved", 3, rows, wall_s=2.5, mem={})
    assert (lv["first_wait_p50_ms"], lv["first_hift_p50_ms"], lv["first_handoff_p50_ms"]) == (60.0, 10.0, 40.0)
    for r, row in zip(rows, lv["requests"], strict=True):
        assert (r.first_hop_ms + row["first_wait_ms"] + r.first_flow_ms + r.first_hift_ms + row["first_handoff_ms"]
                == r.server_ttfa_ms)


def test_module_imports_stay_light():
    """The H200 has torch, numpy and vLLM's deps only: importing the tool pulls none of these in."""
    code = ("import sys, bench, bench.targets, bench.memory; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'gradio', 'httpx', 'matplotlib', 'soundfile', 'onnxruntime', 'wetext', 'vllm'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.slow
def test_sweep_in_process(tiny_model_dir, tmp_path):
    from app.model.frontend import VoiceFeatures
    from app.service.voices import VoiceStore

    g = torch.Generator().manual_seed(0)  # a saved voice made earlier (a VoiceStore pair), as on the H200
    VoiceStore(tmp_path / "voices").save("bench", VoiceFeatures(
        prompt_text="hello there", prompt_text_ids=torch.arange(5, dtype=torch.int32),
        speech_tokens=torch.randint(0, 6561, (1, 50), generator=g, dtype=torch.int32),
        speech_mel=torch.randn(1, 100, 80, generator=g), embedding=torch.randn(1, 192, generator=g)))
    out, png = tmp_path / "report.json", tmp_path / "report.png"
    run_bench(["sweep", "--model-dir", str(tiny_model_dir), *cpu_sets(tmp_path), "--set", "model.text_frontend=false",
               "--conc", "1,2", "--requests", "2", "--fixed-tokens", str(FIXED_TOKENS), "--warmup", "1",
               "--voice", "saved,new", "--voice-npz", str(tmp_path / "voices" / "bench.json"),
               "--out", str(out), "--png", str(png)], tmp_path)
    report = json.loads(out.read_text())
    assert report["mode"] == "in-process" and report["facts"]["backend"] == "vllm"
    check_sweep(report, ["saved", "new"], [1, 2], 2)
    for lv in report["levels"]:
        assert lv["lm_p50_s"] > 0 and lv["flow_p50_s"] > 0 and lv["hift_p50_s"] > 0  # RequestStats stages
        # the levers' effect (issue 37 item 6): the flow's achieved FLOP rate and padding, its calls, counted
        # over this level only (the engine's flow_work facts before and after it)
        assert lv["flow_tflops"] > 0 and 0 <= lv["padding_waste"] < 1 and lv["flow_calls"] > 0
        assert lv["first_wait_p50_ms"] is not None
        for r in lv["requests"]:
            assert r["ttfa_ms"] >= r["server_ttfa_ms"] > 0  # the service's clock starts after the frontend
    assert png.read_bytes()[:8] == PNG_MAGIC
    from bench.__main__ import main

    assert main(["plot", str(out), "--png", str(tmp_path / "again.png")]) == 0  # re-plot from the JSON
    assert (tmp_path / "again.png").read_bytes()[:8] == PNG_MAGIC


def _server_pid(port: int) -> int | None:
    import psutil

    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "app.py" in cmd and str(port) in cmd:
            return p.pid
    return None


def _voice_ids(base: str) -> list[str]:
    return sorted(v["id"] for v in httpx.get(base + "/v1/voices", timeout=10).json()["data"])


@pytest.mark.slow
def test_sweep_over_http(studio_queue, tmp_path):
    """Against the shared server with 2 running (conftest.py's studio_queue; at most 2 requests at once here, so
    its queue of 1 never matters): a server start saved; other tests' voices may be there, the bench's are not."""
    base, _ = studio_queue
    voices_before = _voice_ids(base)
    out, png = tmp_path / "report.json", tmp_path / "report.png"
    pid = _server_pid(int(base.rsplit(":", 1)[1]))
    run_bench(["sweep", "--url", base, "--conc", "1,2", "--requests", "2", "--fixed-tokens", str(FIXED_TOKENS),
               "--warmup", "1", "--voice", "saved,new", "--server-pid", str(pid), "--out", str(out),
               "--png", str(png)], tmp_path)
    assert _voice_ids(base) == voices_before  # its voices are deleted
    report = json.loads(out.read_text())
    assert report["mode"] == "url" and report["url"] == base
    check_sweep(report, ["saved", "new"], [1, 2], 2)
    for lv in report["levels"]:
        for r in lv["requests"]:
            assert r["ttfa_ms"] >= r["server_ttfa_ms"] > 0 and r["queue_ms"] >= 0  # X-TTFA-Ms, X-Queue-Ms
    assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_memory_experiment_on_cpu(tiny_model_dir, tmp_path):
    out, png = tmp_path / "mem.json", tmp_path / "mem.png"
    text = run_bench(["memory", "--model-dir", str(tiny_model_dir), *cpu_sets(tmp_path), "--max-model-len", "1024",
                      "--cpu-kv-gib", "1,2", "--out", str(out), "--png", str(png)], tmp_path)
    report = json.loads(out.read_text())
    assert report["knob"] == "vllm.cpu_kvcache_space_gib" and not report["gpu"] and "max_full_len_requests" in text
    small, big = report["rows"]
    assert (small["knob_value"], big["knob_value"]) == (1, 2) and not small.get("error") and not big.get("error")
    assert 0 < small["kv_cache_tokens"] < big["kv_cache_tokens"]  # capacity grows with the KV space
    for row in (small, big):
        assert row["max_full_len_requests"] == row["kv_cache_tokens"] // 1024
        assert row["rss_gb"] > 0 and row["engine_start_s"] > 0 and row["device_used_gb"] is None
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_aligner_cost_on_cpu(tmp_path):
    """`python -m bench aligner` times WhisperAligner.align on the example recordings (the tiny Whisper here; the
    turbo-sized one is the same code): a row per recording, its median time, and why a sentence was not aligned."""
    out = tmp_path / "aligner.json"
    text = run_bench(["aligner", "--size", "tiny", "--device", "cpu", "--repeats", "2", "--out", str(out)], tmp_path)
    report = json.loads(out.read_text())
    assert report["bench"] == "aligner" and "ms_per_audio_s" in text
    en, zh = report["rows"]
    assert (en["recording"], zh["recording"]) == ("espeak-en", "espeak-zh") and zh["audio_s"] == 7.47
    assert zh["note"] == "" and zh["words"] == 16 and zh["ms_per_sentence"] > 0  # aligned: the cost is measured
    assert "more than the decoder's 60" in en["note"]  # the tiny decoder's places: too long, said, not timed
    assert report["facts"]["dtype"] == "float32" and report["facts"]["parameters"] > 0
