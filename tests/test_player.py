"""The page's low-latency WebAudio player (issue 7) in headless Debian Chromium against `python app.py`
(tiny model, configs/cpu.toml, the real vLLM CPU engine), with the page's login ([server] auth) and the
/v1 bearer key set: the player's Worker fetches with the page's login cookie.

One server and one page for the module. The same request (uploaded assets/prompt_en.wav, its
transcript, a short text, a fixed seed) runs several times; click -> sound is observed in the page: the
player's first buffer start (window.studioPlayer, app/ui/player.js). The samples the player scheduled
(copied by a hook this test installs, SCHEDULED_HOOK) must equal the PCM body the server sent, and the
page's final WAV must hold exactly that PCM (and the server's PCM for the same request), with the stats
line and details of the request's metrics record. Stop aborts the fetch and the engine request, and keeps
what came as the take. /studio/speech refuses reference paths outside Gradio's upload folder and assets/.
Prints the player's numbers (docs/studio.md). Saves out/player.png.

The browser stands for a listener's own machine: on a box with 2+ cores the server (app and vLLM
engine) runs on all cores but the last and Chromium on the last (`CORES`). Sharing the cores, the
server's compute starved Chromium: strace showed the server writing the headers and first chunk
when its handler returned, and the page receiving them ~210 ms later (often at the end of
generation), +200..+430 ms in all; with the cores split, +50..+68 ms over 10 runs.
"""

from __future__ import annotations

import base64
import io
import json
import os
import statistics
import subprocess
import time
import wave
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from studio import fill_take, run_studio
from test_browser import CHROMIUM, CHROMIUM_ARGS, RECORD_AUDIO_EVENTS, _need, stop_while_made

from app.engine.requests import RequestStats, SynthesisRequest
from app.service.metrics import Metrics
from app.ui.panels import REQUEST_ID_CHARS
from app.ui.takes import notes_markdown, take_line

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = json.loads((REPO / "assets" / "examples.json").read_text(encoding="utf-8"))
PROMPT_WAV, PROMPT_TEXT = REPO / "assets" / "prompt_en.wav", EXAMPLES["voices"][0]["transcript"]
TEXT = "Hello there, how are you today?"
# long enough to be still in the making when the page sounds (12 sentences were once all made before Stop)
LONG_TEXT = " ".join(["This long sentence keeps the model talking for quite a while."] * 30)
SEED = 7
API_KEY = "player-test-key"
LOGIN = ("player", "player-test-password")  # [server] auth: the page and /studio need the login
# issue 7's goal: click -> sound within 150 ms of the server's TTFA (loopback). A latency goal, so it is
# measured, not asserted: the gap depends on how loaded the box is (the browser shares its cores with
# other jobs here and in CI); this test writes its runs to LATENCY_REPORT and asserts what is causal.
BUDGET_MS = 150
LATENCY_REPORT = REPO / "out" / "player_latency.json"
N_LOW_LATENCY = 5  # low-latency runs measured; the median goes to LATENCY_REPORT, all are printed
SCREENSHOT = REPO / "out" / "player.png"
_ALL = sorted(os.sched_getaffinity(0))
# (server cores, browser cores): the browser on the last core, the server on the others (one core: shared)
CORES = (_ALL[:-1], _ALL[-1:]) if len(_ALL) > 1 else (_ALL, _ALL)
TIMEOUT_MS = 120_000
LAST = "window.studioPlayer.last"
FINISHED = f"() => {LAST} && {LAST}.seq === %d && ['done', 'error', 'stopped'].includes({LAST}.state)"
RUN_INFO = f"""() => {{ const r = {LAST}; const c = window.studioPlayer.ctx;
  return {{seq: r.seq, state: r.state, error: r.error, t: r.t, ttfa: r.serverTtfaMs, server: r.server,
          requestId: r.requestId, samples: r.samples, buffers: r.buffers, underruns: r.underruns,
          firstStartS: r.firstStartS, contextState: c.state, currentTime: c.currentTime,
          mode: r.mode, aborted: r.aborted, flushed: r.flushed, playedFrames: r.playedFrames}}; }}"""
