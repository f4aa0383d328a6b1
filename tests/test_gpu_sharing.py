"""`[engine] gpu_sharing` (app/engine/gpu_sharing.py): "off", and "mps" with its fallbacks (no GPU, the
daemon's program missing, the daemon refusing to start), each with its reason in the facts and one log
line where the user asked for MPS. The daemon's program ships with NVIDIA's driver, which this machine
has not: the tests of its start and stop put a stand-in script of that name on PATH that records how it
was called (arguments, the pipe folder it was given, what came on stdin); the service test runs the
real start-up on the CPU."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.config import CONFIG_DIR, ConfigError, load_config
from app.engine.gpu_sharing import LOG_ENV, MPS_CONTROL, PIPE_ENV, start_sharing
from app.model.loader import cuda_available, resolve_device

STANDIN = """#!/bin/sh
# stands in for the NVIDIA MPS control program: records its call, then answers like it
echo "call $* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> "{record}"
if [ "$1" = "-d" ]; then
  [ -n "{refuse}" ] && {{ echo "{refuse}" >&2; exit 1; }}
  exit 0
fi
while read -r line; do echo "stdin $line" >> "{record}"; done
"""


@pytest.fixture()
def no_mps_env(monkeypatch):
    for key in (PIPE_ENV, LOG_ENV):
        monkeypatch.delenv(key, raising=False)


def standin(tmp_path: Path, monkeypatch, refuse: str = "") -> Path:
    """A `nvidia-cuda-mps-control` stand-in first on PATH; returns the file it records its calls in."""
    bin_dir, record = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    prog = bin_dir / MPS_CONTROL
    prog.write_text(STANDIN.format(record=record, refuse=refuse))
    prog.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return record


def wait_for(check, timeout_s: float = 20.0) -> bool:
    """True once `check()` holds (a detached shell of `close` finishes on its own time), False after timeout."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.05)
    return check()


def test_off_and_no_gpu_stay_time_sliced_quietly(no_mps_env, caplog):
    with caplog.at_level(logging.WARNING, logger="app.engine.gpu_sharing"):
        off = start_sharing("off", gpu=True)
        cpu = start_sharing("mps", gpu=False)
    assert (off.mode, cpu.mode) == ("time-sliced", "time-sliced")
    assert "off" in off.reason and cpu.reason == "no GPU"
    assert not caplog.records and PIPE_ENV not in os.environ
    off.close()
    cpu.close()


def test_mps_without_the_daemon_program_falls_back_with_one_log_line(no_mps_env, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH without nvidia-cuda-mps-control
    with caplog.at_level(logging.WARNING, logger="app.engine.gpu_sharing"):
        s = start_sharing("mps", gpu=True)
    assert s.mode == "time-sliced" and MPS_CONTROL in s.reason
    assert s.facts() == {"mode": "time-sliced", "reason": s.reason, "own_daemon": False}
    assert len(caplog.records) == 1 and "time-sliced" in caplog.records[0].getMessage()
    assert PIPE_ENV not in os.environ


def test_mps_starts_a_private_daemon_that_children_join_and_close_stops_it(no_mps_env, monkeypatch, tmp_path):
    record = standin(tmp_path, monkeypatch)
    s = start_sharing("mps", gpu=True)
    try:
        assert s.mode == "mps" and s.facts()["own_daemon"]
        pipe, logs = os.environ[PIPE_ENV], os.environ[LOG_ENV]
        assert Path(pipe).is_dir() and Path(logs).is_dir() and Path(pipe).parent == s.folder
        assert record.read_text().splitlines() == [f"call -d pipe={pipe} log={logs}"]  # started with its folders
        # a child process (as vLLM's engine process is) inherits the folders, so it joins the same daemon
        child = subprocess.run([sys.executable, "-c", f"import os; print(os.environ['{PIPE_ENV}'])"],
                               capture_output=True, text=True, check=True)
        assert child.stdout.strip() == pipe
        folder = s.folder
    finally:
        s.close()
    assert PIPE_ENV not in os.environ and LOG_ENV not in os.environ
    assert wait_for(lambda: not folder.exists())  # removed once the daemon was told to quit
    calls = record.read_text().splitlines()
    assert calls[1:] == [f"call  pipe={pipe} log={logs}", "stdin quit"]  # "quit" sent to the same daemon
    s.close()  # a second close does nothing
    assert len(record.read_text().splitlines()) == 3


def test_a_daemon_that_does_not_start_falls_back_and_leaves_nothing(no_mps_env, monkeypatch, tmp_path, caplog):
    standin(tmp_path, monkeypatch, refuse="An instance of this daemon is already running")
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("cosyvoice-mps-*"))
    with caplog.at_level(logging.WARNING, logger="app.engine.gpu_sharing"):
        s = start_sharing("mps", gpu=True)
    assert s.mode == "time-sliced" and "already running" in s.reason
    assert len(caplog.records) == 1 and PIPE_ENV not in os.environ
    assert set(Path(os.environ.get("TMPDIR", "/tmp")).glob("cosyvoice-mps-*")) == before  # its folder went


def test_an_operators_daemon_is_used_and_left_running(monkeypatch, tmp_path):
    monkeypatch.setenv(PIPE_ENV, str(tmp_path))
    record = standin(tmp_path, monkeypatch)
    s = start_sharing("mps", gpu=True)
    assert s.mode == "mps" and not s.facts()["own_daemon"] and str(tmp_path) in s.reason
    s.close()
    assert os.environ[PIPE_ENV] == str(tmp_path) and not record.exists()  # never started, never stopped


def test_the_setting_is_checked_and_cuda_is_asked_without_initialising_it():
    assert load_config(None, {}).engine.gpu_sharing == "off"
    assert load_config(None, {"engine.gpu_sharing": "mps"}).engine.gpu_sharing == "mps"
    with pytest.raises(ConfigError, match="gpu_sharing"):
        load_config(None, {"engine.gpu_sharing": "shared"})
    import torch

    NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"  # torch's switch for an NVML-based check: left as it was
    had = os.environ.get(NVML_CHECK)
    assert cuda_available() == torch.cuda.is_available() and os.environ.get(NVML_CHECK) == had  # env restored
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert not torch.cuda.is_initialized()


def test_the_service_reports_its_sharing_and_falls_back_on_the_cpu(tiny_model_dir, tmp_path, no_mps_env):
    from app.engine.service import StudioService

    cfg = load_config(CONFIG_DIR / "cpu.toml", {"model.dir": str(tiny_model_dir), "engine.backend": "torch",
                                               "engine.gpu_sharing": "mps", "server.voices_dir": str(tmp_path)})
    service = StudioService(cfg)

    async def scenario() -> dict:
        await service.start()
        try:
            assert service.ready, service.status
            return service.facts()
        finally:
            await service.aclose()

    facts = asyncio.run(scenario())
    assert facts["gpu_sharing"] == {"mode": "time-sliced", "reason": "no GPU", "own_daemon": False}
