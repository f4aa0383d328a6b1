"""The page's low-latency player routes: raw PCM for WebAudio, and a finished request's stats (docs/design.md)."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from gradio.utils import get_upload_folder
from pydantic import BaseModel, ConfigDict, Field
from starlette.routing import Mount

from app.engine.prepare import SpeechInputs
from app.engine.service import ASSETS_DIR, StudioService
from app.server.errors import ApiError
from app.server.identity import caller_of
from app.server.limits import ARRIVAL_KEY
from app.server.speech import prepare_or_raise, speech_response
from app.ui.i18n import lang_of, say

STUDIO_PARAMS = {"reference": "prompt_audio"}  # prepare()'s field names -> this route's


class StudioSpeech(BaseModel):
    """The page's synthesis inputs (as the Gradio `synthesize` event's, without speed/stream)."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(max_length=100_000)
    prompt_audio: str | None = Field(None, max_length=4096, description="server path of the uploaded reference")
    prompt_text: str | None = Field(None, max_length=10_000)  # null: a hidden or cleared textbox
    mode: str = Field("zero_shot", max_length=32)
    instruct_text: str | None = Field(None, max_length=10_000)
    voice: str | None = Field(None, max_length=200)
    seed: float | None = None
    dialogue: bool = False  # `text` is a script: "[alice] … [bob] …" (app/engine/dialogue.py)


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


def end_page_streams(app: FastAPI) -> None:
    """At Ctrl+C / SIGTERM, on the serving loop: end the open pages' long-lived streams (Gradio's heartbeat
    and queue SSE), which uvicorn's graceful shutdown would wait on; mounted, nothing sets Gradio's own
    `stop_event` (only `Blocks.close()` after `launch()` does)."""
    for route in app.routes:
        if isinstance(route, Mount) and route.path == "":  # the page: a gradio.routes.App (stop_event from init)
            route.app.get_blocks()._queue.close()  # its /queue/data streams end at their next wake-up
            route.app.stop_event.set()  # the heartbeat streams end now


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


def add_studio_routes(app: FastAPI, service: StudioService,
                      stops: weakref.WeakValueDictionary[str, asyncio.Event]) -> None:
    """Add /studio/speech and the Stop of a page take to `app` (before Gradio is mounted at "/"). `stops`: the
    running page takes' Stop events by request id, from this route and the WebSocket door; an entry goes with
    its take (the event is held only by the take's stream: weak values)."""
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
                mode=body.mode, instruct_text=body.instruct_text, seed=body.seed, stream=True,
                dialogue=body.dialogue, owner=caller.owner), STUDIO_PARAMS)
            stop = asyncio.Event()  # set by POST /studio/requests/{id}/stop: the player's Stop, before it hangs up
            stops[prepared.request.request_id] = stop
            response = await speech_response(service, prepared.request, "pcm", prepared=prepared,
                                             headers={"X-Reference-Ms": f"{prepared.reference_s * 1e3:.1f}"},
                                             caller=caller, stop=stop, params=STUDIO_PARAMS)
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
            raise ApiError(404, "no running page take with this id", param="request_id",
                           code="unknown_request")
        stop.set()
        return {"request_id": request_id, "stopped": True}

    app.include_router(router)
