"""`python -m bench textstream` on CPU (tiny model, real vLLM CPU engine): the text-streaming take's latencies
beside a plain request's, as the H200 runs it (bench/gpu/run.sh textstream)."""

from __future__ import annotations

import json

from test_bench import cpu_sets, run_bench

from app.audio import TOKEN_RATE_HZ
from bench.text_stream import COLUMNS, TEXT, deltas

TAIL, FIXED, WPS = 20, 40, 5.0


def test_deltas_are_the_words_with_their_spaces():
    assert "".join(deltas(TEXT)) == TEXT and len(deltas(TEXT)) == len(TEXT.split())
    assert deltas("Hi there. Bye")[1] == "there. "  # a sentence is complete with its word's delta


def test_textstream_in_process(tiny_model_dir, tmp_path):
    out = tmp_path / "textstream.json"
    log = run_bench(["textstream", "--model-dir", str(tiny_model_dir), *cpu_sets(tmp_path),
                     "--set", "model.text_frontend=false", "--conc", "1", "--requests-per-stream", "1",
                     "--warmup", "0", "--words-per-s", str(WPS), "--fixed-tokens", str(FIXED),
                     "--tail-tokens", str(TAIL), "--out", str(out)], tmp_path)
    report = json.loads(out.read_text())
    assert report["command"].startswith("python -m bench textstream") and report["facts"]["backend"] == "vllm"
    assert [(lv["kind"], lv["concurrency"]) for lv in report["levels"]] == [("streamed", 1), ("plain", 1)]
    streamed, plain = report["levels"]
    for lv in (streamed, plain):
        assert set(COLUMNS) <= set(lv) and lv["n_ok"] == 1
        assert abs(lv["audio_s"] - lv["n_tokens"] / TOKEN_RATE_HZ) <= 1 / TOKEN_RATE_HZ, lv  # within one token
        assert lv["first_audio_ms_p50"] > 0 and lv["end_after_last_ms_p50"] > 0
    # the words arrive over (n - 1) / WPS s; the first sentence is heard while the rest is still being written
    assert streamed["text_arrival_s"] >= (len(deltas(TEXT)) - 1) / WPS
    assert streamed["first_audio_ms_p50"] < streamed["text_arrival_s"] * 1e3
    # mid-text blocks of 15 speech tokens (one per 5 text tokens), then the fixed last block
    assert streamed["n_tokens"] >= TAIL + 15 and plain["n_tokens"] % FIXED == 0
    assert plain["text_arrival_s"] == 0
    assert "streamed" in log and "first_audio_ms_p50" in log  # the printed table
