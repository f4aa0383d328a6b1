"""How this process (flow + HiFT) and vLLM's engine process (the speech LM) share one GPU
(`[engine] gpu_sharing`).

"time-sliced" (`off`, and every fallback): two CUDA contexts, whose kernels the GPU time-slices; a
first chunk's flow call then runs ~1.7x its time alone while the LM decodes (docs/performance.md).
"mps": a CUDA MPS control daemon of our own (its pipe and log folders private to this process, so
no other program on the machine is affected) is started before this process first touches CUDA, and
its folders are put in this process's environment, which vLLM's engine process inherits: both become
clients of one MPS server and their kernels run side by side (on an H200: one stream's first audio
381 -> 329 ms). An operator's daemon (CUDA_MPS_PIPE_DIRECTORY already set) is used as it is.

Fallbacks, each with one log line and the reason in `/health`'s facts: no GPU, the daemon's program
(nvidia-cuda-mps-control, shipped with the NVIDIA driver's utilities) missing, as in most containers
and on Hugging Face Spaces, or the daemon refusing to start. `close()` stops a daemon we started.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MPS_CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
START_TIMEOUT_S = 10.0  # `nvidia-cuda-mps-control -d` forks the daemon and returns at once


@dataclass
class GpuSharing:
    """The sharing in effect: `mode` "mps" or "time-sliced", and why."""

    mode: str
    reason: str
    folder: Path | None = None  # the private pipe/log folder of a daemon we started (removed by close)

    def facts(self) -> dict[str, Any]:
        return {"mode": self.mode, "reason": self.reason, "own_daemon": self.folder is not None}

    def close(self) -> None:
        """Asks the daemon we started to quit (idempotent; an operator's daemon is left running). The daemon
        waits for its clients, this process among them, so a detached shell sends "quit" and removes the
        folder once the daemon has gone; this process does not wait for it."""
        folder, self.folder = self.folder, None
        if folder is None:
            return
        env = daemon_env(folder)
        binary = shutil.which(MPS_CONTROL)
        try:
            if binary is None:
                shutil.rmtree(folder, ignore_errors=True)
            else:
                subprocess.Popen(["sh", "-c", 'echo quit | "$0"; rm -rf "$1"', binary, str(folder)],
                                 env=os.environ | env, start_new_session=True, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError as e:
            log.warning("the CUDA MPS daemon was not asked to stop (%s); it stays idle until the machine restarts", e)
        finally:
            for key, value in env.items():
                if os.environ.get(key) == value:
                    del os.environ[key]


def daemon_env(folder: Path) -> dict[str, str]:
    """The environment that makes CUDA join the daemon whose pipe and log folders are in `folder`."""
    return {PIPE_ENV: str(folder / "pipe"), LOG_ENV: str(folder / "log")}


def _time_sliced(reason: str, *, warn: bool) -> GpuSharing:
    if warn:
        log.warning("engine.gpu_sharing = \"mps\": %s; the LM and token->wave processes share the GPU "
                    "time-sliced", reason)
    return GpuSharing("time-sliced", reason)


def start_sharing(mode: str, *, gpu: bool) -> GpuSharing:
    """`mode` ("off" | "mps") on a machine with (`gpu`) or without a GPU. Call before this process's
    first CUDA call (CUDA joins an MPS server when it initialises); never raises."""
    if mode == "off":
        return GpuSharing("time-sliced", "engine.gpu_sharing = \"off\"")
    if not gpu:
        return _time_sliced("no GPU", warn=False)
    if os.environ.get(PIPE_ENV):
        return GpuSharing("mps", f"the MPS daemon at {PIPE_ENV}={os.environ[PIPE_ENV]}")
    binary = shutil.which(MPS_CONTROL)
    if binary is None:
        return _time_sliced(f"{MPS_CONTROL} is not installed here", warn=True)
    folder = Path(tempfile.mkdtemp(prefix="cosyvoice-mps-"))
    env = daemon_env(folder)
    for path in env.values():
        Path(path).mkdir()
    try:
        done = subprocess.run([binary, "-d"], env=os.environ | env, capture_output=True, timeout=START_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        done = subprocess.CompletedProcess([binary], 1, b"", str(e).encode())
    if done.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        why = (done.stderr or done.stdout).decode(errors="replace").strip() or f"exit code {done.returncode}"
        return _time_sliced(f"the MPS daemon did not start: {why}", warn=True)
    os.environ.update(env)  # this process and vLLM's engine process (it inherits the environment) join it
    log.info("GPU sharing: a CUDA MPS daemon of this process (%s)", folder)
    return GpuSharing("mps", "a CUDA MPS daemon started by this process", folder=folder)
