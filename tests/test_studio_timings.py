"""The page's word timings route (app/server/studio_timings.py): a take's sentences as NDJSON lines as they are
aligned, then its SRT and WebVTT; a streamed take stopped before its final chunk ends after the sentences it
finished; an unavailable aligner is one note; an unknown id and another caller's take are refused (404). The
takes come from a test route that taps the example recordings' chunks into `PageTimings.speak`, as /studio/speech
does with a real take; the aligner is the random tiny Whisper (app/model/random/whisper.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.testclient import TestClient
from test_take_timings import EN, ZH, aligner, chunks_of, waves  # noqa: F401 (fixtures)

from app.config import AsrConfig, ConfigError
from app.message import say
from app.model.words import split_words
from app.server.errors import install_error_handlers
from app.server.speech import ClosingStreamingResponse
from app.server.studio_timings import PageTimings, page_timings_off
from app.service.owners import CALLER_KEY, Caller, Owner
from app.service.timings import Aligner

ALICE, BOB = "alice", "bob"


def make_app(timing_aligner: Aligner, all_waves, off: str = "") -> FastAPI:
    """The timings route, a gate that names the caller from the X-Owner header (X-Admin: 1 for the admin), and
    POST /take/{id}?stream=0|1&chunks=N: a take of EN then ZH tapped into PageTimings.speak; streamed, only its
    first N chunks (then the body ends: a stopped take), else all of them before the answer (a whole take)."""
    segments = [SimpleNamespace(text=EN), SimpleNamespace(text=ZH)]
    service = SimpleNamespace(aligner=timing_aligner, synth=SimpleNamespace(segments=lambda req: segments))
    timings = PageTimings(service, off)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(timings.router())

    @app.middleware("http")
    async def gate(request: Request, call_next):
        owner = Owner(request.headers.get("x-owner", ALICE))
        request.scope.setdefault("state", {})[CALLER_KEY] = Caller(owner, admin=request.headers.get("x-admin") == "1")
        return await call_next(request)

    @app.post("/take/{rid}")
    async def take(rid: str, request: Request, stream: int = 0, chunks: int = 99) -> Response:
        chunk_list = chunks_of(all_waves)[:chunks]
        prepared = SimpleNamespace(request=SimpleNamespace(request_id=rid))
        caller = request.scope["state"][CALLER_KEY]

        async def speak(tap):
            if not stream:
                for c in chunk_list:
                    tap(c)
                return Response(b"whole")

            async def body():
                for c in chunk_list:
                    tap(c)
                    yield b"x"

            async def closed() -> None:
                pass

            return ClosingStreamingResponse(body(), on_close=closed)

        return await timings.speak(prepared, caller.owner, speak)

    return app


def lines(client: TestClient, rid: str, **headers) -> list[dict]:
    r = client.get(f"/studio/requests/{rid}/timings", headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in r.text.splitlines()]


def test_a_take_s_sentences_then_its_subtitles(aligner, waves):  # noqa: F811
    with TestClient(make_app(aligner, waves)) as client:
        assert client.post("/take/t1").status_code == 200
        got = lines(client, "t1")
        again = lines(client, "t1")  # a second reader (a reload) gets the same
    assert got == again
    *sentences, done = got
    assert [s["text"] for s in sentences] == [EN, ZH] and done["type"] == "done"
    words = [w for s in sentences for w in s["words"]]
    assert [w["word"] for w in words] == [w.text for w in split_words(EN) + split_words(ZH)]
    take_ms = round(sum(map(len, waves)) / 24)
    starts = [w["start_ms"] for w in words]
    assert starts == sorted(starts) and all(0 <= w["start_ms"] <= w["end_ms"] <= take_ms for w in words)
    assert done["vtt"].startswith("WEBVTT\n\n") and "fox" in done["srt"] and "fox" in done["vtt"]
    assert done["srt"].startswith("1\n00:00:0")


def test_a_stopped_streamed_take_ends_after_its_finished_sentences(aligner, waves):  # noqa: F811
    """Sentence 1's chunks and sentence 2's first, then the body ends (no final chunk): sentence 1 only."""
    with TestClient(make_app(aligner, waves)) as client:
        r = client.post("/take/t2?stream=1&chunks=4")
        assert r.status_code == 200 and r.content == b"xxxx"
        *sentences, done = lines(client, "t2")
    assert [s["text"] for s in sentences] == [EN] and done["type"] == "done" and "fox" in done["srt"]


def test_an_unavailable_aligner_is_one_note(waves):  # noqa: F811
    off = Aligner(AsrConfig(enabled=False))
    with TestClient(make_app(off, waves)) as client:
        client.post("/take/t3")
        got = lines(client, "t3")
    assert len(got) == 2 and got[0]["words"] == [] and "[asr] enabled = false" in got[0]["note"]
    assert got[1] == {"type": "done", "srt": "", "vtt": "WEBVTT\n\n"}


def test_page_timings_off_on_a_cpu_say_why_once(aligner, waves):  # noqa: F811
    """`[asr] page_timings`: auto aligns page takes only where the aligner runs on a GPU; off or auto on a CPU, the
    take's route gives the reason once and its (empty) subtitles; on aligns them on a CPU too."""
    assert page_timings_off(AsrConfig(page_timings="on", device="cpu")) == ""
    assert page_timings_off(AsrConfig(enabled=False, device="cpu")) == ""  # the aligner's own reason says why
    assert "page_timings" in page_timings_off(AsrConfig(page_timings="off", device="cuda"))
    why = page_timings_off(AsrConfig(device="cpu"))
    assert "without a GPU" in why and 'page_timings = "on"' in why
    with pytest.raises(ConfigError, match="page_timings"):
        AsrConfig(page_timings="yes")
    with TestClient(make_app(aligner, waves, off=why)) as client:
        client.post("/take/t5")
        got = lines(client, "t5")
        zh = lines(client, "t5", **{"accept-language": "zh-CN,zh;q=0.9"})  # the page's language: the note in it
    assert got == [{"type": "speech.audio.timestamps", "words": [], "chars": got[0]["chars"], "note": why},
                   {"type": "done", "srt": "", "vtt": "WEBVTT\n\n"}], got
    assert zh[0]["note"] == say(why, "zh") != why and "page_timings" in zh[0]["note"] and zh[1:] == got[1:]


@pytest.mark.parametrize("who", ["unknown id", "another owner"])
def test_refused_404(aligner, waves, who):  # noqa: F811
    with TestClient(make_app(aligner, waves)) as client:
        client.post("/take/t4", headers={"x-owner": ALICE})
        if who == "unknown id":
            r = client.get("/studio/requests/nope/timings", headers={"x-owner": ALICE})
        else:
            r = client.get("/studio/requests/t4/timings", headers={"x-owner": BOB})
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_request", r.text
        assert lines(client, "t4", **{"x-owner": BOB, "x-admin": "1"})[-1]["type"] == "done"  # the admin may
