"""The command-line tools run the whole chain on a generated tiny model (real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import soundfile as sf
import torch

from app.config import load_config
from app.model.token2wav import FlowPrompt, Token2WavStream

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


@pytest.mark.parametrize("stream", [True, False])
def test_synthesize_cli(tiny_model_dir, tmp_path, stream):
    out = tmp_path / "out.wav"
    cmd = [sys.executable, "-m", "app.tools.synthesize", "--model-dir", str(tiny_model_dir),
           "--text", "Hello there, how are you today?", "--prompt-wav", "assets/prompt_en.wav",
           "--prompt-text", EN_PROMPT, "--out", str(out), "--seed", "7", "--device", "cpu"]
    if stream:
        cmd.append("--stream")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
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
