"""The studio as a demanding user meets it (issue 17): fresh results, visible errors (a refused Save too), a
quiet idle tab, a fast shutdown; `python app.py` (tiny model, the real vLLM CPU engine) in headless
Debian Chromium and through real HTTP clients.

One server and one page for the browser tests (in file order: each leaves the page as the next expects).
Audio checks are exact: the page player's final WAV is the PCM the server sends.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import importlib.util
import io
import json
import os
import re
import secrets
import signal
import subprocess
import time
import wave
from pathlib import Path

import httpx
import numpy as np
import pytest
from studio import (
    EXAMPLE_TRANSCRIPT,
    EXAMPLE_WAV,
    REPO,
    fill_take,
    free_port,
    save_voice,
    studio_command,
)
from test_browser import CHROMIUM, CHROMIUM_ARGS, RECORD_AUDIO_EVENTS, _need

from app.server.openai_api import OPENAI_TTS_MODELS
from app.ui.takes import wav_name

TEXT = "Hello there, how are you today?"
LONG_TEXT = " ".join(["This long sentence keeps the model talking for quite a while."] * 12)
SEED = 11
TIMEOUT_MS = 180_000
SETS = {"vllm.dtype": '"bfloat16"', "model.download": "false",  # conftest.py's studio_bf16 runs these
        "limits.max_text_chars": "4000"}
LAST = "window.studioPlayer.last"
ERROR_BADGES = ("() => [...document.querySelectorAll('.error')].filter(e => e.offsetParent !== null && "
                "/error/i.test(e.innerText)).length")
FETCH_BASE64 = """async (url) => { const b = new Uint8Array(await (await fetch(url)).arrayBuffer()); let s = '';
  for (let i = 0; i < b.length; i += 0x8000) s += String.fromCharCode.apply(null, b.subarray(i, i + 0x8000));
  return btoa(s); }"""


def _wav_pcm(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24_000, 1, 2)
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


def server_pcm(url: str, text: str, seed: int, n_samples: int | None = None, **more) -> np.ndarray:
    """The server's take of `text` (16-bit PCM; `more`: other /studio/speech fields), or its first `n_samples`
    (the rest not made: closing the stream stops the take)."""
    body = {"text": text, "seed": seed, "prompt_audio": str(EXAMPLE_WAV), "prompt_text": EXAMPLE_TRANSCRIPT, **more}
    got = bytearray()
    with httpx.stream("POST", f"{url}/studio/speech", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for part in r.iter_bytes():
            got += part
            if n_samples is not None and len(got) >= 2 * n_samples:
                break
    return np.frombuffer(bytes(got[:len(got) // 2 * 2]), dtype="<i2")[:n_samples]  # a read may end mid-sample


@pytest.fixture(scope="module")
def studio(studio_bf16):
    """(base URL, tmp with server.log) of the shared `python app.py` on SETS (conftest.py's studio_bf16)."""
    _need(Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing")
    from conftest import SHARED_SERVERS

    assert SHARED_SERVERS["studio_bf16"] == SETS
    return studio_bf16


@pytest.fixture(scope="module")
def page(studio):
    _need(importlib.util.find_spec("playwright") is not None, "the playwright package is missing")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            pg = browser.new_page(viewport={"width": 1400, "height": 1000})
            pg.add_init_script(RECORD_AUDIO_EVENTS)
            pg.goto(studio[0])
            pg.wait_for_function("() => document.querySelector('#status')?.innerText.includes('ready')",
                                 timeout=60_000)
            pg.wait_for_function("() => window.studioPlayer && window.studioPlayer.mode !== null")
            fill_take(pg)
            yield pg
        finally:
            browser.close()


# --- without a server ----------------------------------------------------------------------------------


def test_a_take_is_named_after_its_voice_and_text():
    name = wav_name("Hello, there! How are you today, my friend?", "ux-fox")
    assert name == "ux-fox-hello-there-how-are-you-today.wav", name
    assert wav_name("你好，世界") == "你好-世界.wav" and wav_name("!!!") == "speech.wav"


def test_a_closed_request_keeps_its_stats_in_the_panels(tiny_model_dir, tmp_path):
    """The Gradio API's `synthesize` for a Chinese browser (its Accept-Language): the progress line and a refusal
    in Chinese; a job closed mid-stream (a cancelled client) is "cancelled" in its record, hence its "Recent
    requests" row, with what was measured until then. Saving a voice answers in the caller's language."""
    from types import SimpleNamespace

    import gradio as gr

    from app.config import CONFIG_DIR, load_config
    from app.service.service import StudioService
    from app.ui import handlers
    from app.ui.panels import table_frame

    cfg = load_config(CONFIG_DIR / "cpu.toml", {"model.dir": str(tiny_model_dir), "engine.backend": "torch",
                                               "server.voices_dir": str(tmp_path / "v")})
    service = StudioService(cfg)
    h = handlers.Handlers(service)
    zh_page = SimpleNamespace(headers={"accept-language": "zh-CN,zh;q=0.9"})
    args = (LONG_TEXT, {"path": str(EXAMPLE_WAV)}, EXAMPLE_TRANSCRIPT, "zero_shot", "", "", SEED, 1.0, True)

    async def main() -> tuple[list, list]:
        await service.start()
        assert service.ready, service.status
        closed = []
        async with contextlib.aclosing(h.synthesize(*args, request=zh_page)) as gen:
            async for out in gen:
                closed.append(out)
                break  # the client goes: the generator is closed mid-stream
        with pytest.raises(gr.Error) as refused:  # an empty text
            async for _ in h.synthesize("", *args[1:], request=zh_page):
                pass
        assert "文本" in refused.value.message, refused.value
        save = h.save_voice  # as the page wires it (Gradio passes the request)
        saved = [await save("ux-bob", str(EXAMPLE_WAV), EXAMPLE_TRANSCRIPT, False, zh_page),
                 await save("ux-bob", str(EXAMPLE_WAV), EXAMPLE_TRANSCRIPT, True)]  # an API client
        with pytest.raises(gr.Error) as taken:
            await save("ux-bob", str(EXAMPLE_WAV), EXAMPLE_TRANSCRIPT, False, zh_page)
        saved.append((taken.value.title, taken.value.message))
        await service.aclose()
        return closed, saved

    closed, saved = asyncio.run(main())
    assert saved[0][0].startswith("已保存声音 **ux-bob**（") and saved[1][0].startswith("Saved voice **ux-bob**"), saved
    assert saved[2] == ("名称已被使用", "同名声音已存在：勾选“覆盖同名的已保存声音”以覆盖。"), saved
    assert "流式生成中" in closed[0][2] and closed[0][0]["path"].endswith(".wav"), closed[0]  # a chunk's WAV
    (rec,) = service.metrics.recent()  # (the warm-up is not counted)
    assert (rec["outcome"], rec["stopped"]) == ("cancelled", False), rec
    assert rec["ttfa_ms"] > 0 and rec["audio_s"] > 0 and rec["n_tokens"] > 0 and rec["lm_s"] > 0, rec
    assert rec["n_samples"] == round(rec["audio_s"] * 24_000) and rec["rtf"] > 0, rec
    assert service.metrics.counters()["audio_s_total"] == 0  # only finished requests' audio counts there
    en, zh = table_frame(service.metrics.recent()), table_frame(service.metrics.recent(), "zh")
    assert list(en["outcome"]) == ["cancelled"] and list(zh["结果"]) == ["已取消"]
    row = en.iloc[0]
    assert row["TTFA ms"] == f"{rec['ttfa_ms']:.0f}" and row["audio s"] == f"{rec['audio_s']:.2f}", row
    assert all(row[c] for c in ("RTF", "LM s", "flow s", "vocoder s", "tokens/s")), row


# --- HTTP only ------------------------------------------------------------------------------------------


def test_model_names_are_checked(studio):
    url, _ = studio
    voice = save_voice(url, "ux-fox")["id"]
    r = httpx.post(f"{url}/v1/audio/speech", json={"model": "whisper-1", "input": "Hi.", "voice": voice}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "model" and err["code"] == "model_not_found", err
    for name in ("cosyvoice2", "FunAudioLLM/CosyVoice2-0.5B", *OPENAI_TTS_MODELS):
        assert name in err["message"], err
    for name in ("tts-1", "TTS-1-HD", "gpt-4o-mini-tts", "CosyVoice2"):  # the SDK's names, case-insensitive
        r = httpx.post(f"{url}/v1/audio/speech", json={"model": name, "input": "Hi.", "voice": voice,
                                                       "response_format": "pcm", "seed": 1}, timeout=120)
        assert r.status_code == 200 and r.content, (name, r.text)
    assert 'reason="unknown_model"' in httpx.get(f"{url}/metrics", timeout=10).text  # counted by reason


def test_api_page_labels_and_types(studio):
    url, _ = studio
    info = httpx.get(f"{url}/gradio_api/info", timeout=30).json()["named_endpoints"]
    params = {p["parameter_name"]: p for p in info["/synthesize"]["parameters"]}
    for p in [*info["/synthesize"]["parameters"], *info["/synthesize"]["returns"], *info["/save_voice"]["parameters"]]:
        assert isinstance(p["label"], str) and "__type__" not in p["label"], p  # no "[object Object]"
    assert params["text"]["label"] == "Text to speak"
    assert params["voice"]["python_type"]["type"] == "str", params["voice"]  # not Literal['']


def test_refused_inputs_log_one_line_without_traceback(studio):
    from gradio_client import Client, handle_file

    url, tmp = studio
    log = tmp / "server.log"
    n0 = len(log.read_text().splitlines())
    client = Client(url + "/", verbose=False)
    with pytest.raises(Exception, match="text"):
        client.predict(text="", prompt_audio=handle_file(str(EXAMPLE_WAV)), prompt_text=EXAMPLE_TRANSCRIPT,
                       mode="zero_shot", instruct_text="", voice="", seed=1, speed=1.0, stream=True,
                       api_name="/synthesize")
    new = log.read_text().splitlines()[n0:]
    assert sum("refused input" in ln for ln in new) == 1, new
    assert not any("Traceback" in ln for ln in new), new


def test_shutdown_does_not_wait_on_open_pages(tiny_model_dir, tmp_path):
    """SIGTERM with a page's heartbeat stream open: Gradio's streams end at the signal, so uvicorn does not
    wait for connections (its "Waiting for connections to close" line never comes)."""
    port, log = free_port(), tmp_path / "server.log"
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1",
           "GRADIO_TEMP_DIR": str(tmp_path / "gradio"), "PYTHONUNBUFFERED": "1"}
    with log.open("w") as f:
        proc = subprocess.Popen(studio_command(tiny_model_dir, tmp_path, port, SETS), cwd=REPO, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 400
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{base}/health", timeout=2).json()["ready"]:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.5)
        with httpx.stream("GET", f"{base}/gradio_api/heartbeat/uxsession", timeout=30) as hb:
            next(hb.iter_lines())  # the stream is open
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
            print(f"\nshutdown with an open heartbeat stream: {time.monotonic() - t0:.1f} s")
        text = log.read_text()
        assert "Waiting for connections to close" not in text and "Application shutdown complete" in text, text[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# --- in the browser -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_page_defaults(studio, page):
    # no blank first option among the saved voices; the engine-facts table is collapsed; the per-stage chart
    # slants its labels
    page.get_by_text("Saved voices", exact=True).click()  # open the accordion
    page.locator("#voice input").click()
    first = page.locator("ul[role=listbox] li").first.inner_text().strip().split("\n")[-1]  # after the ✓ mark
    assert first.startswith("(none: use the recording"), first
    page.keyboard.press("Escape")
    page.get_by_text("Saved voices", exact=True).click()
    assert not page.locator("#engine_facts").is_visible()
    config = httpx.get(f"{studio[0]}/config", timeout=30).json()
    props = {c["props"].get("elem_id"): c["props"] for c in config["components"]}
    assert props["stage_plot"]["x_label_angle"] == props["latency_plot"]["x_label_angle"] != 0


def badges_in(selector: str) -> str:
    """JS: how many "Error" badges (Gradio's status tracker over a failed event's outputs) show in `selector`
    (a tracker of an event with show_progress="hidden" is there, at opacity 0 and letting clicks through)."""
    return (f"() => [...document.querySelectorAll('{selector} .error')].filter(e => /error/i.test(e.innerText) && "
            "e.checkVisibility({opacityProperty: true, visibilityProperty: true})).length")


def wait_for_toast(page, pattern: str) -> None:
    page.wait_for_function(f"() => [...document.querySelectorAll('.toast-body')].some(t => /{pattern}/"
                           f".test(t.textContent))", timeout=30_000)


@pytest.mark.slow
def test_a_refused_save_leaves_the_saved_voice_list_usable(page):
    """A refused Save (a taken name without "Replace", no reference clip) says why in a pop-up and clears the
    voice message; no "Error" badge covers the saved-voice dropdown, which still opens and picks."""
    name = f"ux-taken-{secrets.token_hex(3)}"
    page.get_by_text("Saved voices", exact=True).click()  # open the accordion
    page.locator("#voice_name textarea").fill(name)
    page.locator("#save_voice").click()
    page.wait_for_function(f"() => (document.querySelector('#voice_msg')?.innerText || '')"
                           f".includes('Saved voice {name}')", timeout=60_000)
    page.wait_for_function(f"() => document.querySelector('#voice input').value === '{name}'", timeout=30_000)
    for refuse, pop_up in ((lambda: None, "exists already"),  # the same name again, "Replace" not ticked
                           (lambda: page.locator("#prompt_audio button[aria-label='Clear']").click(),
                            "Upload or record the reference clip to save first")):
        refuse()
        page.locator("#save_voice").click()
        wait_for_toast(page, pop_up)
        page.wait_for_timeout(500)  # the failed event's statuses are drawn by now
        assert page.evaluate(badges_in("#voice")) == 0 and page.evaluate(badges_in("#voice_msg")) == 0
        page.wait_for_function("() => !(document.querySelector('#voice_msg')?.innerText || '').includes('Saved')",
                               timeout=10_000)
        # the dropdown opens and picks: "(none ...)", then the saved voice
        for pick in ("(none: use the recording above)", name):
            page.locator("#voice input").click(timeout=5000)
            page.get_by_role("option", name=pick).click(timeout=5000)
            page.wait_for_function(f"() => document.querySelector('#voice input').value === {json.dumps(pick)}",
                                   timeout=10_000)
        for close in page.locator(".toast-close").all():
            close.click()
    page.locator("#voice input").click()  # the page as the next tests expect it: no saved voice, the clip
    page.get_by_role("option", name="(none: use the recording above)").click()
    page.get_by_text("Saved voices", exact=True).click()
    fill_take(page)


@pytest.mark.slow
def test_streaming_off_plays_the_whole_take_at_its_speed(studio, page):
    """Streaming off: the page's player asks /studio/speech for the whole take at the slider's speed, and its final
    WAV is that take, sample for sample."""
    url, _ = studio
    page.locator("#stream input[type=checkbox]").uncheck()
    try:
        page.locator("#text textarea").fill(TEXT)  # (the reference clip is the page's since the fixture)
        page.locator("#seed input").fill(str(SEED))
        page.locator("#speed input[type=number]").fill("1.25")
        page.locator("#speed input[type=number]").press("Enter")
        seq = page.evaluate(f"{LAST} ? {LAST}.seq : 0") + 1
        page.locator("#go").click()
        page.wait_for_function(f"() => {LAST} && {LAST}.seq === {seq} && {LAST}.state === 'done' && {LAST}.result",
                               timeout=TIMEOUT_MS)
        params = page.evaluate(f"{LAST}.params")
        assert (params["stream"], params["speed"]) == (False, 1.25), params
        page.wait_for_function("() => /TTFA \\d+ ms/.test(document.querySelector('#stats')?.innerText || '')",
                               timeout=30_000)
        final = _wav_pcm(base64.b64decode(page.evaluate(FETCH_BASE64, page.locator("#final_out a[download]")
                                                        .get_attribute("href"))))
        np.testing.assert_array_equal(final, server_pcm(url, TEXT, SEED, stream=False, speed=1.25))
    finally:
        page.locator("#stream input[type=checkbox]").check()  # streamed again, for the next tests


def near_generate(page, selector: str) -> bool:
    go, box = page.locator("#go").bounding_box(), page.locator(selector).bounding_box()
    return box is not None and abs(box["y"] - (go["y"] + go["height"])) < 150


@pytest.mark.slow
def test_default_player_shows_controls_busy_state_errors_and_the_seed(studio, page):
    url, _ = studio
    # an error: next to Generate and as a pop-up, and not busy afterwards
    page.locator("#text textarea").fill("")
    page.locator("#go").click()
    # the pop-up is this player's own
    page.wait_for_function("() => { const t = document.querySelector('#studio_toast');"
                           " return t && !t.hidden && /text/i.test(t.innerText); }", timeout=30_000)
    assert re.search("text", page.locator("#studio_error").inner_text(), re.I)
    assert near_generate(page, "#studio_error")
    assert page.evaluate("document.body.dataset.studioBusy") is None
    # a run: busy at once, its controls shown, the seed written back
    page.locator("#text textarea").fill(TEXT)
    page.locator("#seed input").fill("-1")
    seq = page.evaluate(f"{LAST} ? {LAST}.seq : 0") + 1
    page.evaluate("""() => { window.__busy = [];  // every change of the page's busy state
      new MutationObserver(() => window.__busy.push(document.body.dataset.studioBusy || null))
        .observe(document.body, {attributes: true, attributeFilter: ['data-studio-busy']}); }""")
    page.locator("#go").click()
    page.wait_for_function("() => window.__busy.includes('1')", timeout=10_000)
    assert not page.locator("#studio_error").inner_text().strip()  # the old error went
    # the seed the server used is in the box as the take starts (its headers came), not only at its end
    page.wait_for_function(f"() => {LAST} && {LAST}.seq === {seq} && {LAST}.state === 'playing' && "
                           f"{LAST}.seed !== null && document.querySelector('#seed input').value === {LAST}.seed",
                           timeout=TIMEOUT_MS)
    assert page.locator("#player_controls").is_visible()
    page.wait_for_function(f"() => {LAST} && {LAST}.seq === {seq} && {LAST}.state === 'done' && {LAST}.result",
                           timeout=TIMEOUT_MS)
    run = page.evaluate(f"() => ({{seed: {LAST}.seed, samples: {LAST}.samples}})")
    assert page.evaluate("document.body.dataset.studioBusy") is None
    assert page.locator("#seed input").input_value() == run["seed"] != "-1"
    assert page.locator("#player_time").inner_text().split(" / ")[0] == f"{run['samples'] / 24_000:.2f}"
    page.wait_for_selector("#final_out a[download]", timeout=30_000)  # the take, in the page's final WAV
    link = page.locator("#final_out a[download]")
    final = _wav_pcm(base64.b64decode(page.evaluate(FETCH_BASE64, link.get_attribute("href"))))
    np.testing.assert_array_equal(final, server_pcm(url, TEXT, int(run["seed"])))  # the exact PCM
    # idle: the AudioContext is suspended (no audio thread running for an idle tab)
    page.wait_for_function("() => window.studioPlayer.ctx.state === 'suspended'", timeout=15_000)


@pytest.mark.slow
def test_a_text_file_named_wav_is_refused_at_upload(page, tmp_path):
    fake = tmp_path / "notes.wav"
    fake.write_text("these are my notes, not a recording\n")
    page.locator("#prompt_audio button[aria-label='Clear']").click()
    page.locator("#prompt_audio input[type=file]").set_input_files(str(fake))
    page.wait_for_function("() => [...document.querySelectorAll('.toast-body')].some(t => "
                           "/not a readable audio file|not an audio file/i.test(t.textContent))", timeout=30_000)
    page.wait_for_function("() => !document.querySelector('#prompt_audio audio')", timeout=10_000)  # cleared


@pytest.mark.slow
def test_an_idle_tab_writes_no_log_lines(studio, page):
    _, tmp = studio
    log = tmp / "server.log"
    page.wait_for_timeout(12_000)  # past the panels' idle delay
    n0 = len(log.read_text().splitlines())
    page.wait_for_timeout(6_000)
    new = log.read_text().splitlines()[n0:]
    assert not new, new
