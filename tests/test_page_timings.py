"""The take's words on the studio page (app/ui/player_words.js, words.js; app/server/studio_timings.py) in headless
Debian Chromium against `python app.py` (tiny model, the real vLLM CPU engine; conftest's studio_cpu, whose
aligner is the random tiny Whisper: its times are arbitrary but whole, so what is checked is that the page follows
them). A take of two sentences plays, paused at its first sound until its words are in: the words panel shows
the text's words; while it plays the marked word is the one whose [start, end) holds the player's playback time,
moving forward over several words; paused, the time stands; at the end no word is marked. The take's SRT and
WebVTT download beside the WAV and parse (cue times monotone, inside the take, the text's words); the history
keeps them and the words, marked as its row's audio is sought, after a reload too."""

from __future__ import annotations

import re

import pytest
from test_browser import ready_studio
from test_history import N_ROWS, VIEWPORT, browser, fill, open_page, upload_reference  # noqa: F401 (a fixture)

from app.model.words import split_words

TEXT = "The words of this take are marked as it plays. A second sentence follows the first one."
TIMEOUT_MS = 180_000
LAST = "window.studioPlayer.last"
# Pause at the take's first sound (in the page task that sees it, before much has played)
PAUSE_AT_SOUND = f"""() => {{ const r = {LAST};
  if (!r || r.t.firstSound === null) return false;
  if (r.state !== 'playing') return `the take ended first (${{r.state}})`;
  if (!r.paused) document.querySelector('#player_pause').click(); return 'paused'; }}"""
# what the page marks now: the panel's time, the marked word (index, start, end), the player's time (ms)
MARKED = f"""() => {{ const box = document.querySelector('#player_words'), r = {LAST};
  const spans = [...box.querySelectorAll('.word')], now = box.querySelector('.word-now');
  return {{ms: Number(box.dataset.ms), index: now ? spans.indexOf(now) : -1,
           start: now ? Number(now.dataset.start) : null, end: now ? Number(now.dataset.end) : null,
           played: window.studioPlayer.playedS(r) * 1000, state: r.state}}; }}"""
WORDS = "(sel) => [...document.querySelectorAll(sel + ' .word')].map((s) => [s.textContent, +s.dataset.start, " \
        "+s.dataset.end])"
FETCH_TEXT = "async (url) => await (await fetch(url)).text()"
# the history row's audio sought to `t` s (loaded first: it is drawn with preload none)
SEEK = """async ([sel, t]) => { const a = document.querySelector(sel);
  if (a.readyState < 1) { a.preload = 'auto'; const ready = new Promise((r) => a.addEventListener('loadedmetadata', r,
    {once: true})); a.load(); await ready; }
  a.currentTime = t; }"""
STAMP = r"(\d\d):(\d\d):(\d\d)[,.](\d{3})"


@pytest.fixture(scope="module")
def studio(studio_cpu):
    """The shared CPU server's URL (its aligner: the random tiny Whisper); `browser` (test_history's) runs on it."""
    return ready_studio(studio_cpu)


def parse_cues(text: str, kind: str) -> list[tuple[int, int, str]]:
    """(start ms, end ms, text) of each cue of an SRT or WebVTT file."""
    if kind == "vtt":
        assert text.startswith("WEBVTT\n\n"), text[:40]
        text = text.removeprefix("WEBVTT\n\n")
    cues = []
    for block in filter(None, text.strip("\n").split("\n\n")):
        lines = block.split("\n")
        if kind == "srt":
            assert lines[0] == str(len(cues) + 1), block
            lines = lines[1:]
        times = re.fullmatch(f"{STAMP} --> {STAMP}", lines[0])
        assert times, block
        h, m, s, ms, h2, m2, s2, ms2 = map(int, times.groups())
        cues.append(((h * 3600 + m * 60 + s) * 1000 + ms, (h2 * 3600 + m2 * 60 + s2) * 1000 + ms2, " ".join(lines[1:])))
    return cues


def check_subtitles(srt: str, vtt: str, take_ms: float) -> None:
    """Both files: cues in order, inside the take, their words the text's (the same cues in each)."""
    words = [w.text for w in split_words(TEXT)]
    for cues in (parse_cues(srt, "srt"), parse_cues(vtt, "vtt")):
        starts = [c[0] for c in cues]
        assert starts == sorted(starts) and all(0 <= a <= b <= take_ms + 1 for a, b, _ in cues), cues
        assert all(cues[i][1] <= cues[i + 1][0] for i in range(len(cues) - 1)), cues
        assert " ".join(c[2] for c in cues).split() == words, cues
    assert parse_cues(srt, "srt") == parse_cues(vtt, "vtt")


