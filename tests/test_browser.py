"""The studio in a real browser: `python app.py` (tiny model, configs/cpu.toml, the real vLLM CPU engine)
driven by headless Debian Chromium through Playwright.

Uploads assets/prompt_en.wav as the reference, types its transcript and a text, clicks Generate,
then waits until the streamed <audio> element is playing (its `playing` event and currentTime > 0)
and the live panels show the finished request. Saves out/studio.png.

Needs /usr/bin/chromium, ffmpeg (Gradio encodes streamed audio with it) and the `playwright`
package: `bash scripts/setup_browser.sh`. Never `playwright install` (no browser download).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--autoplay-policy=no-user-gesture-required"]
PROMPT_WAV = REPO / "assets" / "prompt_en.wav"
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog near the quiet river bank."
TEXT = "Hello from the browser test. This sentence is spoken in the reference voice."
START_TIMEOUT_S = 300  # model load + vLLM engine start + warm-up on a busy 2-core box
REQUEST_TIMEOUT_S = 180
SCREENSHOT = REPO / "out" / "studio.png"
# body rows of the latency table (a virtualised grid: header row 1 is a <tr>, body rows are divs)
TABLE_ROWS = ("[...document.querySelectorAll('#latency_table [role=row]')]"
              ".filter(r => r.getAttribute('aria-rowindex') !== '1').map(r => r.innerText.split(/\\s+/).join(' '))")

# media events do not bubble: capture them on the document, for every <audio> of the page
RECORD_AUDIO_EVENTS = """
window.__audio = [];
for (const name of ['play', 'playing', 'waiting', 'ended', 'error']) {
  document.addEventListener(name, (e) => {
    if (e.target && e.target.tagName === 'AUDIO')
      window.__audio.push({name, t: performance.now(), ct: e.target.currentTime,
                           stream: !!e.target.closest('#stream_out')});
  }, true);
}
"""


def _need(ok: bool, why: str) -> None:
    """Skip where the browser stack is missing; in CI that is a setup error, so fail instead."""
    if ok:
        return
    msg = f"{why}; run: bash scripts/setup_browser.sh"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> dict:
    """Poll /health until 200 (ready); fail early when the app exits or reports a start error."""
    deadline = time.monotonic() + timeout_s
    body: dict = {}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"app.py exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:  # 503 while loading
            body = json.loads(e.read() or b"{}")
            if body.get("error"):
                pytest.fail(f"the service failed to start: {body['error']}")
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    pytest.fail(f"not ready after {timeout_s} s (last status {body.get('status')!r}):\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def studio(tiny_model_dir, tmp_path_factory):
    """(base URL, health JSON) of `python app.py` on a free port; stopped (SIGTERM, then SIGKILL) after."""
    _need(Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing")
    _need(shutil.which("ffmpeg") is not None, "ffmpeg is missing (Gradio needs it for streamed audio)")
    try:
        import playwright  # noqa: F401
    except ImportError:
        _need(False, "the playwright package is missing")
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("studio")
    port, n_cpu = free_port(), os.cpu_count() or 1
    cmd = [sys.executable, "app.py", "--config", "configs/cpu.toml", "--model-dir", str(tiny_model_dir),
           "--host", "127.0.0.1", "--port", str(port),
           "--set", f'vllm.export_cache_dir="{tmp / "vllm"}"', "--set", f'server.voices_dir="{tmp / "voices"}"',
           "--set", "vllm.cpu_kvcache_space_gib=1", "--set", f'vllm.cpu_omp_threads_bind="0-{n_cpu - 1}"',
           "--set", "vllm.cpu_num_reserved_cpus=0", "--set", "model.download=false"]
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1",
           "GRADIO_TEMP_DIR": str(tmp / "gradio"), "PYTHONUNBUFFERED": "1"}
    log = tmp / "app.log"
    t0 = time.perf_counter()
    with log.open("w") as out:
        # its own session: the vLLM engine processes it spawns can be ended with it, and nothing else
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        health = wait_ready(url, proc, log, START_TIMEOUT_S)
        print(f"\napp ready in {time.perf_counter() - t0:.1f} s: backend {health['facts'].get('backend')}")
        yield url, health
    finally:
        proc.send_signal(signal.SIGTERM)  # uvicorn shuts down: lifespan -> service.aclose() -> engine shutdown
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_generate_plays_and_panels_update(studio):
    from playwright.sync_api import sync_playwright

    url, health = studio
    assert health["ready"] and health["facts"]["backend"] == "vllm"
    # the token->wave stage as configured; CUDA graphs exist only on a GPU
    assert health["facts"]["token2wav"] == {"workers": 1, "flow_batch": 1, "flow_cuda_graphs": None}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            console: list[str] = []
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.add_init_script(RECORD_AUDIO_EVENTS)
            page.goto(url)
            page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('ready')",
                                   timeout=60_000)
            # the panels tick before any request: no-GPU note on this machine, engine facts
            page.wait_for_function("() => document.querySelector('#engine_facts')?.innerText.includes('vllm')",
                                   timeout=30_000)

            page.locator("#prompt_audio input[type=file]").set_input_files(str(PROMPT_WAV))
            page.wait_for_selector("#prompt_audio audio, #prompt_audio [data-testid='waveform-prompt_audio']",
                                   state="attached", timeout=30_000)
            page.locator("#prompt_text textarea").fill(PROMPT_TEXT)
            page.locator("#text textarea").fill(TEXT)
            page.locator("#player").get_by_label("standard (Gradio)").check()  # this test is about Gradio's player
            t_click = page.evaluate("performance.now()")
            page.locator("#go").click()

            # the streamed output starts playing while it is generated
            page.wait_for_function("() => window.__audio.some(e => e.stream && e.name === 'playing')",
                                   timeout=REQUEST_TIMEOUT_S * 1000)
            page.wait_for_function("() => (document.querySelector('#stream_out audio')?.currentTime || 0) > 0",
                                   timeout=30_000)
            events = page.evaluate("window.__audio")
            playing = next(e for e in events if e["stream"] and e["name"] == "playing")
            print(f"browser TTFA (click -> playing): {playing['t'] - t_click:.0f} ms")

            # the request finishes: stats line, then the latency panels show it
            page.wait_for_function("() => document.querySelector('#stats')?.innerText.includes('TTFA')",
                                   timeout=REQUEST_TIMEOUT_S * 1000)
            page.wait_for_function(f"() => ({TABLE_ROWS}).some(r => r.split(' ').includes('ok'))", timeout=30_000)
            headline = page.locator("#panel_headline").inner_text()
            facts = page.locator("#engine_facts").inner_text()
            row = page.evaluate(f"() => ({TABLE_ROWS})[0]")
            print(f"headline: {headline}\nlatest row: {row}")
            assert "TTFA p50" in headline and "KV cache" in headline, headline
            assert "no GPU: showing CPU and RAM" in headline or "GPU" in headline, headline
            assert "unfinished engine requests" in facts and "ok 1" in facts, facts
            page.wait_for_timeout(1500)  # one more tick so the plots include the request
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
            errors = [c for c in console if c.startswith("error") and "ERR_NAME_NOT_RESOLVED" not in c]
            print("console errors:", errors[:5])
        finally:
            browser.close()