# installed before the page's scripts: copies of the samples the player hands to the audio side, per run (its
# Worker's posts to the AudioWorklet, or to the page without one), in window.__scheduled; the page ships none
SCHEDULED_HOOK = r"""{
  const got = window.__scheduled = {id: null, parts: []};
  const keep = (m) => {
    if (!m || !m.samples || (m.type !== 'copy' && m.type !== 'pcm')) return;
    if (m.id !== got.id) { got.id = m.id; got.parts = []; }
    got.parts.push(Array.from(m.samples));
  };
  const HOOK = `{ const post = MessagePort.prototype.postMessage;
    MessagePort.prototype.postMessage = function (m, t) {
      if (m && m.type === 'pcm') self.postMessage({type: 'copy', id: m.id, samples: m.samples.slice()});
      return post.call(this, m, t); }; }\n`;
  const B = window.Blob;
  window.Blob = class extends B {
    constructor(parts, opts) {
      const worker = parts && typeof parts[0] === 'string' && parts[0].includes('self.onmessage');
      super(worker ? [HOOK + parts[0]] : parts, opts);
    }
  };
  const W = window.Worker;
  window.Worker = class extends W {
    constructor(...args) { super(...args); this.addEventListener('message', (e) => keep(e.data)); }
  };
}"""
SCHEDULED = "() => window.__scheduled.parts.flat()"
# the latest run's body as received, base64
RECEIVED = f"""() => {{ let s = '';
  for (const b of {LAST}.pcm) for (let i = 0; i < b.length; i += 0x8000)
    s += String.fromCharCode.apply(null, b.subarray(i, i + 0x8000));
  return btoa(s); }}"""


# --- without a server ------------------------------------------------------------------------------------


def test_request_records_are_found_by_id_while_kept_and_build_the_stats():
    """The metrics record of a request id, bounded by the ring buffer, carries what the page's stats line
    and details show (both players build them from it with the same two functions)."""
    voice = object()  # the record never looks at the voice's features
    m = Metrics(max_requests=3)  # keeps the last two requests and the rejection
    reqs = [SynthesisRequest(text="Hello.", voice=voice, mode="cross_lingual", seed=40 + i) for i in range(3)]
    stats = RequestStats(ttfa_ms=123.4, wall_s=1.0, audio_s=2.0, n_tokens=50, n_segments=2, n_chunks=5, lm_s=0.5,
                         flow_s=0.3, hift_s=0.1, chunk_flow_ms=(30.04, 20.0), chunk_frames=(56, 50),
                         first_token_ms=20.0, first_hop_ms=60.0, first_hift_ms=5.0, first_wave_ms=100.0)
    for req in reqs:
        m.request_started()
        m.request_finished(stats, 0.25, request=req, n_samples=48_000, voice="alice", notes=("a note",),
                           reference_s=0.5)
    m.request_finished(None, 0.0, "rejected")  # no request: never found, not even by ""
    assert m.record(reqs[0].request_id) is None  # out of the ring buffer
    assert m.record("") is None and m.record("0" * 32) is None
    rec = m.record(reqs[1].request_id)
    assert rec is not None and (rec.seed, rec.mode, rec.voice, rec.notes) == (41, "cross_lingual", "alice", ("a note",))
    line = take_line(rec.details(), "en")  # the stats line, said from the take's details
    for part in ("TTFA 123 ms", "RTF 0.50", "50.0 tokens/s", "audio 2.00 s", "queue 0.25 s",
                 "reference 0.50 s", "mode cross_lingual", "seed 41"):
        assert part in line, (part, line)
    assert "*" not in line  # plain text: API clients show it as it is
    assert notes_markdown(rec.notes) == "\n\n- a note" and notes_markdown(()) == ""
    details = rec.details()
    assert details["request_id"] == reqs[1].request_id and details["audio_samples"] == 48_000
    assert (details["chunks"], details["segments"], details["voice"], details["notes"]) == (5, 2, "alice", ["a note"])
    assert (details["queue_wait_s"], details["reference_s"], details["ttfa_ms"]) == (0.25, 0.5, 123.4)
    assert details["first_audio_path_ms"] == {"lm_first_token": 20.0, "first_chunk_tokens_in": 60.0, "flow_call": 30.0,
                                              "vocoder": 5.0, "wave_ready": 100.0, "first_audio": 123.4}
    json.dumps(details, allow_nan=False)  # the page gets it as strict JSON


