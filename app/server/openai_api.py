"""The /v1 HTTP API, shaped like OpenAI's audio API so existing clients (the `openai` SDK) work (docs/design.md)."""

# no `from __future__ import annotations`: the speech route's body is annotated with the configured model (a local)

from collections.abc import Awaitable
from typing import Literal

from fastapi import APIRouter, Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, field_validator

from app import audio_formats
from app.config import LimitsConfig, ModelConfig
from app.server.errors import ApiError, error_responses
from app.server.identity import caller_of
from app.server.speech import Tap, no_tap, prepare_or_raise, speech_response
from app.server.sse_speech import sse_response
from app.server.voices_api import NAME_MAX_CHARS, voices_router
from app.service.inputs import MAX_SEED, SPEED_RANGE
from app.service.prepare import NO_TRANSCRIPT_NOTE, SpeechInputs
from app.service.service import StudioService

MODEL_ID = "cosyvoice2"
# `model` names /v1/audio/speech accepts (case-insensitive): this model's own, and OpenAI's TTS names, which
# SDK clients send by default; every one speaks with the one loaded model
OPENAI_TTS_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
DEFAULT_REPO_ID = ModelConfig.repo_id  # the schema lists the default's names; the route takes the configured one
# prepare()'s field names -> this API's (OpenAI's `input`; the reference is always a saved voice here)
V1_PARAMS = {"text": "input", "reference": "voice", "prompt_text": "voice", "instruct_text": "instructions"}
STREAM_FORMATS = ("audio", "sse")  # the body as audio bytes, or as OpenAI's events (app/server/sse_speech.py)
CATCH_ALL = "/{path:path}"  # the last /v1 route: every other path and method answers in the OpenAI shape


def accepted_models(repo_id: str) -> tuple[str, ...]:
    """The `model` names /v1/audio/speech accepts: MODEL_ID, `[model] repo_id` and its last part, OpenAI's."""
    return tuple(dict.fromkeys((MODEL_ID, repo_id, repo_id.rsplit("/", 1)[-1], *OPENAI_TTS_MODELS)))


class VoiceRef(BaseModel):
    id: str = Field(max_length=NAME_MAX_CHARS)


