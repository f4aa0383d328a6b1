"""Word timings at the doors voice agents speak (docs/api.md): `timestamps` on `/v1/audio/speech`'s SSE stream, read by
the official `openai` SDK, and `sync_alignment` on ElevenLabs' sockets, on the shared CPU server whose [asr] Whisper
is the random tiny one (conftest's studio_cpu): its times are arbitrary, so what is checked is their shape (one per
word, monotone, inside the take, offsets, the text) and that the audio is the same as without."""

from __future__ import annotations

import asyncio
import base64

import pytest
import test_agent_doors as doors
from studio import save_voice
from test_agent_doors import SDK_FIRST, SDK_PIECES, TEXT, el_session, el_url, sse_events

from app.model.words import split_words

base, oai = doors.base, doors.oai  # the same shared server and OpenAI client as the doors' tests


@pytest.fixture(scope="module")
def voice(base) -> str:
    return save_voice(base, "timing-voice")["id"]


def assert_monotone_inside(starts: list[int], ends: list[int], lo_ms: float, hi_ms: float) -> None:
    """Each [start, end] in order, not overlapping the next, inside [lo_ms, hi_ms] (1 ms for rounding)."""
    assert starts == sorted(starts) and all(s <= e for s, e in zip(starts, ends, strict=True))
    assert all(e <= s for e, s in zip(ends, starts[1:], strict=False))
    assert all(lo_ms - 1 <= s and e <= hi_ms + 1 for s, e in zip(starts, ends, strict=True)), (starts, ends, hi_ms)


def test_openai_sdk_sse_timestamps(oai, voice):
    """`timestamps: true` (extra_body): a speech.audio.timestamps event per sentence before speech.audio.done; one
    word per input word, monotone and inside the take; characters inside their sentence; the same PCM as without."""
    args = dict(model="gpt-4o-mini-tts", voice=voice, input=TEXT, response_format="pcm", stream_format="sse")
    with oai.audio.speech.with_streaming_response.create(**args, extra_body={"seed": 7}) as r:
        plain = b"".join(base64.b64decode(e["audio"]) for e in sse_events(r.iter_lines()) if "audio" in e)
    with oai.audio.speech.with_streaming_response.create(**args, extra_body={"seed": 7, "timestamps": True}) as r:
        events = sse_events(r.iter_lines())
    assert events[0]["type"] == "speech.audio.delta" and events[-1]["type"] == "speech.audio.done"
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert pcm == plain and len(pcm) > 24000
    stamps = [e for e in events if e["type"] == "speech.audio.timestamps"]
    assert len(stamps) == 1 and "note" not in stamps[0], stamps  # the official split: one segment, aligned
    words = [w for e in stamps for w in e["words"]]
    assert [w["word"] for w in words] == [w.text for w in split_words(TEXT)]
    assert all(set(w) == {"word", "start_ms", "end_ms", "interpolated"} for w in words)
    take_ms = len(pcm) / 2 / 24
    assert_monotone_inside([w["start_ms"] for w in words], [w["end_ms"] for w in words], 0, take_ms)
    assert stamps[0]["start_ms"] == 0 and stamps[-1]["end_ms"] == round(take_ms)
    for e in stamps:
        c = e["chars"]
        assert "".join(c["chars"]) == e["text"] and len(c["charStartTimesMs"]) == len(c["charDurationsMs"])
        ends = [s + d for s, d in zip(c["charStartTimesMs"], c["charDurationsMs"], strict=True)]
        assert_monotone_inside(c["charStartTimesMs"], ends, e["start_ms"], e["end_ms"])


def test_sse_timestamps_of_a_dialogue_sentence_by_sentence(oai, voice):
    """Two turns (two segments): two events in order, the second offset by the first's audio; whole (speed 0.9):
    the events come after the one delta."""
    turns = ["Hello there, how are you today?", "The weather is lovely."]
    with oai.audio.speech.with_streaming_response.create(
            model="cosyvoice2", voice=voice, input=f"{turns[0]} [{voice}] {turns[1]}", response_format="wav",
            speed=0.9, stream_format="sse", extra_body={"seed": 7, "timestamps": True, "dialogue": True}) as r:
        events = sse_events(r.iter_lines())
    assert [e["type"] for e in events] == ["speech.audio.delta", *["speech.audio.timestamps"] * 2, "speech.audio.done"]
    first, second = events[1:3]
    assert [e["text"] for e in (first, second)] == turns and second["start_ms"] == first["end_ms"] > 0
    for e, turn in zip((first, second), turns, strict=True):
        assert [w["word"] for w in e["words"]] == [w.text for w in split_words(turn)]
    words = first["words"] + second["words"]
    take_ms = (len(base64.b64decode(events[0]["audio"])) - 44) / 2 / 24  # the WAV's 44-byte header
    assert_monotone_inside([w["start_ms"] for w in words], [w["end_ms"] for w in words], 0, take_ms)


def test_elevenlabs_sync_alignment(base, voice):
    """`sync_alignment=true`: the take's characters as `alignment` (and `normalizedAlignment`) on a message with no
    audio before isFinal: the text as sent, monotone, inside the audio and ending where it ends (pipecat's clock
    advances by each alignment's end); the audio is the same as without. Multi-stream: the message has contextId."""
    msgs = [SDK_FIRST, *({"text": p, "try_trigger_generation": True} for p in SDK_PIECES), {"text": ""}]
    _, plain, _, _ = asyncio.run(el_session(el_url(base, voice), msgs))
    got, audio, code, _ = asyncio.run(el_session(el_url(base, voice, "output_format=pcm_24000&seed=7&"
                                                               "sync_alignment=true"), msgs))
    assert code == 1000 and got[-1] == {"isFinal": True} and audio == plain
    aligned = [m for m in got if "alignment" in m]
    assert len(aligned) == 1 and aligned[0]["audio"] == "" and got.index(aligned[0]) == len(got) - 2, got
    a = aligned[0]["alignment"]
    assert a == aligned[0]["normalizedAlignment"] and "".join(a["chars"]) == "".join(SDK_PIECES)
    ends = [s + d for s, d in zip(a["charStartTimesMs"], a["charDurationsMs"], strict=True)]
    audio_ms = len(audio) / 2 / 24
    assert_monotone_inside(a["charStartTimesMs"], ends, 0, audio_ms) and abs(ends[-1] - audio_ms) <= 1
    turn = [{"text": " ", "context_id": "c1"}, {"text": "Fine, thanks. ", "context_id": "c1"},
            {"context_id": "c1", "close_context": True}, {"close_socket": True}]
    got, _, code, _ = asyncio.run(el_session(el_url(base, voice, "output_format=pcm_16000&sync_alignment=true",
                                                    multi=True), turn))
    aligned = [m for m in got if "alignment" in m]
    assert code == 1000 and len(aligned) == 1 and aligned[0]["contextId"] == "c1", got
    assert "".join(aligned[0]["alignment"]["chars"]) == "Fine, thanks. " and got[-1]["isFinal"]