def test_reference_path_accepts_only_uploads_and_assets(tmp_path, monkeypatch):
    from app.server.errors import ApiError
    from app.server.studio_stream import reference_path

    uploads = tmp_path / "gradio"
    (uploads / "abc").mkdir(parents=True)
    (uploads / "abc" / "ref.wav").write_bytes(b"RIFF")
    (uploads / "out.wav").symlink_to(tmp_path / "secret.wav")
    (tmp_path / "secret.wav").write_bytes(b"RIFF")
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(uploads))
    assert reference_path(str(uploads / "abc" / "ref.wav")) == (uploads / "abc" / "ref.wav").resolve()
    assert reference_path(str(uploads / "abc" / ".." / "abc" / "ref.wav")).name == "ref.wav"
    assert reference_path(str(PROMPT_WAV)) == PROMPT_WAV.resolve()
    for bad in ("/etc/passwd", "../../x", str(uploads / "out.wav"), str(uploads), str(uploads / "abc"),
                str(uploads / "abc" / ".." / ".." / "secret.wav"), str(tmp_path / "secret.wav"), "a\0b", ""):
        with pytest.raises(ApiError, match=r"^unknown reference file") as e:
            reference_path(bad)
        assert e.value.status == 400


def test_the_take_event_shows_a_players_take_and_refuses_anything_else():
    """PlayerTake.show (the hidden take element's change event): the request's record becomes the page's stats
    line and details (the final WAV stays in the page: the server answers no file, whatever the value names); a
    stopped take says what it kept; anything that is not a take of this server (bad JSON, an id it never made)
    shows nothing."""
    import gradio as gr

    from app.ui.player import PlayerTake

    m = Metrics()
    req = SynthesisRequest(text="Hello.", voice=object(), seed=7)
    m.request_started()
    stats = RequestStats(ttfa_ms=99.0, wall_s=1.0, audio_s=2.0, n_tokens=50, n_segments=1, n_chunks=2, lm_s=0.5,
                         flow_s=0.3, hift_s=0.1)
    m.request_finished(stats, 0.0, request=req,
                       n_samples=48_000, notes=("a note",))
    take = PlayerTake(SimpleNamespace(metrics=m))
    value = {"request_id": req.request_id, "client": {"first_byte_ms": 80.4, "first_sound_ms": 95}}
    line, details = take.show(json.dumps(value))
    assert line.startswith("TTFA 99 ms") and "seed 7" in line, line
    assert line.endswith("player **low-latency** · click → first byte 80 ms → first sound 95 ms\n\n- a note"), line
    assert details["request_id"] == req.request_id and details["player"] == "webaudio", details
    assert details["client"] == {"first_byte_ms": 80.4, "first_sound_ms": 95.0}
    assert take.show("") == ("", None)  # a new Generate clears the outputs
    # a value naming a server file gets the same two outputs: no path of the server's reaches the page
    assert take.show(json.dumps({**value, "path": "/etc/passwd"})) == (line, details)
    stopped = {"request_id": "a" * 32, "stopped": True, "samples": 36_000, "seed": "12"}
    line, details = take.show(json.dumps(stopped))
    assert line == "Stopped: kept 1.50 s of audio · seed 12", line
    assert details["stopped"] and details["seed"] == 12 and details["audio_samples"] == 36_000, details
    for bad in ("{", "[]", "null", json.dumps({"request_id": "../x"}), json.dumps({**value, "request_id": "0" * 32}),
                json.dumps({**value, "pad": "x" * 5000})):
        with pytest.raises(gr.Error):
            take.show(bad)


