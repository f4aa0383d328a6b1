"""The doors voice agents already speak, on a real `python app.py` (tiny model, vLLM-CPU engine): OpenAI's
`stream_format: "sse"` read by the official `openai` SDK."""

from __future__ import annotations

import base64
import json
import time

import httpx
import pytest
from studio import save_voice

TEXT = "Hello there, how are you today? The weather is lovely."


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


def test_sse_client_that_leaves_aborts_its_take(base, voice):
    body = {"model": "cosyvoice2", "voice": voice, "input": TEXT * 4, "stream_format": "sse", "response_format": "pcm"}
    with httpx.stream("POST", base + "/v1/audio/speech", json=body, timeout=120) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first event, then leave
    wait_idle(base)