def speech_body(lim: LimitsConfig) -> type[BaseModel]:
    """OpenAI's `audio.speech.create` body, plus CosyVoice2 extensions (seed, mode, fixed_tokens, dialogue), whose
    schema states the configured limits (checked in app/service/prepare.py, with messages that say what to do; the
    body's size is capped by AccessLimits)."""

    class SpeechRequest(BaseModel):
        model_config = ConfigDict(extra="forbid")

        model: str = Field(MODEL_ID, max_length=128, description=f"{MODEL_ID!r}, the model's repo id or name, or one "
                           f"of OpenAI's {', '.join(OPENAI_TTS_MODELS)}: all speak with the one loaded model",
                           json_schema_extra={"enum": list(accepted_models(DEFAULT_REPO_ID))})  # checked in the route
        input: str = Field(description="the text to speak ([limits] max_text_chars)",
                           json_schema_extra={"maxLength": lim.max_text_chars})
        # required (checked in the route) except by a dialogue script that starts with a speaker tag
        voice: str | VoiceRef | None = Field(None, description="a saved voice's id (POST /v1/voices); a dialogue "
                                             "script that starts with a [name] tag may leave it out",
                                             json_schema_extra={"maxLength": NAME_MAX_CHARS})
        response_format: Literal["wav", "pcm", "mp3", "opus", "aac", "flac"] = Field(
            "wav", description="24 kHz mono: wav, pcm (s16le), mp3, opus (Ogg), aac (ADTS), flac. Streamed as made "
            "(wav with an unknown-length header), except flac and any speed other than 1.0: sent whole, with exact "
            "lengths (Content-Length, WAV sizes, FLAC STREAMINFO) (docs/api.md)")
        speed: float = Field(1.0, description="other than 1.0 the audio is made whole, then sent",
                             json_schema_extra={"minimum": SPEED_RANGE[0], "maximum": SPEED_RANGE[1]})
        instructions: str | None = Field(None, description="style instruction: instruct mode ([limits] "
                                         "max_instruct_chars)", json_schema_extra={"maxLength": lim.max_instruct_chars})
        # any other value is refused in the route, with a message that says what to send
        stream_format: str = Field("audio", description="'audio' (the audio itself as the body) or 'sse' (OpenAI's "
                                   "speech.audio.delta/done events, the audio in base64; docs/api.md)",
                                   json_schema_extra={"enum": list(STREAM_FORMATS)})
        stream: bool | None = Field(None, description="vLLM-Omni's flag: true streams the audio as it is made, false "
                                    "sends it whole with exact lengths; left out: streamed unless speed is not 1.0")
        timestamps: bool = Field(False, description="with stream_format 'sse': each sentence's word and character "
                                 "times as a speech.audio.timestamps event (opt-in: each sentence costs a Whisper pass "
                                 "on the server; docs/api.md)")
        seed: int | None = Field(None, description="sampling seed; none or -1 = random",
                                 json_schema_extra={"minimum": -1, "maximum": MAX_SEED})
        mode: Literal["zero_shot", "cross_lingual", "instruct"] | None = Field(
            None, description="default: instruct when instructions are given, else zero_shot")
        fixed_tokens: int = Field(0, description="benchmarks: exactly this many speech tokens per segment "
                                  "([limits] max_fixed_tokens)",
                                  json_schema_extra={"minimum": 0, "maximum": lim.max_fixed_tokens})
        dialogue: bool = Field(False, description="`input` is a dialogue script: '[alice] text [bob] text …', each "
                               "name a saved voice; text before the first tag is spoken by `voice` (docs/api.md)")

        @field_validator("input", "instructions")
        @classmethod
        def _valid_unicode(cls, v: str | None) -> str | None:
            # JSON may escape a lone UTF-16 surrogate (\ud800), which is no text: refused (400 on `input`)
            if v is not None:
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise ValueError("unable to parse raw data as a unicode string (a lone UTF-16 surrogate at "
                                     f"character {e.start}); send valid UTF-8 text") from None
            return v

    return SpeechRequest


