"""The history of takes (app/ui/history.py, history.js) in headless Debian Chromium against `python app.py`
(tiny model, configs/cpu.toml, the real vLLM CPU engine): one server for the module.

Two streamed takes of the page's player and one made whole (streaming off, speed 1.5) are listed
newest first with their text, seed, mode and speed; each one's audio in the history is byte for byte the final
WAV the page showed; they survive a reload; "Use these settings" puts text, mode, seed, stream and speed back;
Delete removes one; a stopped take is not kept; with small limits (window.studioHistory.configure: the pruning
every take goes through) the oldest go first, by count and by bytes; Clear asks first (Cancel keeps them) and
empties it; another visitor (a second browser context) sees none of it. Without IndexedDB the history says it
is unavailable and Generate works as before.
"""

from __future__ import annotations

import base64
import hashlib
import re
import time

import pytest
from studio import EXAMPLE_TRANSCRIPT, EXAMPLE_WAV
from test_browser import CHROMIUM, CHROMIUM_ARGS, ready_studio, stop_while_made

from app.ui import ui_text
from app.ui.history import history_labels

TIMEOUT_MS = 120_000
VIEWPORT = {"width": 1400, "height": 1000}
TAKES = [  # (player, text, seed, mode): the takes this test makes, in order
    ("webaudio", "The first take of the history.", 11, "instruct"),
    ("webaudio", "A second take, spoken across languages.", 12, "cross_lingual"),
    ("whole", "The third take is made whole, at its speed.", 13, "zero_shot"),
]
SPEED = 1.5  # the whole take's: streaming off, so the speed applies
INSTRUCT = "Speak slowly and warmly."  # the instruct take's instruction
LAST = "window.studioPlayer.last"
# the history's takes as stored (newest first), without their audio
STORED = """async () => (await window.studioHistory.list()).map(({wav, details, ...t}) =>
  ({...t, wavSize: wav.size, requestId: details && details.request_id}))"""
# the rows drawn on the page, top to bottom
ROWS = """() => [...document.querySelectorAll('#history_list .history-take')].map((r) => ({
  id: Number(r.dataset.id), text: r.querySelector('.history-text').title,
  facts: r.querySelector('.history-facts').textContent, stats: r.querySelector('.history-stats').textContent,
  audio: r.querySelector('audio').src, link: r.querySelector('a[download]').href,
  name: r.querySelector('a[download]').download}))"""
N_ROWS = ("() => window.studioHistory && window.studioHistory.state === 'ready' && "
          "document.querySelectorAll('#history_list .history-take').length === %d")
# the bytes behind a URL the page holds (a blob: URL or a Gradio file), base64
FETCH_BASE64 = """async (url) => { const b = new Uint8Array(await (await fetch(url)).arrayBuffer()); let s = '';
  for (let i = 0; i < b.length; i += 0x8000) s += String.fromCharCode.apply(null, b.subarray(i, i + 0x8000));
  return btoa(s); }"""
INPUTS = """() => ({text: document.querySelector('#text textarea').value,
  seed: document.querySelector('#seed input').value,
  mode: document.querySelector('#mode input[type=radio]:checked')?.value,
  stream: document.querySelector('#stream input[type=checkbox]').checked,
  speed: document.querySelector('#speed input[type=range]').value})"""


# --- without a server ------------------------------------------------------------------------------------


def test_history_words_exist_in_both_languages_with_the_same_fields():
    table = history_labels()
    assert set(table["en"]) == set(table["zh"])
    for key, en in table["en"].items():
        assert re.findall(r"{(\w+)}", en) == re.findall(r"{(\w+)}", table["zh"][key]), key
    used = set(re.findall(r"label\('(\w+)'", ui_text("history.js")))
    assert used and used <= set(table["en"]), used - set(table["en"])


# --- the studio ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def studio(studio_bf16):
    """The base URL of the shared bfloat16 `python app.py` (conftest.py's studio_bf16)."""
    return ready_studio(studio_bf16)


