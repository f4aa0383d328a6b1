"""The page's low-latency player routes: raw PCM for WebAudio, and a finished request's stats.

    POST /studio/speech         {text, prompt_audio, prompt_text, mode, instruct_text, voice, seed}
                                -> raw PCM s16le mono 24 kHz, streamed as it is produced
    GET  /studio/requests/{id}  {request_id, line, notes, details}: the stats line and details of a
                                finished request (its metrics record), as the Gradio path shows them

The page (app/ui/player.js) calls these with relative URLs, so they work behind the Spaces proxy
and a root path. `prompt_audio` is a *server path*: the page's uploaded reference (the gr.Audio
value's `path`) or an example asset. It is accepted only if it resolves (symlinks followed) inside
Gradio's upload cache or assets/; anything else is 400 "unknown reference file", without echoing
the path. The speech route is decode -> `prepare` -> `speech_response`, the function
/v1/audio/speech streams with (admission, first chunk before the status, X-Request-Id / X-Seed /
X-TTFA-Ms / X-Queue-Ms headers, disconnect -> vLLM abort). Nothing is kept for the page: it builds
the final WAV from the PCM it played, and reads the stats from the request's metrics record
(`Metrics.record`, the ring buffer of recent requests) once the body has ended. These routes are
as open as the page itself: the optional bearer key guards /v1 only (the page never holds it).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from app.engine.inputs import InputError
from app.engine.prepare import SpeechInputs, prepare
from app.engine.service import ASSETS_DIR, NotReadyError, StudioService
from app.server.errors import ApiError
from app.server.speech import RETRY_AFTER_S, speech_response
from app.ui.handlers import ARRIVAL_KEY, request_details, stats_line

STUDIO_PARAMS = {"reference": "prompt_audio"}  # prepare()'s field names -> this route's
UNKNOWN_REFERENCE = "unknown reference file: upload the reference recording again, or pick an example"
REQUEST_ID_RE = re.compile(r"[0-9a-f]{32}")  # SynthesisRequest.request_id (uuid4 hex)


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


def upload_folder() -> Path:
    """Where Gradio keeps uploads (and its output cache): GRADIO_TEMP_DIR, else <tempdir>/gradio
    (`gradio.utils.get_upload_folder()` in 6.31), resolved here because Gradio leaves the env value as is."""
    from gradio.utils import get_upload_folder

    return Path(get_upload_folder()).resolve()


def reference_path(raw: str) -> Path:
    """`raw` resolved, if it is a file inside Gradio's upload folder or assets/; else ApiError 400."""
    try:
        path = Path(raw).resolve(strict=True)  # follows symlinks: a link out of the folders is refused
    except (OSError, RuntimeError, ValueError) as e:  # missing, loop, NUL byte
        raise ApiError(400, UNKNOWN_REFERENCE, param="prompt_audio", code="unknown_reference") from e
    for root in (upload_folder(), ASSETS_DIR.resolve()):
        if path.is_relative_to(root) and path != root and path.is_file():
            return path
    raise ApiError(400, UNKNOWN_REFERENCE, param="prompt_audio", code="unknown_reference")


def end_page_streams(app: FastAPI) -> None:
    """At Ctrl+C / SIGTERM: end the open pages' long-lived streams (Gradio's heartbeat and queue SSE), which
    uvicorn's graceful shutdown would otherwise wait on (`timeout_graceful_shutdown`). Mounted with
    `gr.mount_gradio_app`, nothing sets Gradio's own `stop_event` (only `Blocks.close()` after `launch()`).
    Call it on the serving loop (it sets asyncio events)."""
    from starlette.routing import Mount

    for route in app.routes:
        gradio_app = route.app if isinstance(route, Mount) and route.path == "" else None
        if gradio_app is not None and hasattr(gradio_app, "stop_event"):
            gradio_app.get_blocks()._queue.close()  # its /queue/data streams end at their next wake-up
            gradio_app.stop_event.set()  # the heartbeat streams end now


def quiet_access_log() -> None:
    """Keep uvicorn's access log to requests a person reads: not the page's own polling (panel timer ticks,
    queue and upload progress: a line per second per open tab) unless they failed."""
    import logging

    class PagePolling(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            args = record.args if isinstance(record.args, tuple) else ()
            # uvicorn's access record: (client, method, path, http version, status)
            if len(args) == 5 and isinstance(args[2], str) and isinstance(args[4], int) and args[4] < 400:
                return not args[2].startswith(QUIET_PATHS)
            return True

    logging.getLogger("uvicorn.access").addFilter(PagePolling())


# the page's polling and asset routes (Gradio's), left out of the access log when they succeed
QUIET_PATHS = ("/gradio_api/run/predict", "/gradio_api/queue/", "/gradio_api/upload_progress",
               "/gradio_api/heartbeat/", "/assets/", "/static/", "/theme.css", "/gradio_api/stream/")


def add_studio_routes(app: FastAPI, service: StudioService) -> None:
    """Add /studio/speech and /studio/requests/{id} to `app` (before Gradio is mounted at "/")."""
    router = APIRouter(prefix="/studio", tags=["studio"], include_in_schema=False)

    @router.post("/speech")
    async def studio_speech(body: StudioSpeech, request: Request):
        """Speak `text` in the reference voice; the body is raw PCM (s16le, mono, 24 kHz) as it is made."""
        arrived = request.scope.get("state", {}).get(ARRIVAL_KEY, time.monotonic())  # ArrivalStamp
        raw = body.prompt_audio
        reference = (lambda: reference_path(raw)) if raw else None  # checked after the inputs (ApiError 400)
        try:
            prepared = await prepare(service, SpeechInputs(
                text=body.text, voice=body.voice or None, reference=reference, transcript=body.prompt_text,
                mode=body.mode, instruct_text=body.instruct_text, seed=body.seed, stream=True))
        except NotReadyError as e:
            raise ApiError(503, str(e), code="not_ready", headers={"Retry-After": str(RETRY_AFTER_S)}) from e
        except InputError as e:
            raise ApiError(400, str(e), param=STUDIO_PARAMS.get(e.param, e.param), code=e.code) from e
        headers = {"X-Mode": prepared.request.mode, "X-Reference-Ms": f"{prepared.reference_s * 1e3:.1f}"}
        response = await speech_response(service, prepared.request, "pcm", headers=headers, prepared=prepared)
        # arrival of the HTTP request -> these headers: the server's whole share of click -> first byte
        response.headers["X-Handler-Ms"] = f"{(time.monotonic() - arrived) * 1e3:.1f}"
        return response

    @router.get("/requests/{request_id}")
    async def studio_request(request_id: str) -> dict:
        """A finished request's stats line (Markdown, without its notes), notes and details."""
        if REQUEST_ID_RE.fullmatch(request_id) is None:
            raise ApiError(400, "request_id must be the X-Request-Id of a /studio/speech response",
                           param="request_id", code="invalid_value")
        rec = service.metrics.record(request_id)
        if rec is None or rec.outcome != "ok":
            raise ApiError(404, "unknown request, one that did not finish, or one too old to be kept",
                           param="request_id", code="unknown_request")
        return {"request_id": rec.request_id, "line": stats_line(rec), "notes": list(rec.notes),
                "details": request_details(rec)}

    app.include_router(router)