def api_router(service: StudioService) -> APIRouter:
    """The /v1 routes bound to the process's service. AccessLimits (app/server/limits.py) has checked the key
    (where keys are set) and refuses a body over [limits] max_upload_mb before it is parsed."""
    router = APIRouter(prefix="/v1", tags=["v1"], responses=error_responses("4XX", 401, 405))
    speech_request = speech_body(service.cfg.limits)  # the schema states the configured limits

    @router.post("/audio/speech", response_class=Response, responses={
        200: {"content": {t: {} for t in dict.fromkeys(audio_formats.MEDIA_TYPES.values())},
              "description": "the speech"}, **error_responses(400, 403, 413, 429, 503)})
    async def create_speech(body: speech_request, request: Request):
        """Speak `input` in a saved voice; the body streams as the audio is produced."""
        return await speak_v1(service, body, request)

    router.include_router(voices_router(service))

    @router.get("/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [{"id": MODEL_ID, "object": "model", "created": int(service.started_at),
                                            "owned_by": "FunAudioLLM", "ready": service.ready}]}

    @router.api_route(CATCH_ALL, methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def unknown(path: str, request: Request) -> None:
        """Unknown /v1 routes answer in the OpenAI shape (the Gradio app at "/" would catch them otherwise)."""
        raise unknown_route(router, path, request.method)

    return router


def unknown_route(router: APIRouter, path: str, method: str) -> ApiError:
    """404 for a path no /v1 route has; a known route asked with another method: 405 with the methods it has."""
    methods = sorted({m for r in router.routes if isinstance(r, APIRoute) and r.path != router.prefix + CATCH_ALL
                      and r.path_regex.match(f"/v1/{path}") for m in r.methods})
    if methods:
        return ApiError(405, f"{method} is not allowed on /v1/{path}: use {' or '.join(methods)}",
                        code="method_not_allowed", headers={"Allow": ", ".join(methods)})
    return ApiError(404, f"no such route /v1/{path}; see /v1/docs", code="unknown_route")


def check_speech(service: StudioService, body: BaseModel, admin: bool) -> str | None:
    """The saved voice a /v1/audio/speech `body` names (None: a dialogue script's tags name them); ApiError for
    what only this door takes (model names, the bench option, stream formats). The rest is `prepare`'s."""
    models = accepted_models(service.cfg.model.repo_id)
    if body.model.casefold() not in {m.casefold() for m in models}:
        service.metrics.input_refused("unknown_model")
        raise ApiError(400, f"unknown model {body.model!r}: use one of {', '.join(models)} (all speak with the "
                       "loaded CosyVoice2 model)", param="model", code="model_not_found")
    if body.fixed_tokens and not (service.cfg.server.bench_options_open or admin):
        service.metrics.input_refused("bench_option")
        raise ApiError(403, "fixed_tokens is a benchmark option this server does not offer (its [server] "
                       "bench_options; the admin key may use it): leave it out", param="fixed_tokens",
                       code="bench_option_refused")
    if body.stream_format not in STREAM_FORMATS:
        raise ApiError(400, f"stream_format {body.stream_format[:20]!r} is not supported: use 'audio' (the audio "
                       "itself as the body) or 'sse' (events)", param="stream_format", code="unsupported_value")
    if body.stream is False and body.stream_format == "sse":
        raise ApiError(400, "stream_format 'sse' always streams: leave stream out (or send true), or send "
                       "stream_format 'audio' for the whole audio", param="stream", code="unsupported_value")
    if body.timestamps and body.stream_format != "sse":
        raise ApiError(400, "timestamps needs stream_format 'sse' (the timings are events between the audio "
                       "events): send stream_format 'sse', or leave timestamps out", param="timestamps",
                       code="unsupported_value")
    fmt = body.response_format
    if not audio_formats.available(fmt):  # aac/mp3/opus without PyAV: say so before any work
        raise ApiError(400, f"response_format {fmt!r} needs PyAV on the server (pip install av); use one of "
                       f"{', '.join(f for f in audio_formats.FORMATS if audio_formats.available(f))}",
                       param="response_format", code="unsupported_value")
    name = body.voice.id if isinstance(body.voice, VoiceRef) else body.voice
    if name is None and not body.dialogue:
        raise ApiError(400, "voice: a saved voice's id is required (GET /v1/voices lists them)", param="voice",
                       code="missing")
    return name


async def speak_v1(service: StudioService, body: BaseModel, request: Request) -> Response:
    """/v1/audio/speech: `body` checked and prepared (its readiness too), then spoken as bytes or events."""
    caller = caller_of(request.scope)
    name = check_speech(service, body, caller.owner.admin)
    prepared = await prepare_or_raise(service, SpeechInputs(
        text=body.input, voice=name, mode=body.mode, instruct_text=(body.instructions or "").strip(),
        seed=body.seed, speed=body.speed, stream=body.stream, fixed_tokens=body.fixed_tokens,
        owner=caller.owner, dialogue=body.dialogue), V1_PARAMS)
    notes = {"X-Mode-Note": "voice has no transcript: cross-lingual mode"} if NO_TRANSCRIPT_NOTE in prepared.notes \
        else {}

    async def gone() -> None:  # the body is read: the next message is the disconnect
        while (await request.receive())["type"] != "http.disconnect":
            pass

    def speak(tap: Tap = no_tap) -> Awaitable[Response]:
        return speech_response(service, prepared.request, body.response_format, headers=notes, prepared=prepared,
                               params=V1_PARAMS, caller=caller, gone=gone, tap=tap)

    if body.stream_format == "sse":
        return await sse_response(service, prepared, body.input, speak, timestamps=body.timestamps)
    return await speak()