# --- the studio ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def studio(tiny_model_dir, tmp_path_factory):
    """(base URL, Gradio's upload folder) of `python app.py` (tests/studio.py) on the server's cores."""
    _need(Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing")
    _need(subprocess.run(["which", "ffmpeg"], capture_output=True).returncode == 0,
          "ffmpeg is missing (Gradio needs it for the standard player)")
    try:
        import playwright  # noqa: F401
    except ImportError:
        _need(False, "the playwright package is missing")
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("player")
    server_cores = ",".join(map(str, CORES[0]))
    sets = {"vllm.dtype": '"bfloat16"', "model.download": "false", "server.api_key": json.dumps(API_KEY),
            "server.auth": json.dumps(":".join(LOGIN)),
            "vllm.cpu_omp_threads_bind": json.dumps(server_cores)}  # the server's cores (module docstring)
    env = {"OMP_WAIT_POLICY": "PASSIVE"}  # idle OpenMP threads sleep instead of spinning
    with run_studio(tiny_model_dir, tmp, sets, env, prefix=["taskset", "-c", server_cores]) as (url, _):
        yield url, tmp / "gradio"


@pytest.fixture(scope="module")
def browser(studio, tmp_path_factory):
    """Headless Chromium on the browser's cores (CORES): a wrapper execs it under taskset, so every
    process it starts (renderers, network and audio services) inherits them."""
    from playwright.sync_api import sync_playwright

    wrapper = tmp_path_factory.mktemp("chromium") / "chromium"
    wrapper.write_text(f'#!/bin/sh\nexec taskset -c {",".join(map(str, CORES[1]))} {CHROMIUM} "$@"\n')
    wrapper.chmod(0o755)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(wrapper), headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def open_studio(browser, url: str, *init_scripts: str):
    """A new page of the studio with the reference uploaded, its transcript, TEXT and SEED filled in (the page's
    player ready)."""
    pg = browser.new_page(viewport={"width": 1400, "height": 1000})
    login = pg.request.post(f"{url}/login", form={"username": LOGIN[0], "password": LOGIN[1]})  # the cookie
    assert login.ok, login.status
    for script in init_scripts:
        pg.add_init_script(script)
    pg.goto(url)
    pg.wait_for_function("() => document.querySelector('#status')?.innerText.includes('ready')", timeout=60_000)
    pg.wait_for_function("() => window.studioPlayer && window.studioPlayer.mode !== null")
    fill_take(pg, wav=PROMPT_WAV, transcript=PROMPT_TEXT, text=TEXT, seed=SEED)
    return pg


@pytest.fixture(scope="module")
def page(studio, browser):
    pg = open_studio(browser, studio[0], RECORD_AUDIO_EVENTS, SCHEDULED_HOOK)
    yield pg
    pg.close()


def play_low_latency(page) -> dict:
    """Click Generate with the low-latency player selected; the run's facts once it has finished."""
    seq = page.evaluate(f"{LAST} ? {LAST}.seq : 0") + 1
    page.locator("#go").click()
    page.wait_for_function(FINISHED % seq, timeout=TIMEOUT_MS)
    return page.evaluate(RUN_INFO)


def check_scheduled_equals_received(page, run: dict) -> np.ndarray:
    """What the player handed to the audio side is exactly the PCM it received (int16 / 32768, odd bytes
    carried across reads); returns that PCM."""
    received = np.frombuffer(base64.b64decode(page.evaluate(RECEIVED)), dtype="<i2")
    scheduled = np.asarray(page.evaluate(SCHEDULED), dtype=np.float32)
    assert received.size == run["samples"] == scheduled.size > 0
    np.testing.assert_array_equal(scheduled, received.astype(np.float32) / 32768)
    return received


# the bytes behind a URL the page holds (the final WAV's blob: URL), base64
FETCH_BASE64 = """async (url) => { const b = new Uint8Array(await (await fetch(url)).arrayBuffer()); let s = '';
  for (let i = 0; i < b.length; i += 0x8000) s += String.fromCharCode.apply(null, b.subarray(i, i + 0x8000));
  return btoa(s); }"""


def speech(url: str, auth: tuple[str, str] | None = LOGIN, **body) -> httpx.Response:
    return httpx.post(f"{url}/studio/speech", json={"text": TEXT, "seed": SEED, **body}, auth=auth, timeout=120)


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


def test_reference_paths_are_confined_and_the_routes_need_the_login(studio):
    url, uploads = studio
    uploads.mkdir(parents=True, exist_ok=True)
    link = uploads / "link.wav"
    link.symlink_to("/etc/passwd")  # inside the folder by name, outside once resolved
    for bad in ("/etc/passwd", "../../x", str(link), str(uploads), str(REPO / "app.py"), "assets/../app.py"):
        r = speech(url, prompt_audio=bad, prompt_text=PROMPT_TEXT)
        assert r.status_code == 400, (bad, r.status_code, r.text)
        err = r.json()["error"]
        assert err["message"].startswith("unknown reference file") and err["param"] == "prompt_audio"
        assert "passwd" not in r.text and "/etc" not in r.text and str(uploads) not in r.text and "app.py" not in r.text
    assert speech(url, prompt_audio=None).status_code == 400
    assert speech(url, prompt_audio=str(PROMPT_WAV), mode="sing").json()["error"]["param"] == "mode"
    # the page's own route answers in the browser's language: the same status, code and field
    en, zh = (httpx.post(f"{url}/studio/speech", json={"text": " ", "prompt_audio": str(PROMPT_WAV)}, auth=LOGIN,
                         headers=lang, timeout=60) for lang in ({}, {"Accept-Language": "zh-CN,zh;q=0.9"}))
    assert en.status_code == zh.status_code == 400 and en.json()["error"]["message"].startswith("Type the text")
    assert zh.json()["error"]["message"].startswith("请输入要朗读的文本"), zh.text
    assert {k: v for k, v in en.json()["error"].items() if k != "message"} == {
        k: v for k, v in zh.json()["error"].items() if k != "message"}
    # an example asset is a valid reference; without the page's login (or HTTP Basic) nothing is spoken
    assert speech(url, auth=None, prompt_audio=str(PROMPT_WAV), prompt_text=PROMPT_TEXT).status_code == 401
    r = speech(url, prompt_audio=str(PROMPT_WAV), prompt_text=PROMPT_TEXT)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/pcm", r.text
    rid, ttfa_ms = r.headers["x-request-id"], float(r.headers["x-ttfa-ms"])
    assert r.headers["x-seed"] == str(SEED) and ttfa_ms > 0 and len(r.content) % 2 == 0 and r.content
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).status_code == 200
    # the player's Stop: behind the login too; an ended request has nothing to stop
    def stop(rid: str, auth: tuple[str, str] | None = LOGIN) -> httpx.Response:
        return httpx.post(f"{url}/studio/requests/{rid}/stop", auth=auth, timeout=10)

    assert stop(rid, auth=None).status_code == 401
    assert stop(rid).json()["error"]["code"] == "unknown_request" and stop(rid).status_code == 404
    assert httpx.get(f"{url}/studio/requests/{rid}", auth=LOGIN, timeout=10).status_code in (404, 405)  # no route
    assert health(url)["ready"]


