"""The studio in a real browser: `python app.py` (tiny model, configs/cpu.toml, the real vLLM CPU engine)
driven by headless Debian Chromium through Playwright.

Uploads assets/prompt_en.wav as the reference, types its transcript and a text, clicks Generate,
then waits until the page's player sounds (its first samples' start, the AudioContext's clock past
it), the take's stats line and the live panels show the finished request. Saves out/studio.png.
Gradio's own streamed <audio> (the page's fallback) is tested in test_player and test_studio_ux.

Needs /usr/bin/chromium, ffmpeg (Gradio encodes streamed audio with it) and the `playwright`
package: `bash scripts/test.sh` sets them up (apt). Never `playwright install` (no browser download).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--autoplay-policy=no-user-gesture-required"]
PROMPT_WAV = REPO / "assets" / "prompt_en.wav"
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog near the quiet river bank."
TEXT = "Hello from the browser test. This sentence is spoken in the reference voice."
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
      window.__audio.push({name, t: performance.now(), ct: e.target.currentTime});
  }, true);
}
"""


# Stop pressed in the page task that first sees the low-latency take sounding, while its body is still arriving:
# Playwright's click waits for actionability over several frames, and a loaded page once took 17 s for it, time
# enough for a whole take to arrive (then it is finished, not stopped). Returns what it found: "stopped" or why not.
STOP_WHILE_MADE = """([seq]) => { const r = window.studioPlayer.last;
  if (!r || r.seq !== seq || r.t.firstSound === null) return false;
  if (r.state !== 'playing' || r.t.end !== null) return `the take had ended first (${r.state})`;
  document.querySelector('#stop').click(); return 'stopped'; }"""


def stop_while_made(page, seq: int, timeout_ms: int) -> None:
    """Press Stop once the page's take number `seq` sounds, before its body has ended (STOP_WHILE_MADE)."""
    found = page.wait_for_function(STOP_WHILE_MADE, arg=[seq], timeout=timeout_ms).json_value()
    assert found == "stopped", found


def need_browser_stack() -> None:
    """Debian's chromium, ffmpeg (Gradio streams audio through it), the playwright package and vLLM are here."""
    _need(Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing")
    _need(shutil.which("ffmpeg") is not None, "ffmpeg is missing (Gradio needs it for streamed audio)")
    try:
        import playwright  # noqa: F401
    except ImportError:
        _need(False, "the playwright package is missing")
    _need(importlib.util.find_spec("vllm") is not None, "vLLM is missing (the studio's engine)")


def ready_studio(server: tuple) -> str:
    """The base URL of a shared `python app.py` (conftest.py's studio_*), once the browser stack is here and the
    server says it is ready."""
    need_browser_stack()
    url, _ = server
    assert httpx.get(f"{url}/health", timeout=10).json()["ready"]
    return url


def _need(ok: bool, why: str) -> None:
    """Skip where the browser stack is missing; in CI that is a setup error, so fail instead."""
    if ok:
        return
    msg = f"{why}; run: bash scripts/test.sh (it installs them with apt)"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="module")
def studio(studio_bf16):
    """(base URL, health JSON) of the shared bfloat16 `python app.py` (conftest.py's studio_bf16)."""
    need_browser_stack()
    url, _ = studio_bf16
    health = httpx.get(f"{url}/health", timeout=10).json()
    print(f"\napp ready: backend {health['facts'].get('backend')}")
    return url, health


def _ok_takes(url: str) -> int:
    """Takes the server finished ok so far (its /metrics counter, the one the facts panel shows)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    line = next(ln for ln in text.splitlines() if ln.startswith('cosyvoice_requests_total{outcome="ok"}'))
    return int(float(line.split()[-1]))


@pytest.mark.slow
def test_generate_plays_and_panels_update(studio):
    from playwright.sync_api import sync_playwright

    url, health = studio
    assert health["ready"] and health["facts"]["backend"] == "vllm"
    # the token->wave stage as configured; CUDA graphs exist only on a GPU; cpu.toml re-solves
    t2w = health["facts"]["token2wav"]
    work = t2w.pop("flow_work")
    assert work["calls"] > 0 and 0 < work["frames_needed"] <= work["frames_computed"]  # the warm-up's flow calls
    calls = t2w.pop("calls")  # a CPU's calls take every due hop (not sized); their cost is learned all the same
    assert (calls["first_call_ms"], calls["max_call_ms"]) == (0, 0) and sum(calls["by_rows"].values()) > 0, calls
    assert health["facts"]["mode"] == "exact mode (fp32 flow), official schedule"  # cpu.toml keeps fp32
    assert t2w == {"workers": 1, "flow_batch": 16, "flow_path": "re-solve", "flow_cuda_graphs": None}
    ok_before = _ok_takes(url)  # the shared server may have served other files' takes
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
            # the panels tick before any request: no-GPU note on this machine, engine facts (collapsed at first)
            page.locator("#engine_facts_box .label-wrap").click()
            page.wait_for_function("() => document.querySelector('#engine_facts')?.innerText.includes('vllm')",
                                   timeout=30_000)

            page.locator("#prompt_audio input[type=file]").set_input_files(str(PROMPT_WAV))
            page.wait_for_selector("#prompt_audio audio, #prompt_audio [data-testid='waveform-prompt_audio']",
                                   state="attached", timeout=30_000)
            page.locator("#prompt_text textarea").fill(PROMPT_TEXT)
            page.locator("#text textarea").fill(TEXT)
            t_click = page.evaluate("performance.now()")
            page.locator("#go").click()

            # the page's player sounds while the take is generated (its first samples reach the output), and its
            # AudioContext's clock runs on past them
            page.wait_for_function("() => window.studioPlayer?.last?.t.firstSound != null",
                                   timeout=REQUEST_TIMEOUT_S * 1000)
            page.wait_for_function("() => window.studioPlayer.ctx.currentTime > window.studioPlayer.last.firstStartS",
                                   timeout=30_000)
            print(f"browser TTFA (click -> first sound): "
                  f"{page.evaluate('window.studioPlayer.last.t.firstSound') - t_click:.0f} ms")

            # the request finishes: stats line, then the latency panels show it
            page.wait_for_function("() => document.querySelector('#stats')?.innerText.includes('TTFA')",
                                   timeout=REQUEST_TIMEOUT_S * 1000)
            page.wait_for_function(f"() => ({TABLE_ROWS}).some(r => r.split(' ').includes('ok'))", timeout=30_000)
            # the facts panel counts this take on its next tick (the table may show it first)
            page.wait_for_function(f"() => document.querySelector('#engine_facts')?.innerText"
                                   f".includes('ok {ok_before + 1},')", timeout=30_000)
            headline = page.locator("#panel_headline").inner_text()
            facts = page.locator("#engine_facts").inner_text()
            row = page.evaluate(f"() => ({TABLE_ROWS})[0]")
            print(f"headline: {headline}\nlatest row: {row}")
            assert "TTFA p50" in headline and "KV cache" in headline, headline
            assert "no GPU: showing CPU and RAM" in headline or "GPU" in headline, headline
            assert "unfinished engine requests" in facts and f"ok {ok_before + 1}," in facts, (ok_before, facts)
            page.wait_for_timeout(1500)  # one more tick so the plots include the request
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
            errors = [c for c in console if c.startswith("error") and "ERR_NAME_NOT_RESOLVED" not in c]
            print("console errors:", errors[:5])
        finally:
            browser.close()
