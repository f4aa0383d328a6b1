"""The page's low-latency player routes: raw PCM for WebAudio, and a finished request's stats (docs/design.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from gradio.utils import get_upload_folder
from pydantic import BaseModel, ConfigDict, Field

from app.message import lang_of, say
from app.server.errors import ApiError
from app.server.identity import caller_of
from app.server.speech import prepare_or_raise, speech_response
from app.server.studio_timings import PageTimings
from app.service.owners import ARRIVAL_KEY
from app.service.prepare import SpeechInputs
from app.service.service import ASSETS_DIR, StudioService

STUDIO_PARAMS = {"reference": "prompt_audio"}  # prepare()'s field names -> this route's


class StudioSpeech(BaseModel):
    """The page's synthesis inputs (as the Gradio API's `synthesize`): streamed, or whole with `stream` off."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(max_length=100_000)
    prompt_audio: str | None = Field(None, max_length=4096, description="server path of the uploaded reference")
    prompt_text: str | None = Field(None, max_length=10_000)  # null: a hidden or cleared textbox
    mode: str = Field("zero_shot", max_length=32)
    instruct_text: str | None = Field(None, max_length=10_000)
    voice: str | None = Field(None, max_length=200)
    seed: float | None = None
    dialogue: bool = False  # `text` is a script: "[alice] … [bob] …" (app/service/dialogue.py)
    stream: bool = True  # off: the body comes whole once made, and `speed` applies
    speed: float = 1.0


def reference_path(raw: str) -> Path:
    """`raw` resolved (symlinks followed: a link out of the folders is refused), if it is a file inside Gradio's
    upload folder (where the page's uploads go) or assets/; else ApiError 400."""
    try:
        path = Path(raw).resolve(strict=True)
    except (OSError, RuntimeError, ValueError):  # missing, loop, NUL byte
        path = None
    # Gradio's upload folder: GRADIO_TEMP_DIR, else <tempdir>/gradio (not resolved there)
    for root in (Path(get_upload_folder()).resolve(), ASSETS_DIR.resolve()):
        if path is not None and path.is_relative_to(root) and path != root and path.is_file():
            return path
    raise ApiError(400, "unknown reference file: upload the reference recording again, or pick an example",
                   param="prompt_audio", code="unknown_reference")


class PageStreams:
    """ASGI middleware: at Ctrl+C / SIGTERM (`ending` set) the open pages' long-lived Gradio streams (the queue's
    messages, the heartbeat) end, which uvicorn's graceful shutdown would wait on: they never end by themselves,
    and mounted, nothing ends them (Gradio's own stop only follows its `launch()`)."""

    def __init__(self, app: Any, ending: asyncio.Event) -> None:
        self.app, self.ending = app, ending

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(LONG_STREAMS):
            return await self.app(scope, receive, send)
        started = False

        async def sending(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        inner = asyncio.ensure_future(self.app(scope, receive, sending))
        ending = asyncio.ensure_future(self.ending.wait())
        try:
            await asyncio.wait((inner, ending), return_when=asyncio.FIRST_COMPLETED)
        finally:
            ending.cancel()
            if not inner.done():  # shutting down (or this request cancelled): the stream ends here
                inner.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await inner
                if started and self.ending.is_set():
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        if not inner.cancelled():
            inner.result()  # the stream's own error, raised as if unwrapped


# the page's streams that stay open while the tab is: Gradio's queue messages and its heartbeat (SSE)
LONG_STREAMS = ("/gradio_api/queue/data", "/gradio_api/heartbeat/")


def quiet_access_log() -> None:
    """Keep uvicorn's access log to requests a person reads: not the page's own polling (panel timer ticks,
    queue and upload progress: a line per second per open tab) unless they failed."""
    def page_polling(record: logging.LogRecord) -> bool:  # False: leave the record out
        args = record.args if isinstance(record.args, tuple) else ()
        # uvicorn's access record: (client, method, path, http version, status)
        if len(args) == 5 and isinstance(args[2], str) and isinstance(args[4], int) and args[4] < 400:
            return not args[2].startswith(QUIET_PATHS)
        return True

    logging.getLogger("uvicorn.access").addFilter(page_polling)


# the page's polling and asset routes (Gradio's), left out of the access log when they succeed
QUIET_PATHS = ("/gradio_api/run/predict", "/gradio_api/queue/", "/gradio_api/upload_progress",
               "/gradio_api/heartbeat/", "/assets/", "/static/", "/theme.css", "/gradio_api/stream/")


def add_studio_routes(app: FastAPI, service: StudioService, stops: weakref.WeakValueDictionary[str, asyncio.Event],
                      timings: PageTimings) -> None:
    """Add /studio/speech, the Stop of a page take and its word timings to `app` (before Gradio is mounted at
    "/"). `stops`: the running page takes' Stop events by request id, from this route and the WebSocket door; an
    entry goes with its take (the event is held only by the take's stream: weak values). `timings`: the page
    takes' word timings, from both doors too (studio_timings.py)."""
    router = APIRouter(prefix="/studio", tags=["studio"], include_in_schema=False)

    @router.post("/speech")
    async def studio_speech(body: StudioSpeech, request: Request):
        """Speak `text` in the reference voice; the body is raw PCM (s16le, mono, 24 kHz) as it is made."""
        arrived = request.scope.get("state", {}).get(ARRIVAL_KEY, time.monotonic())  # AccessLimits
        raw = body.prompt_audio
        reference = (lambda: reference_path(raw)) if raw else None  # checked after the inputs (ApiError 400)
        caller = caller_of(request.scope)
        try:
            prepared = await prepare_or_raise(service, SpeechInputs(
                text=body.text, voice=body.voice or None, reference=reference, transcript=body.prompt_text,
                mode=body.mode, instruct_text=body.instruct_text, seed=body.seed, stream=body.stream, speed=body.speed,
                dialogue=body.dialogue, owner=caller.owner), STUDIO_PARAMS)
            stop = stops[prepared.request.request_id] = asyncio.Event()  # set by studio_stop below
            response = await timings.speak(prepared, caller.owner, lambda tap: speech_response(
                service, prepared.request, "pcm", prepared=prepared, tap=tap, caller=caller, stop=stop,
                headers={"X-Reference-Ms": f"{prepared.reference_s * 1e3:.1f}"}, params=STUDIO_PARAMS))
        except ApiError as e:  # the page's own route: the same status and code, the message in its language
            e.message = say(e.message, lang_of(request))
            raise
        # arrival of the HTTP request -> these headers: the server's whole share of click -> first byte
        response.headers["X-Handler-Ms"] = f"{(time.monotonic() - arrived) * 1e3:.1f}"
        return response

    @router.post("/requests/{request_id}/stop")
    async def studio_stop(request_id: str) -> dict:
        """The low-latency player's Stop, sent before it closes the stream (or the socket): the request's record
        then says "stopped" (as the standard player's Stop), not "cancelled" (a closed tab). 404 once it has ended."""
        stop = stops.get(request_id)
        if stop is None:
            raise ApiError(404, "no running page take with this id", param="request_id", code="unknown_request")
        stop.set()
        return {"request_id": request_id, "stopped": True}

    app.include_router(router)
    app.include_router(timings.router())
