"""The page's low-latency player routes: raw PCM for WebAudio, and the client's timings.

    POST /studio/speech  {text, prompt_audio, prompt_text, mode, instruct_text, voice, seed}
                         -> raw PCM s16le mono 24 kHz, streamed as it is produced
    POST /studio/timing  {request_id, first_byte_ms, first_sound_ms} -> 204

The page (app/ui/player.js) calls these with relative URLs, so they work behind the Spaces proxy
and a root path. `prompt_audio` is a *server path*: the page's uploaded reference (the gr.Audio
value's `path`) or an example asset. It is accepted only if it resolves (symlinks followed) inside
Gradio's upload cache or assets/; anything else is 400 "unknown reference file", without echoing
the path. The streaming itself is `speech_response` (admission, first chunk before the status,
X-Request-Id / X-Seed / X-TTFA-Ms / X-Queue-Ms headers, disconnect -> vLLM abort). What the body
carried, with the stats, is kept per request id (`player_store`) so the page can show the final
WAV and the stats line afterwards. These routes are as open as the page itself: the optional bearer
key guards /v1 only (the page never holds it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
from fastapi import APIRouter, FastAPI, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from app.audio import AudioError, to_int16_pcm
from app.engine import inputs
from app.engine.inputs import InputError
from app.engine.requests import AudioChunk, RequestStats, SynthesisRequest
from app.engine.service import ASSETS_DIR, NotReadyError, StudioService
from app.engine.voices import VoiceError
from app.model.frontend import PromptAudioError, VoiceFeatures
from app.server.errors import ApiError
from app.server.speech import RETRY_AFTER_S, speech_response
from app.ui.handlers import ARRIVAL_KEY
from app.ui.player import PlayerResult, PlayerStore, check_timing, player_store, valid_request_id

UNKNOWN_REFERENCE = "unknown reference file: upload the reference recording again, or pick an example"


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


class StudioTiming(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(max_length=64)
    first_byte_ms: float
    first_sound_ms: float


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


class _Recording:
    """The service as `speech_response` uses it (`admit`, `stream`), keeping the request's PCM and stats
    for the page; a request that does not finish (stopped, failed) is not kept."""

    def __init__(self, service: StudioService, store: PlayerStore, *, voice: str, reference_s: float,
                 notes: tuple[str, ...]) -> None:
        self.service, self.store = service, store
        self.voice, self.reference_s, self.notes = voice, reference_s, notes

    def __getattr__(self, name: str):  # admit() and anything else speech_response uses: the service's
        return getattr(self.service, name)

    async def stream(self, req: SynthesisRequest, *, queue_wait_s: float = 0.0) -> AsyncIterator[AudioChunk]:
        parts: list[np.ndarray] = []
        ttfa_ms = None
        t0 = time.perf_counter()
        async with contextlib.aclosing(self.service.stream(req, queue_wait_s=queue_wait_s)) as chunks:
            async for chunk in chunks:
                if chunk.samples.size:
                    if ttfa_ms is None:
                        ttfa_ms = (time.perf_counter() - t0) * 1e3
                    parts.append(to_int16_pcm(chunk.samples))  # the same conversion as the body's
                if chunk.is_final and chunk.stats is not None:  # kept before the body's last bytes go out
                    self._keep(req, chunk.stats, parts, queue_wait_s, ttfa_ms)
                yield chunk

    def _keep(self, req: SynthesisRequest, stats: RequestStats, parts: list[np.ndarray], queue_s: float,
              ttfa_ms: float | None) -> None:
        pcm = np.concatenate(parts) if parts else np.zeros(0, np.int16)
        self.store.put_result(PlayerResult(
            request_id=req.request_id, pcm=pcm, stats=stats, seed=req.seed, mode=req.mode, voice=self.voice,
            queue_s=queue_s, reference_s=self.reference_s, ttfa_ms=ttfa_ms or stats.ttfa_ms, notes=self.notes))


def add_studio_routes(app: FastAPI, service: StudioService) -> None:
    """Add /studio/speech and /studio/timing to `app` (before Gradio is mounted at "/")."""
    cfg = service.cfg
    router = APIRouter(prefix="/studio", tags=["studio"], include_in_schema=False)

    async def voice_features(body: StudioSpeech, prompt_text: str) -> VoiceFeatures:
        if body.voice:
            try:
                return await asyncio.to_thread(service.voices.load, body.voice)
            except VoiceError as e:
                raise ApiError(400, str(e), param="voice", code="voice_not_found") from e
        if not body.prompt_audio:
            raise ApiError(400, "Upload or record a reference clip, or pick a saved voice.", param="prompt_audio",
                           code="missing_reference")
        path = reference_path(body.prompt_audio)
        try:
            return await service.voice_from_audio(path, prompt_text)
        except (AudioError, PromptAudioError, OSError) as e:  # server paths reduced to the file name
            raise ApiError(400, str(e).replace(str(path), path.name).replace(body.prompt_audio, path.name),
                           param="prompt_audio", code="invalid_audio") from e

    @router.post("/speech")
    async def studio_speech(body: StudioSpeech, request: Request):
        """Speak `text` in the reference voice; the body is raw PCM (s16le, mono, 24 kHz) as it is made."""
        arrived = request.scope.get("state", {}).get(ARRIVAL_KEY, time.monotonic())  # ArrivalStamp
        try:
            service.require_ready()
        except NotReadyError as e:
            raise ApiError(503, str(e), code="not_ready", headers={"Retry-After": str(RETRY_AFTER_S)}) from e
        try:
            text = inputs.check_text(body.text, cfg.server.max_text_chars, param="text")
            mode = inputs.check_mode(body.mode)
            instruct_text = inputs.check_instruct(body.instruct_text, mode)
            prompt_text = inputs.check_transcript(body.prompt_text)
            seed = inputs.check_seed(body.seed)
        except InputError as e:
            raise ApiError(400, str(e), param=e.param, code="invalid_value") from e
        t0 = time.perf_counter()
        features = await voice_features(body, prompt_text)
        reference_s = time.perf_counter() - t0
        notes = tuple(getattr(features, "notes", ()))  # the reference checks' notes (trimmed, clipped), if any
        if mode == "zero_shot" and not features.prompt_text.strip():
            mode = "cross_lingual"
            notes += ("no transcript: used cross-lingual mode (the voice without its words)",)
        req = SynthesisRequest(text=text, voice=features, mode=mode, instruct_text=instruct_text, seed=seed,
                               stream=True)
        recording = _Recording(service, player_store(service), voice=body.voice or "", reference_s=reference_s,
                               notes=notes)
        response = await speech_response(recording, req, "pcm",  # type: ignore[arg-type]  # admit + stream suffice
                                         headers={"X-Mode": mode, "X-Reference-Ms": f"{reference_s * 1e3:.1f}"})
        # arrival of the HTTP request -> these headers: the server's whole share of click -> first byte
        response.headers["X-Handler-Ms"] = f"{(time.monotonic() - arrived) * 1e3:.1f}"
        return response

    @router.post("/timing", status_code=204)
    async def studio_timing(body: StudioTiming) -> Response:
        """The page's click -> first byte / first sound of one of this server's requests (latency panel)."""
        if not valid_request_id(body.request_id):
            raise ApiError(400, "request_id must be the X-Request-Id of a /studio/speech response",
                           param="request_id", code="invalid_value")
        try:
            timing = check_timing(body.first_byte_ms, body.first_sound_ms)
        except ValueError as e:
            raise ApiError(400, str(e), code="invalid_value") from e
        if not player_store(service).put_timing(body.request_id, timing):
            raise ApiError(404, "unknown or expired request_id", param="request_id", code="unknown_request")
        return Response(status_code=204)

    app.include_router(router)