def _wav_pcm(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24_000, 1, 2)
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


@pytest.mark.slow
def test_click_to_sound(studio, page):
    started = health(studio[0])["requests"]["started"]
    runs = []
    for _ in range(N_LOW_LATENCY):
        run = play_low_latency(page)
        # localhost is a secure context: the AudioWorklet path; it played every sample, without a gap
        assert run["state"] == "done" and run["mode"] == "worklet", run
        assert run["underruns"] == 0 and run["playedFrames"] == run["samples"], run
        runs.append(run)
    # the player ran each request once
    assert health(studio[0])["requests"]["started"] == started + N_LOW_LATENCY
    overheads = [r["t"]["firstSound"] - r["t"]["click"] - r["ttfa"] for r in runs]
    for r, over in zip(runs, overheads, strict=True):
        t = {k: round(v - r["t"]["click"]) for k, v in r["t"].items() if v is not None}
        print(f"\nlow-latency: click→first byte {t['firstByte']} ms → first sound {t['firstSound']} ms, server TTFA "
              f"{r['ttfa']:.0f} ms (+{over:.0f} ms), server handler {r['server']['handlerMs']:.0f} ms, "
              f"{r['buffers']} reads, {r['underruns']} underruns; timeline {t}")
    sound_ms = statistics.median(r["t"]["firstSound"] - r["t"]["click"] for r in runs)
    print(f"low-latency median: click→sound {sound_ms:.0f} ms, +{statistics.median(overheads):.0f} ms over the "
          "server TTFA")

    last = runs[-1]
    # audio really ran: the context is running and its clock passed the first buffer's start
    assert last["contextState"] == "running" and last["currentTime"] > last["firstStartS"] > 0, last
    for r in runs:  # causal order on every run: click, then the server's first audio reaches the client, then sound
        t = r["t"]
        assert t["click"] <= t["firstByte"] <= t["firstSound"], t
        assert t["firstByte"] - t["click"] >= r["ttfa"] - 1, (t, r["ttfa"])  # server TTFA rounds to 1 ms
    LATENCY_REPORT.parent.mkdir(exist_ok=True)
    LATENCY_REPORT.write_text(json.dumps({
        "budget_ms": BUDGET_MS, "median_overhead_ms": statistics.median(overheads), "overheads_ms": overheads,
        "within_budget": statistics.median(overheads) <= BUDGET_MS, "low_latency_click_to_sound_ms": sound_ms,
        "cores": {"server": CORES[0], "browser": CORES[1]}, "load_avg": os.getloadavg()}, indent=1) + "\n")

    received = check_scheduled_equals_received(page, last)

    # afterwards the page shows the final WAV, the stats line and details of that request (one gr.Audio, one
    # stats line, one details JSON), and the panel row
    page.wait_for_function("() => (document.querySelector('#stats')?.innerText || '').includes('low-latency')",
                           timeout=30_000)
    stats = page.locator("#stats").inner_text()
    assert "TTFA" in stats and "click → first byte" in stats and f"seed {SEED}" in stats, stats
    assert page.locator("#final_out").is_visible()
    page.locator("#details_box .label-wrap").click()  # the details accordion, closed by default
    details = page.locator("#details").text_content()
    for fact in (last["requestId"], "webaudio", "first_sound_ms", str(received.size)):
        assert fact in details, (fact, details)
    # ... and the final WAV shown afterwards holds the very PCM the server sent: the bytes the page played
    link = page.locator("#final_out a[download]")
    assert link.get_attribute("download") == "hello-there-how-are-you-today.wav"
    final = _wav_pcm(base64.b64decode(page.evaluate(FETCH_BASE64, link.get_attribute("href"))))
    np.testing.assert_array_equal(final, received)
    # ... which is what the server sends for this request (same inputs and seed: the same PCM)
    again = speech(studio[0], prompt_audio=str(PROMPT_WAV), prompt_text=PROMPT_TEXT)
    assert again.status_code == 200, again.text
    np.testing.assert_array_equal(final, np.frombuffer(again.content, dtype="<i2"))
    line = page.locator("#studio_player_line").inner_text()
    assert line.startswith("✔ click → first byte") and "first sound" in line and "server TTFA" in line, line
    page.wait_for_function(f"() => document.querySelector('#latency_table')?.innerText.includes('"
                           f"{last['requestId'][:8]}')", timeout=30_000)
    SCREENSHOT.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOT), full_page=True)


