"""Starting `python app.py` for end-to-end tests: a tiny model, the real vLLM CPU engine, a free port.

    with run_studio(model_dir, tmp, {"server.concurrency_limit": "2"}) as (base_url, tmp):
        ...

Each value of `sets` is TOML (strings quoted). The server runs in its own process group and is
stopped with SIGTERM (uvicorn's lifespan closes the service and the engine), then killed if needed.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 400  # several servers starting at once on 2 cores took 125-250 s
EXAMPLE = json.loads((REPO / "assets" / "examples.json").read_text(encoding="utf-8"))["voices"][0]
EXAMPLE_WAV, EXAMPLE_TRANSCRIPT = REPO / "assets" / EXAMPLE["audio"], EXAMPLE["transcript"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def studio_command(model_dir: Path, tmp: Path, port: int, sets: dict[str, str] | None = None,
                   prefix: list[str] | None = None) -> list[str]:
    """`python app.py ...` on the CPU config with test-sized engine settings, `sets` applied last;
    `prefix` goes in front (e.g. `taskset -c 0`)."""
    n_cpu = os.cpu_count() or 1
    base = {"vllm.cpu_omp_threads_bind": f'"0-{n_cpu - 1}"', "vllm.cpu_num_reserved_cpus": "0",
            "vllm.cpu_kvcache_space_gib": "1", "vllm.max_num_seqs": "8", "vllm.dtype": '"float32"',
            "vllm.export_cache_dir": json.dumps(str(tmp / "export")),
            "server.voices_dir": json.dumps(str(tmp / "voices"))}
    cmd = [*(prefix or []), sys.executable, "app.py", "--config", "configs/cpu.toml", "--model-dir", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port)]
    for k, v in {**base, **(sets or {})}.items():
        cmd += ["--set", f"{k}={v}"]
    return cmd


@contextlib.contextmanager
def run_studio(model_dir: Path, tmp: Path, sets: dict[str, str] | None = None,
               env: dict[str, str] | None = None, prefix: list[str] | None = None) -> Iterator[tuple[str, Path]]:
    """Yields (base_url, tmp) once /health says ready; the log is tmp/server.log, Gradio's upload
    folder tmp/gradio."""
    port = free_port()
    inherited = {k: v for k, v in os.environ.items() if k not in ("COSYVOICE_API_KEY", "COSYVOICE_AUTH")}  # sets decide
    full_env = {**inherited, "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1",
                "GRADIO_TEMP_DIR": str(tmp / "gradio"), "PYTHONUNBUFFERED": "1", **(env or {})}
    log_path = tmp / "server.log"
    base = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:
        proc = subprocess.Popen(studio_command(model_dir, tmp, port, sets, prefix), cwd=REPO, env=full_env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                assert proc.poll() is None, f"server exited:\n{log_path.read_text()[-3000:]}"
                try:
                    health = httpx.get(f"{base}/health", timeout=2).json()
                    if health["ready"]:
                        break
                    assert not health.get("error"), health["error"]  # (an admin's view only)
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"not ready in time:\n{log_path.read_text()[-3000:]}"
                time.sleep(0.5)
            yield base, tmp
        finally:
            stop_server(proc)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, 30 s for a clean shutdown, then SIGKILL to the whole session (the vLLM engine too)."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        proc.wait()


def kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid` (a server started with start_new_session=True). Not only its
    process group: Ray puts each worker in a group of its own, and a replica's vLLM engine in that group
    outlived a killed cluster (its raylet, which would reap it, died with the launcher's group)."""
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            if os.getsid(p.pid) == sid:
                p.kill()


def save_voice(base: str, name: str, transcript: str = EXAMPLE_TRANSCRIPT) -> dict:
    """POST /v1/voices with the example reference (assets/, multipart) under `name`; the voice's JSON."""
    r = httpx.post(f"{base}/v1/voices", files={"audio": ("ref.wav", EXAMPLE_WAV.read_bytes(), "audio/wav")},
                   data={"transcript": transcript, "name": name}, timeout=60)
    assert r.status_code == 201, r.text
    return r.json()


def fill_take(page, *, wav: Path = EXAMPLE_WAV, transcript: str = EXAMPLE_TRANSCRIPT, text: str | None = None,
              seed: int | None = None) -> None:
    """On the studio page (a Playwright page): upload the reference clip `wav` (waits until the page shows
    it), type its transcript, and the text and seed of a take when given."""
    page.locator("#prompt_audio input[type=file]").set_input_files(str(wav))
    page.wait_for_selector("#prompt_audio audio, #prompt_audio [data-testid='waveform-prompt_audio']",
                           state="attached", timeout=30_000)
    page.locator("#prompt_text textarea").fill(transcript)
    if text is not None:
        page.locator("#text textarea").fill(text)
    if seed is not None:
        page.locator("#seed input").fill(str(seed))
