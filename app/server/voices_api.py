"""The /v1 saved-voice routes, each caller's own voices (app/service/owners.py; docs/design.md)."""

# no `from __future__ import annotations`: the form fields' annotations use the configured limit (a local)

import contextlib
import secrets
from collections.abc import Iterator
from functools import partial
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, File, Form, Request, Response, UploadFile

from app.server.errors import ApiError, error_responses
from app.server.identity import caller_of
from app.server.speech import map_error
from app.service import voice_door
from app.service.inputs import InputError
from app.service.owners import Owner
from app.service.service import NotReadyError, StudioService
from app.service.voice_file import MEDIA_TYPE, SUFFIX
from app.service.voices import VoiceError, VoiceInfo

TRANSCRIPT_HARD_CAP = 10_000  # characters a form field may carry at all; the configured limit is checked below
NAME_MAX_CHARS = 64  # app/service/voices.py NAME_RE's limit (a name field is checked by check_name too)
VOICE_PARAMS = {"voice": "voice_id", "reference": "audio", "prompt_text": "transcript"}  # the engine's -> ours


def voice_json(info: VoiceInfo, admin: bool) -> dict:
    """A voice as /v1 shows it; its owner only to the admin (an owner id is nobody else's business)."""
    d = info.to_dict()
    if not admin:
        d.pop("owner")
    return {"id": info.name, "object": "voice", **d}


@contextlib.contextmanager
def refused() -> Iterator[None]:
    """The voice door's refusals (app/service/refusals.py) as /v1 errors; a taken name says how to replace it."""
    try:
        yield
    except (InputError, VoiceError, NotReadyError) as e:
        err = map_error(e, VOICE_PARAMS)
        if err.code == "voice_exists":
            err.message += "; or send overwrite=true"
        raise err from e


def request_owner(request: Request) -> Owner:
    """The owner whose voices the request may use, as AccessLimits found it (the routes' dependency)."""
    return caller_of(request.scope).owner


CallerOwner = Annotated[Owner, Depends(request_owner)]
# form fields shared by the routes below (those with a configured limit are built in their routes)
Overwrite = Annotated[bool, Form(description="replace a voice of that name")]


def upload_field(description: str, max_mb: int) -> Any:
    """A multipart file field whose schema states the configured cap ([limits] max_upload_mb)."""
    return Annotated[UploadFile, File(description=f"{description}, at most [limits] max_upload_mb",
                                      json_schema_extra={"maxLength": max_mb * 1024 * 1024})]


def voices_router(service: StudioService) -> APIRouter:
    """/voices and /voices/{id} for `service`, and its `voice_files_router`; a new voice is refused while the
    model is not ready. The routes without `async` run in FastAPI's thread pool (the store reads files)."""
    router = APIRouter()
    max_mb, limit = service.cfg.limits.max_upload_mb, service.cfg.limits.max_transcript_chars

    @router.post("/voices", status_code=201, responses=error_responses(400, 409, 413, 429, 503, 507))
    async def create_voice(owner: CallerOwner,
                           audio: upload_field("the reference recording (wav/flac/ogg/mp3, webm/m4a with ffmpeg; "
                                               "1-30 s of one speaker)", max_mb),
                           transcript: Annotated[str, Form(max_length=max(TRANSCRIPT_HARD_CAP, limit),
                                                           json_schema_extra={"maxLength": limit}, description=(
                               "the words spoken in the clip ([limits] max_transcript_chars); blank: Whisper "
                               "transcribes it where available (prompt_text and warnings in the response say "
                               "what was used)"))] = "",
                           name: Annotated[str, Form(max_length=NAME_MAX_CHARS,
                                                     description="default: voice-<8 hex digits>")] = "",
                           overwrite: Overwrite = False,
                           ) -> dict:
        """Compute and store a voice's features from a reference recording and its transcript (409 when the
        name is taken, unless `overwrite`)."""
        with refused():  # the upload is read once the name and transcript have passed
            info, notes = await voice_door.save(service, owner, name or f"voice-{secrets.token_hex(4)}",
                                                partial(_read_upload, audio, max_mb), transcript,
                                                overwrite=overwrite)
        # what the reference checks trimmed or warn about (e.g. heavily clipped); [] when all is well
        return {**voice_json(info, owner.admin), "warnings": list(notes)}

    @router.get("/voices")
    def list_voices(owner: CallerOwner) -> dict:
        """The caller's saved voices of the loaded model, newest first (the admin key: every owner's)."""
        return {"object": "list", "data": [voice_json(v, owner.admin) for v in service.voices.visible(owner)]}

    @router.get("/voices/{voice_id}", responses=error_responses(404))
    def get_voice(voice_id: str, caller: CallerOwner, owner: str | None = None) -> dict:
        """One of the caller's voices (the admin key may name another `owner`)."""
        try:
            info = service.voices.of(caller, owner).info(voice_id)
        except VoiceError as e:
            raise ApiError(404, str(e), param="voice_id", code="voice_not_found") from e
        return voice_json(info, caller.admin)

    @router.delete("/voices/{voice_id}", responses=error_responses(404, 507))
    def delete_voice(voice_id: str, caller: CallerOwner, owner: str | None = None) -> dict:
        """Delete one of the caller's voices (the admin key may name another `owner`)."""
        with refused():
            voice_door.delete(service, caller, voice_id, owner)
        return {"id": voice_id, "object": "voice", "deleted": True}

    router.include_router(voice_files_router(service))
    return router