@pytest.mark.slow
def test_the_take_comes_down_once(studio, page):
    """A low-latency take's audio is not sent back: nothing is uploaded from Generate until the page shows the
    take, whose final WAV is the page's own blob: URL holding the PCM received (the previous take's URL revoked).
    Another download format uploads it then, once per take (the server converts it)."""
    uploads = []
    page.on("request", lambda r: uploads.append(r.url) if r.method == "POST" and "/upload" in r.url else None)
    first = page.locator("#final_out a[download]").get_attribute("href") if page.locator(
        "#final_out a[download]").count() else None
    run = play_low_latency(page)
    assert run["state"] == "done", run
    page.wait_for_function(f"() => (document.querySelector('#details')?.textContent || '').includes("
                           f"'{run['requestId']}') && document.querySelector('#final_out a[download]')",
                           timeout=30_000)
    href = page.locator("#final_out a[download]").get_attribute("href")
    assert href.startswith("blob:") and uploads == [], (href, uploads)
    received = np.frombuffer(base64.b64decode(page.evaluate(RECEIVED)), dtype="<i2")
    np.testing.assert_array_equal(_wav_pcm(base64.b64decode(page.evaluate(FETCH_BASE64, href))), received)
    if first and first.startswith("blob:"):  # the take it replaced: its URL is revoked
        assert page.evaluate("async (u) => { try { await fetch(u); return true; } catch (e) { return false; } }",
                             first) is False
    for fmt in ("flac", "mp3"):  # another format: the take goes up once, then the server converts it
        page.locator("#download_format input").click()
        page.get_by_role("option", name=fmt, exact=True).click()
        for _ in range(30):  # the button's file, once converted: the take as `fmt`
            page.wait_for_timeout(1000)
            with page.expect_download(timeout=30_000) as got:
                page.locator("#download_take").click()
            if got.value.suggested_filename.endswith(f".{fmt}"):
                break
        assert got.value.suggested_filename == f"hello-there-how-are-you-today.{fmt}", got.value.suggested_filename
    assert len(uploads) == 1, uploads
    page.locator("#download_format input").click()  # back to WAV: the button offers the page's own file
    page.get_by_role("option", name="wav", exact=True).click()
    for _ in range(30):
        page.wait_for_timeout(1000)
        with page.expect_download(timeout=30_000) as got:
            page.locator("#download_take").click()
        if got.value.suggested_filename.endswith(".wav"):
            break
    assert got.value.suggested_filename == "hello-there-how-are-you-today.wav", got.value.suggested_filename
    np.testing.assert_array_equal(_wav_pcm(Path(got.value.path()).read_bytes()), received)
    assert len(uploads) == 1, uploads