@pytest.fixture(scope="module")
def browser(studio):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def open_page(context, url: str):
    """The studio in a page of `context` (one visitor), loaded, its history read."""
    page = context.new_page()
    page.goto(url)
    page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('ready')", timeout=60_000)
    page.wait_for_function("() => window.studioPlayer && window.studioPlayer.mode !== null")
    page.wait_for_function("() => window.studioHistory && window.studioHistory.state !== 'opening'")
    return page


def upload_reference(page) -> None:
    page.locator("#prompt_audio input[type=file]").set_input_files(str(EXAMPLE_WAV))
    page.wait_for_selector("#prompt_audio audio, #prompt_audio [data-testid='waveform-prompt_audio']",
                           state="attached", timeout=30_000)
    page.locator("#prompt_text textarea").fill(EXAMPLE_TRANSCRIPT)


def fill(page, text: str, seed: int, mode: str) -> None:
    page.locator("#text textarea").fill(text)
    page.locator("#seed input").fill(str(seed))
    if mode != "instruct" and page.locator("#instruct_text textarea").is_visible():
        page.locator("#instruct_text textarea").fill("")  # before the mode's change hides the box
    page.locator(f"#mode input[type=radio][value={mode}]").check()
    if mode == "instruct":  # its box appears on the mode's change
        page.locator("#instruct_text textarea").fill(INSTRUCT)


def take_low_latency(page, n_rows: int | None) -> str:
    """Generate with the low-latency player; once the take is in the history (n_rows rows; None: no history),
    the final WAV the page showed (fetch_digest)."""
    seq = page.evaluate(f"{LAST} ? {LAST}.seq : 0") + 1
    page.locator("#go").click()
    page.wait_for_function(f"() => {LAST} && {LAST}.seq === {seq} && ['done', 'error', 'stopped'].includes("
                           f"{LAST}.state)", timeout=TIMEOUT_MS)
    assert page.evaluate(f"{LAST}.state") == "done", page.evaluate(f"{LAST}.error")
    if n_rows is not None:
        page.wait_for_function(N_ROWS % n_rows, timeout=30_000)
    page.wait_for_selector("#final_out a[download]", timeout=30_000)  # the take, in the page's final WAV
    return fetch_digest(page, page.locator("#final_out a[download]").get_attribute("href"))


def take_whole(page, n_rows: int) -> str:
    """Generate with streaming off, at SPEED (the page's player gets the take whole); once it is in the history,
    the final WAV the page showed (fetch_digest)."""
    page.locator("#stream input[type=checkbox]").uncheck()
    page.wait_for_function("() => !document.querySelector('#speed input[type=range]').disabled")
    page.evaluate(f"""() => {{ const r = document.querySelector('#speed input[type=range]'); r.value = '{SPEED}';
                                r.dispatchEvent(new Event('input', {{bubbles: true}})); }}""")
    return take_low_latency(page, n_rows)


def fetch_digest(page, url: str) -> str:
    """The bytes behind a URL the page holds (a blob: URL or a Gradio file): their sha256 and size."""
    data = base64.b64decode(page.evaluate(FETCH_BASE64, url))
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE", data[:64]
    return f"{hashlib.sha256(data).hexdigest()[:16]} {len(data)} B"


def history_audio(page) -> dict[int, str]:
    """Each row's audio (its <audio> and its download link hold the same blob URL), by take id (fetch_digest)."""
    out = {}
    for row in page.evaluate(ROWS):
        assert row["audio"] == row["link"] and row["audio"].startswith("blob:"), row
        out[row["id"]] = fetch_digest(page, row["audio"])
    return out


def answer_clear(page, accept: bool) -> str:
    """Click Clear history and answer the page's question (OK or Cancel); the question asked."""
    asked = []

    def answer(dialog) -> None:
        asked.append(dialog.message)
        dialog.accept() if accept else dialog.dismiss()

    page.once("dialog", answer)
    page.locator("#history_clear").click()
    for _ in range(50):  # the handler runs while Playwright waits on the page
        if asked:
            break
        page.wait_for_timeout(100)
    assert len(asked) == 1, asked
    return asked[0]