@pytest.mark.slow
def test_the_spoken_word_is_marked_and_the_subtitles_kept(studio, browser, tmp_path):  # noqa: F811
    context = browser.new_context(viewport=VIEWPORT, accept_downloads=True)
    page = open_page(context, studio)
    upload_reference(page)
    fill(page, TEXT, 7, "zero_shot")
    page.locator("#go").click()
    found = page.wait_for_function(PAUSE_AT_SOUND, timeout=TIMEOUT_MS).json_value()
    assert found == "paused", found
    # paused: the words come in (every sentence aligned), the playback time stands
    page.wait_for_function(f"() => {LAST}.words.done && {LAST}.t.end !== null", timeout=TIMEOUT_MS)
    shown = page.evaluate(WORDS, "#player_words")
    assert [w for w, _, _ in shown] == [w.text for w in split_words(TEXT)], shown
    held = page.evaluate(MARKED)
    page.wait_for_timeout(400)
    assert page.evaluate(MARKED)["played"] == held["played"] and held["state"] == "playing", held

    page.locator("#player_pause").click()  # resume
    seen = []
    for _ in range(4000):  # a few seconds of audio
        m = page.evaluate(MARKED)
        if m["state"] != "playing":
            break
        seen.append(m)
        page.wait_for_timeout(25)
    marked = [m for m in seen if m["index"] >= 0]
    for m in marked:  # the marked word holds the time it was marked at, and that time is the player's
        assert m["start"] <= m["ms"] < m["end"], m
        assert m["ms"] <= m["played"] + 50 and m["played"] - m["ms"] < 500, m  # marked at most a frame or so ago
    indexes = [m["index"] for m in marked]
    assert indexes == sorted(indexes) and len(set(indexes)) >= 3, seen
    page.wait_for_function(f"() => {LAST}.state === 'done' && !document.querySelector('#player_words .word-now')")

    # SRT and WebVTT beside the WAV, as downloads
    take_ms = page.evaluate(f"{LAST}.samples") / 24
    files = {}
    for ext in ("srt", "vtt"):
        with page.expect_download() as got:
            page.locator(f"#download_subs a.download-{ext}").click()
        assert got.value.suggested_filename.endswith(f".{ext}"), got.value.suggested_filename
        path = tmp_path / got.value.suggested_filename
        got.value.save_as(path)
        files[ext] = path.read_text(encoding="utf-8")
    check_subtitles(files["srt"], files["vtt"], take_ms)

    # the history keeps them and the words; its row's words are marked where its audio is sought
    page.wait_for_function(N_ROWS % 1, timeout=60_000)
    for reload in (False, True):
        if reload:
            page.reload()
            page.wait_for_function(N_ROWS % 1, timeout=60_000)
        row = "#history_list .history-take"
        assert page.evaluate(WORDS, row) == shown
        for ext in ("srt", "vtt"):
            href = page.locator(f"{row} a.download-{ext}").get_attribute("href")
            assert page.evaluate(FETCH_TEXT, href) == files[ext]
        word, start, end = next(w for w in shown if w[2] - w[1] >= 40)
        page.evaluate(SEEK, [f"{row} audio", (start + end) / 2000])
        page.wait_for_function(f"(w) => document.querySelector('{row} .word-now')?.textContent === w", arg=word,
                               timeout=30_000)
    context.close()


@pytest.mark.slow
def test_a_take_whose_text_streams_in_shows_its_words(studio, browser):  # noqa: F811
    """With "Text streams in" (the socket door), the take's words come to the panel too, once it is made (the
    socket's take is one segment, aligned at its end), and its SRT and WebVTT links appear."""
    context = browser.new_context(viewport=VIEWPORT)
    page = open_page(context, studio)
    upload_reference(page)
    fill(page, TEXT, 7, "zero_shot")
    page.locator("#text_streams input[type=checkbox]").check()
    page.locator("#go").click()
    page.wait_for_function(f"() => {LAST}?.feed?.closed && {LAST}.words.done && {LAST}.t.end !== null",
                           timeout=TIMEOUT_MS)
    shown = page.evaluate(WORDS, "#player_words")
    take_ms = page.evaluate(f"{LAST}.samples") / 24
    assert [w for w, _, _ in shown] == [w.text for w in split_words(TEXT)], shown
    assert [s for _, s, _ in shown] == sorted(s for _, s, _ in shown), shown
    assert all(0 <= s <= e <= take_ms + 1 for _, s, e in shown), (shown, take_ms)
    assert page.evaluate(f"{LAST}.words.note") is None
    for ext in ("srt", "vtt"):
        assert page.locator(f"#download_subs a.download-{ext}").is_visible()
    context.close()