@pytest.mark.slow
def test_stop_mid_stream_aborts_the_request(studio, page):
    url, _ = studio
    before = health(url)["requests"]["outcomes"]["cancelled"]
    page.locator("#text textarea").fill(LONG_TEXT)
    seq = page.evaluate(f"{LAST} ? {LAST}.seq : 0") + 1
    page.locator("#go").click()
    page.wait_for_function(f"() => {LAST} && {LAST}.seq === {seq} && {LAST}.t.firstSound !== null", timeout=TIMEOUT_MS)
    assert health(url)["active_streams"] == 1
    stop_while_made(page, seq, 10_000)
    # the body ended by the server's Stop (or the fetch aborted, had the Stop been slow), the queue dropped
    page.wait_for_function(f"() => ({LAST}.aborted || {LAST}.t.end !== null) && {LAST}.flushed", timeout=10_000)
    run = page.evaluate(RUN_INFO)
    assert run["state"] == "stopped", run
    assert page.locator("#studio_player_line").inner_text().startswith("Stopped")
    # what came before Stop is the take: the page's final WAV, and a stats line that says so
    page.wait_for_function("() => /^Stopped: kept [0-9.]+ s of audio · seed [0-9]+/.test("
                           "document.querySelector('#stats')?.innerText || '')", timeout=30_000)
    kept = page.locator("#final_out a[download]")
    raw = base64.b64decode(page.evaluate(RECEIVED))
    got = np.frombuffer(raw[:len(raw) // 2 * 2], "<i2")  # a Stop may cut a sample in two
    kept_pcm = _wav_pcm(base64.b64decode(page.evaluate(FETCH_BASE64, kept.get_attribute("href"))))
    assert kept_pcm.size > 0
    np.testing.assert_array_equal(kept_pcm, got)
    deadline = time.monotonic() + 30
    while (h := health(url))["active_streams"] or h["lm_unfinished"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.2)
    assert h["requests"]["outcomes"]["cancelled"] == before + 1, h["requests"]
    # the player told the server before it hung up: the panels' row of that request says "stopped" (a closed
    # tab's request says "cancelled")
    rid = run["requestId"][:REQUEST_ID_CHARS]  # the table's cells: request, ended (hh:mm:ss), outcome, ...
    page.wait_for_function(f"() => /{rid}\\s+[0-9:]+\\s+stopped\\b/.test("
                           "document.querySelector('#latency_table')?.innerText || '')", timeout=30_000)
    page.locator("#text textarea").fill(TEXT)  # the server keeps serving
    assert play_low_latency(page)["state"] == "done"


def test_engine_death_mid_take_keeps_the_audio_and_says_so(studio, page):
    """kill -9 of the EngineCore while a take plays: the page keeps what it received as the final WAV and says
    the engine stopped and is restarting (not "network error"); its status line says so until the engine is
    ready again, then the page serves."""
    import re
    import signal

    from bench.engine_kill import engine_processes
    from bench.soak import server_process

    url, _ = studio
    page.locator("#text textarea").fill(LONG_TEXT)
    seq = page.evaluate(f"{LAST} ? {LAST}.seq : 0") + 1
    page.locator("#go").click()
    page.wait_for_function(f"() => {LAST} && {LAST}.seq === {seq} && {LAST}.t.firstSound !== null", timeout=TIMEOUT_MS)
    (engine,), _ = engine_processes(server_process(url))
    os.kill(engine.pid, signal.SIGKILL)
    page.wait_for_function(f"() => {LAST}.seq === {seq} && /mid-take/.test({LAST}.error || '')", timeout=60_000)
    run = page.evaluate(RUN_INFO)
    assert run["state"] == "error" and "engine stopped mid-take and is restarting" in run["error"], run
    assert "received are kept" in page.locator("#studio_player_line").inner_text()
    kept = page.locator("#final_out a[download]")
    raw = base64.b64decode(page.evaluate(RECEIVED))
    kept_pcm = _wav_pcm(base64.b64decode(page.evaluate(FETCH_BASE64, kept.get_attribute("href"))))
    assert kept_pcm.size > 0
    np.testing.assert_array_equal(kept_pcm, np.frombuffer(raw[:len(raw) // 2 * 2], "<i2"))
    status = "document.querySelector('#status')?.innerText || ''"
    page.wait_for_function(f"() => /engine died.*restarting/.test({status})", timeout=30_000)
    deadline = time.monotonic() + 300
    while True:  # (the page's line first: once it says ready, /health must too)
        line = page.evaluate(f"() => {status}")
        if health(url)["ready"]:
            break
        assert not re.search(r"Status:\s*ready", line) and time.monotonic() < deadline, line
        time.sleep(1)
    page.wait_for_function(f"() => /Status:\\s*ready/.test({status})", timeout=30_000)
    page.locator("#text textarea").fill(TEXT)
    assert play_low_latency(page)["state"] == "done"


@pytest.mark.slow
def test_without_audio_worklet_the_page_schedules_buffers(studio, browser):
    """Plain http on a LAN address is no secure context: no AudioWorklet. The fallback schedules
    AudioBufferSourceNodes on the page; the same exactness holds (its latency is printed, not asserted)."""
    no_worklet = "Object.defineProperty(BaseAudioContext.prototype, 'audioWorklet', {get: () => undefined});"
    page = open_studio(browser, studio[0], no_worklet, SCHEDULED_HOOK)
    try:
        run = play_low_latency(page)
        assert run["state"] == "done" and run["mode"] == "buffers" and run["underruns"] == 0, run
        check_scheduled_equals_received(page, run)
        t = {k: round(v - run["t"]["click"]) for k, v in run["t"].items() if v is not None}
        print(f"\nbuffers fallback: click→sound {t['firstSound']} ms, server TTFA {run['ttfa']:.0f} ms, handler "
              f"{run['server']['handlerMs']:.0f} ms; timeline {t}")
    finally:
        page.close()
