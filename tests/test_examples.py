"""A public page as strangers meet it. Its examples keep playing on a server that runs for hours: after
Gradio's cache cleanup has run (its age shortened to 2 s) and after a second instance on the same temp folder
has shut down, each example loads its reference clip and plays, on a page opened before both and on one
opened after. Its live panels show a visitor the public facts and their own requests only.

One `python app.py` behind a stand-in proxy (127.0.0.1 trusted: each browser context sends its own
X-Forwarded-For, as nginx or a Space's proxy would), tiny model, real vLLM CPU engine (conftest.py's
studio_public); a second instance on the torch backend; real Chromium.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import time
from pathlib import Path

import pytest
from studio import REPO, run_studio
from test_browser import CHROMIUM, CHROMIUM_ARGS, _need

from app.ui.i18n import example_label

SPEC = json.loads((REPO / "assets" / "examples.json").read_text(encoding="utf-8"))
CLEANUP_S = 2  # [ui] cache_cleanup_s: every 2 s, Gradio deletes its cached files older than 2 s
TIMEOUT_MS = 120_000
LAST = "window.studioPlayer.last"
FINISHED = f"() => {LAST} && {LAST}.seq === %d && ['done', 'error', 'stopped'].includes({LAST}.state)"
SETS = {"ui.cache_cleanup_s": str(CLEANUP_S), "model.download": "false", "server.trusted_proxies": '"127.0.0.1"'}


@pytest.fixture(scope="module")
def studio(studio_public):
    """conftest.py's studio_public (shared with test_owners.py): SETS among its keys."""
    from conftest import SHARED_SERVERS

    _need(Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing")
    _need(subprocess.run(["which", "ffmpeg"], capture_output=True).returncode == 0, "ffmpeg is missing")
    _need(importlib.util.find_spec("playwright") is not None, "the playwright package is missing")
    _need(importlib.util.find_spec("vllm") is not None, "vLLM is missing (bash scripts/studio.sh)")
    assert {**SHARED_SERVERS["studio_public"], **SETS} == SHARED_SERVERS["studio_public"]
    return studio_public


def _open(browser, url: str, address: str = "198.51.100.1"):
    """A new visitor's page (its own cookies), reaching the server as `address` through the proxy."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000},
                                  extra_http_headers={"X-Forwarded-For": address})
    page = context.new_page()
    page.goto(url)
    page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('ready')", timeout=60_000)
    page.wait_for_function("() => window.studioPlayer && window.studioPlayer.mode !== null")
    return page


def _play_example(page, label: str, text: str) -> dict:
    """Click the example `label`, check its reference clip is served, Generate; the player's finished run."""
    page.locator("#examples").get_by_text(label, exact=True).click()
    page.wait_for_function("(t) => document.querySelector('#text textarea')?.value === t", arg=text)
    page.wait_for_selector("#prompt_audio audio, #prompt_audio [data-testid='waveform-prompt_audio']",
                           state="attached", timeout=30_000)
    src = page.evaluate("() => document.querySelector('#prompt_audio audio')?.src || null")
    if src:  # the clip the page shows is still served (a deleted cache file answered 403)
        assert page.evaluate("async (u) => (await fetch(u)).status", src) == 200, src
    seq = page.evaluate(f"{LAST} ? {LAST}.seq : 0") + 1
    page.locator("#go").click()
    page.wait_for_function(FINISHED % seq, timeout=TIMEOUT_MS)
    return page.evaluate(f"() => ({{state: {LAST}.state, error: {LAST}.error, samples: {LAST}.samples}})")


@pytest.mark.slow
def test_examples_play_after_the_cache_cleanup_and_another_instances_shutdown(studio, tiny_model_dir,
                                                                             tmp_path):
    from playwright.sync_api import sync_playwright

    url, tmp = studio
    shared_temp = tmp / "gradio"
    en, zh, numbers = (t["text"] for t in SPEC["texts"])  # the rows of app/ui/layout.py's example_rows
    rows = [(example_label(key), text) for key, text in (
        ("ex_en", en), ("ex_zh", zh), ("ex_numbers", numbers), ("ex_cross", zh), ("ex_instruct", en))]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            before = _open(browser, url)  # a page opened before the cleanup and the other instance
            # a second app on the same Gradio temp folder (another Space replica, a second demo on the box)
            with run_studio(tiny_model_dir, tmp_path, {"engine.backend": '"torch"', "model.download": "false",
                                                      "ui.cache_cleanup_s": str(CLEANUP_S)},
                            env={"GRADIO_TEMP_DIR": str(shared_temp)}):
                pass  # ready, then stopped: its shutdown deletes what it cached
            time.sleep(3 * CLEANUP_S)  # the first server's own cleanup runs (at least) twice meanwhile
            for label, text in rows:
                run = _play_example(before, label, text)
                assert run["state"] == "done" and run["samples"] > 0, (label, run)
                assert not before.locator("#studio_error").inner_text().strip(), label
            after = _open(browser, url)  # and a page opened afterwards
            run = _play_example(after, rows[0][0], rows[0][1])
            assert run["state"] == "done" and run["samples"] > 0, run
        finally:
            browser.close()


@pytest.mark.slow
def test_a_visitors_panels_show_public_facts_and_their_own_requests(studio):
    from playwright.sync_api import sync_playwright

    url, tmp = studio
    en = SPEC["texts"][0]["text"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            alice, bob = _open(browser, url, "198.51.100.2"), _open(browser, url, "198.51.100.3")
            run = _play_example(alice, example_label("ex_en"), en)
            assert run["state"] == "done", run
            mine = alice.evaluate(f"() => {LAST}.requestId")[:8]
            table = "() => document.querySelector('#latency_table')?.innerText || ''"
            alice.wait_for_function(f"() => ({table})().includes('{mine}')", timeout=30_000)  # her own request
            for page in (alice, bob):
                page.locator("#engine_facts_box .label-wrap").click()
                page.wait_for_function("() => document.querySelector('#engine_facts')?.innerText.includes('voices')",
                                       timeout=30_000)
                facts = page.locator("#engine_facts").inner_text()
                assert "private" in facts and "tiny" in facts, facts  # the public facts
                for secret in (str(tmp), "/tmp", "/root", "engine_args", "model_path", "VLLM_"):
                    assert secret not in facts, (secret, facts)
            bob.wait_for_timeout(3_000)  # a few panel ticks
            assert mine not in bob.evaluate(table)  # not alice's requests
        finally:
            browser.close()
