"""The command-line tools run the whole chain on a generated tiny model (real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import soundfile as sf

EN_PROMPT = "The quick brown fox jumps over the lazy dog near the quiet river bank."


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
    assert (len(report["chunk_samples"]) > 1) == (stream and report["n_tokens"] > 28)


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