def voice_files_router(service: StudioService) -> APIRouter:
    """A voice as a `.cvvoice` file: /voices/{id}/export and /voices/import for `service`."""
    router = APIRouter()
    max_mb = service.cfg.limits.max_upload_mb

    @router.get("/voices/{voice_id}/export", response_class=Response,
                responses={200: {"content": {MEDIA_TYPE: {}}, "description": "the voice as a .cvvoice file"},
                           **error_responses(404, 409)})
    def export_voice_file(voice_id: str, caller: CallerOwner, owner: str | None = None) -> Response:
        """One of the caller's voices as a `.cvvoice` file to import elsewhere (docs/api.md: the format)."""
        with refused():  # another owner's voice reads as unknown, as GET /v1/voices/{id}
            info, data = voice_door.export(service, caller, voice_id, owner)
        filename = info.name + SUFFIX  # voice names may hold any script's letters: an ASCII fallback too
        fallback = filename if filename.isascii() else "voice" + SUFFIX
        disposition = f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(filename)}"
        return Response(data, media_type=MEDIA_TYPE, headers={"Content-Disposition": disposition})

    @router.post("/voices/import", status_code=201, responses=error_responses(400, 409, 413, 503, 507))
    async def import_voice_file(owner: CallerOwner,
                                file: upload_field("a .cvvoice file (GET /v1/voices/{id}/export)", max_mb),
                                name: Annotated[str, Form(max_length=NAME_MAX_CHARS, description=(
                                    "store it under this name (default: the file's)"))] = "",
                                overwrite: Overwrite = False) -> dict:
        """Add the voice in a `.cvvoice` file to the caller's voices (400 for a damaged or hostile file, 400
        `other_model` for a voice of another model, 409 when the name is taken, unless `overwrite`); nothing is
        written unless every check passes."""
        upload = partial(_read_upload, file, max_mb, param="file", what="the voice file",
                         advice="a real one is under 1 MB")
        with refused():
            info = await voice_door.import_file(service, owner, upload, name, overwrite=overwrite)
        return {**voice_json(info, owner.admin), "warnings": []}

    return router


async def _read_upload(upload: UploadFile, max_mb: int, *, param: str = "audio", what: str = "the audio upload",
                       advice: str = "send a shorter clip (1-30 s is enough)") -> bytes:
    """The upload's bytes; 413 when it passes `max_mb` (one byte more is read to tell), 400 when empty."""
    limit = max_mb * 1024 * 1024
    data = await upload.read(limit + 1)
    if len(data) > limit:
        raise ApiError(413, f"{what} is larger than {max_mb} MB ([limits] max_upload_mb); {advice}", param=param,
                       code="file_too_large")
    if not data:
        raise ApiError(400, f"{what} is empty", param=param, code="invalid_audio" if param == "audio" else
                       "invalid_voice_file")
    return data
