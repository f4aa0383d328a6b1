"""The command-line tools run the whole chain on a generated tiny model (real subprocesses)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import soundfile as sf
import torch

from app.config import load_config
from app.model.flow_calls import FlowPrompt
from app.model.token2wav import Token2WavStream

EN_PROMPT = "The quick brown fox jumps over the lazy dog near the quiet river bank."


def scheduled_chunks(n_prompt: int, n_tokens: int, stream: bool) -> int:
    """Chunks the hop schedule gives `n_tokens` speech tokens after a prompt of `n_prompt` (the first
    hop carries the alignment pad, -n_prompt % 25, so the count depends on the sampled lengths)."""
    s = load_config().streaming  # the CLI runs the default config; the tiny model's flow has chunk 25, look-ahead 3
    prompt = FlowPrompt(torch.zeros(1, n_prompt), torch.zeros(1, 2 * n_prompt, 80), torch.zeros(1, 192))
    t2w, n = Token2WavStream(None, None, prompt, s, stream=stream), 0
    while (plan := t2w.next_plan(n_tokens, lm_finished=True)) is not None:
        t2w.advance(plan)
        n += 1
    return n


def test_scheduled_chunks_follow_the_official_schedule():
    # 110 prompt tokens: pad 15, so the first hop is 40 tokens + 3 of look-ahead
    assert [scheduled_chunks(110, n, True) for n in (42, 43, 92, 93, 193)] == [1, 2, 2, 3, 4]
    assert scheduled_chunks(100, 28, True) == 2 and scheduled_chunks(100, 27, True) == 1
    assert scheduled_chunks(110, 500, False) == 1


@pytest.fixture(scope="module")
def cli_runs(tiny_model_dir, tmp_path_factory, request) -> Iterator[dict[bool, tuple[subprocess.Popen, Path, Path]]]:
    """{stream: (process, out.wav, its log folder)}: both runs of the CLI started at once. Each is ~55 s of one
    process importing, loading and starting its engine, mostly one core at a time, so on 2 cores the two
    overlap instead of queueing; each is still its own process with its own engine (killed in `finally`)."""
    tmp = tmp_path_factory.mktemp("cli")
    runs: dict[bool, tuple[subprocess.Popen, Path, Path]] = {}
    selected = {item.callspec.params["stream"] for item in request.session.items  # only the cases this run has
                if getattr(item, "originalname", None) == "test_synthesize_cli" and item.module is request.module}
    try:
        for stream in sorted(selected, reverse=True):
            out, logs = tmp / f"out-{stream}.wav", tmp / f"logs-{stream}"
            logs.mkdir()
            cmd = [sys.executable, "-m", "app.tools.synthesize", "--model-dir", str(tiny_model_dir),
                   "--text", "Hello there, how are you today?", "--prompt-wav", "assets/prompt_en.wav",
                   "--prompt-text", EN_PROMPT, "--out", str(out), "--seed", "7", "--device", "cpu"]
            if stream:
                cmd.append("--stream")
            with (logs / "stdout").open("w") as stdout, (logs / "stderr").open("w") as stderr:  # files: no pipe fills
                runs[stream] = (subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True, start_new_session=True),
                                out, logs)
        yield runs
    finally:
        for proc, _, _ in runs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its engine processes too, whatever happened
            proc.wait()


@pytest.mark.parametrize("stream", [True, False])
def test_synthesize_cli(cli_runs, stream):
    proc, out, logs = cli_runs[stream]
    returncode = proc.wait(timeout=300)
    stdout, stderr = (logs / "stdout").read_text(), (logs / "stderr").read_text()
    assert returncode == 0, stderr[-2000:]
    report = json.loads(stdout.strip().splitlines()[-1])
    audio, sr = sf.read(out, dtype="int16")
    assert sr == 24000 and audio.ndim == 1
    assert audio.shape[0] == round(report["audio_s"] * 24000) > 0
    assert sum(report["chunk_samples"]) == audio.shape[0]
    assert len(report["chunk_samples"]) == scheduled_chunks(report["prompt_tokens"], report["n_tokens"], stream)


def test_synthesize_cli_reports_bad_model_dir(tmp_path):
    res = subprocess.run([sys.executable, "-m", "app.tools.synthesize", "--model-dir", str(tmp_path / "nope"),
                          "--text", "hi", "--prompt-wav", "assets/prompt_en.wav", "--out", str(tmp_path / "o.wav")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert "does not exist" in res.stderr and "Traceback" not in res.stderr


def test_make_model_refuses_to_overwrite(tiny_model_dir):
    res = subprocess.run([sys.executable, "-m", "app.tools.make_model", str(tiny_model_dir), "--size", "tiny"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "--force" in res.stderr