def seeds(page) -> list[int]:
    return [t["seed"] for t in page.evaluate(STORED)]


@pytest.mark.slow
def test_history_keeps_takes_across_a_reload_within_its_bounds(studio, browser):
    context = browser.new_context(viewport=VIEWPORT)
    page = open_page(context, studio)
    assert page.evaluate("window.studioHistory.limits") == {"maxTakes": 20, "maxBytes": 50 * 1024 * 1024}
    assert page.evaluate(STORED) == [] and "No takes yet" in page.locator("#history_status").inner_text()
    upload_reference(page)
    shown = []  # the final WAV the page showed for each take (fetch_digest), in order
    for i, (player, text, seed, mode) in enumerate(TAKES):
        fill(page, text, seed, mode)
        shown.append(take_low_latency(page, i + 1) if player == "webaudio" else take_whole(page, i + 1))

    # newest first, with what each take was asked and how it was made
    stored = page.evaluate(STORED)
    assert [(t["text"], t["seed"], t["mode"]) for t in stored] == [take[1:] for take in TAKES[::-1]], stored
    assert {t["player"] for t in stored} == {"webaudio"}, stored
    assert [(t["stream"], t["speed"]) for t in stored] == [(False, SPEED), (True, 1.0), (True, 1.0)], stored
    assert all(t["voice"] == "" and t["requestId"] and t["bytes"] == t["wavSize"] > 44 for t in stored), stored
    assert all(t["statsLine"].startswith("TTFA") for t in stored), stored
    rows = page.evaluate(ROWS)
    assert [r["id"] for r in rows] == [t["id"] for t in stored]
    assert [r["text"] for r in rows] == [text for _, text, _, _ in TAKES[::-1]]
    for row, (_, _, seed, _) in zip(rows, TAKES[::-1], strict=True):
        assert f"seed {seed}" in row["facts"] and row["stats"].startswith("TTFA"), row
    assert "speed 1.50" in rows[0]["facts"] and "Cross-lingual" in rows[1]["facts"], rows
    assert rows[2]["name"] == "the-first-take-of-the-history.wav", rows[2]
    ids = [t["id"] for t in stored]
    audio = dict(zip(ids, shown[::-1], strict=True))  # take id -> the final WAV the page showed
    assert history_audio(page) == audio  # byte for byte

    # a reload: the same takes, the same audio
    page.reload()
    page.wait_for_function(N_ROWS % 3, timeout=60_000)
    assert page.evaluate(STORED) == stored
    assert history_audio(page) == audio

    # "Use these settings": the whole take's (streaming off, its speed), then the cross-lingual one's
    assert page.evaluate(INPUTS)["text"] == ""
    page.locator(f"#history_list [data-id='{ids[0]}'] button[data-act=use]").click()
    page.wait_for_function(f"() => ({INPUTS})().speed === '{SPEED}'", timeout=30_000)
    assert page.evaluate(INPUTS) == {"text": TAKES[2][1], "seed": "13", "mode": "zero_shot", "stream": False,
                                     "speed": str(SPEED)}
    page.locator(f"#history_list [data-id='{ids[1]}'] button[data-act=use]").click()
    page.wait_for_function(f"() => ({INPUTS})().speed === '1'", timeout=30_000)  # streaming: the page resets it
    assert page.evaluate(INPUTS) == {"text": TAKES[1][1], "seed": "12", "mode": "cross_lingual", "stream": True,
                                     "speed": "1"}
    # the instruct take's: its instruction into the box its mode shows (set while the box was hidden)
    page.locator(f"#history_list [data-id='{ids[2]}'] button[data-act=use]").click()
    page.wait_for_function(f"() => ({INPUTS})().mode === 'instruct'", timeout=30_000)
    page.wait_for_function(f"() => document.querySelector('#instruct_text textarea')?.value === '{INSTRUCT}'",
                           timeout=30_000)
    assert page.evaluate(INPUTS) == {"text": TAKES[0][1], "seed": "11", "mode": "instruct", "stream": True,
                                     "speed": "1"}

    # in Chinese: a page of this browser whose language is Chinese draws the same takes in its words
    zh = context.new_page()
    zh.add_init_script("Object.defineProperty(navigator, 'language', {get: () => 'zh-CN'});")
    zh.goto(studio)
    zh.wait_for_function(N_ROWS % 3, timeout=60_000)
    assert zh.locator("#history_list button[data-act=use]").first.text_content() == "使用这些设置"
    assert "种子 13" in zh.evaluate(ROWS)[0]["facts"]
    assert zh.locator("#history_clear").inner_text() == "清空历史记录"
    asked = answer_clear(zh, accept=False)  # Clear asks first, in the page's language; Cancel keeps them all
    assert asked == "删除本浏览器历史记录中的全部 3 条？此操作无法撤销。", asked
    zh.wait_for_timeout(500)
    assert len(zh.evaluate(ROWS)) == 3 and len(zh.evaluate(STORED)) == 3
    zh.close()

    # another visitor (a second browser context) sees none of it
    other = browser.new_context(viewport=VIEWPORT)
    try:
        stranger = open_page(other, studio)
        assert stranger.evaluate("window.studioHistory.state") == "ready"
        assert stranger.evaluate(STORED) == [] and stranger.evaluate(ROWS) == []
    finally:
        other.close()

    # Delete: the middle take goes
    page.locator(f"#history_list [data-id='{ids[1]}'] button[data-act=delete]").click()
    page.wait_for_function(N_ROWS % 2)
    assert seeds(page) == [13, 11]

    # bounds: at most 2 takes, then a new one drops the oldest (a stopped take before it is not kept); then
    # bytes for the newest alone
    assert page.evaluate("window.studioHistory.configure({maxTakes: 2})")["maxTakes"] == 2
    upload_reference(page)
    # (40 sentences, ~22 s of this box: the take is still being made when the page sounds)
    fill(page, " ".join(["This long take is stopped before it ends."] * 40), 31, "zero_shot")
    seq = page.evaluate(f"{LAST} ? {LAST}.seq : 0") + 1
    page.locator("#go").click()
    stop_while_made(page, seq, TIMEOUT_MS)
    page.wait_for_function(f"() => {LAST}.state === 'stopped'", timeout=10_000)
    fill(page, "A fourth take pushes the oldest out.", 14, "zero_shot")
    fourth = take_low_latency(page, 2)
    assert seeds(page) == [14, 13]
    newest = page.evaluate(STORED)[0]
    assert history_audio(page)[newest["id"]] == fourth
    page.evaluate(f"window.studioHistory.configure({{maxBytes: {newest['bytes'] + 100}}})")
    page.wait_for_function(N_ROWS % 1)
    assert seeds(page) == [14]

    # Clear, confirmed: empty, also after a reload
    assert answer_clear(page, accept=True) == "Delete every take (1) of this browser's history? This cannot be undone."
    page.wait_for_function(N_ROWS % 0)
    assert page.evaluate(STORED) == [] and "No takes yet" in page.locator("#history_status").inner_text()
    page.reload()
    page.wait_for_function(N_ROWS % 0, timeout=60_000)
    assert page.evaluate(STORED) == []
    context.close()


@pytest.mark.slow
def test_without_indexeddb_the_history_is_unavailable_and_generate_works(studio, browser):
    context = browser.new_context(viewport=VIEWPORT)
    context.add_init_script("Object.defineProperty(window, 'indexedDB', {value: undefined, configurable: true});")
    try:
        page = open_page(context, studio)
        assert page.evaluate("window.studioHistory.state") == "unavailable"
        assert "unavailable" in page.locator("#history_status").inner_text()
        upload_reference(page)
        fill(page, "Generate works without a history.", 21, "zero_shot")
        t0 = time.monotonic()
        take_low_latency(page, None)  # played and shown as always; nothing listed
        print(f"\ntake without IndexedDB: {time.monotonic() - t0:.1f} s")
        assert page.locator("#final_out a[download]").get_attribute("download").startswith("generate-works")
        assert "unavailable" in page.locator("#history_status").inner_text()
    finally:
        context.close()
