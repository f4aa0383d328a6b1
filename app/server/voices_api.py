"""The /v1 saved-voice routes, each caller's own voices (app/engine/owners.py):

    POST   /v1/voices         multipart: audio (file), transcript, name (optional), overwrite -> the voice's JSON
    GET    /v1/voices         {"object": "list", "data": [voice, ...]}: the caller's (the admin key: everybody's)
    GET    /v1/voices/{id}    one voice of the caller's (the admin key: `?owner=` names another owner's)
    DELETE /v1/voices/{id}    {"id", "object": "voice", "deleted": true}

The caller is the request's owner (app/server/identity.py): an API key's owner, the login's user, or the
browser's visitor cookie. In shared scope everybody has the one store. Another owner's voice is
answered as an unknown one (404): nobody learns which names others use.
"""

# no `from __future__ import annotations`: the form fields' annotations use the configured limit (a local)

import asyncio
import secrets
from collections.abc import Callable
from functools import partial
from typing import Annotated

from fastapi import APIRouter, File, Form, Request, UploadFile

from app.engine import inputs
from app.engine.inputs import InputError
from app.engine.owners import ANYONE, OWNER_STATE_KEY, Owner
from app.engine.prepare import reference_voice
from app.engine.service import StudioService
from app.engine.voices import VoiceError, VoiceInfo, check_name
from app.server.errors import ApiError

TRANSCRIPT_HARD_CAP = 10_000  # characters a form field may carry at all; the configured limit is checked below


def owner_of(request: Request) -> Owner:
    """The request's owner, as AccessLimits found it (ANYONE where no gate ran)."""
    return request.scope.get("state", {}).get(OWNER_STATE_KEY, ANYONE)


def voice_json(info: VoiceInfo, admin: bool) -> dict:
    """A voice as /v1 shows it; its owner only to the admin (an owner id is nobody else's business)."""
    d = info.to_dict()
    if not admin:
        d.pop("owner")
    return {"id": info.name, "object": "voice", **d}


def voices_router(service: StudioService, require_ready: Callable[[], None], route_class: type) -> APIRouter:
    cfg = service.cfg
    limit = cfg.limits.max_transcript_chars
    router = APIRouter(route_class=route_class)

    @router.post("/voices", status_code=201)
    async def create_voice(request: Request,
                           audio: Annotated[UploadFile, File(description="the reference recording (wav/flac/"
                                                                       "ogg/mp3, webm/m4a with ffmpeg; 1-30 s "
                                                                       "of one speaker)")],
                           transcript: Annotated[str, Form(max_length=max(TRANSCRIPT_HARD_CAP, limit),
                                                           json_schema_extra={"maxLength": limit}, description=(
                               "the words spoken in the clip ([limits] max_transcript_chars); blank: Whisper "
                               "transcribes it where available (prompt_text and warnings in the response say "
                               "what was used)"))] = "",
                           name: Annotated[str | None, Form(max_length=200)] = None,
                           overwrite: Annotated[bool, Form(description="replace a voice of that name")] = False,
                           ) -> dict:
        """Compute and store a voice's features from a reference recording and its transcript (409 when the
        name is taken, unless `overwrite`)."""
        require_ready()
        owner = owner_of(request)
        store = service.voices.of(owner)
        try:
            name = check_name(name) if name else f"voice-{secrets.token_hex(4)}"
            transcript = inputs.check_transcript(transcript, limit)  # before the upload is read
        except VoiceError as e:
            raise ApiError(400, str(e), param="name", code="invalid_value") from e
        except InputError as e:
            raise ApiError(400, str(e), param="transcript", code="invalid_value") from e
        if name in store.names() and not overwrite:
            raise ApiError(409, f"a voice named {name!r} exists already; delete it first, choose another name, or "
                           "send overwrite=true", param="name", code="voice_exists")
        data = await _read_upload(audio, cfg.limits.max_upload_mb)
        try:
            features = await reference_voice(service, data, transcript)
            info = await asyncio.to_thread(partial(store.save, overwrite=overwrite), name, features)
        except InputError as e:
            raise ApiError(400, str(e), param="audio", code=e.code) from e
        except VoiceError as e:
            raise ApiError(409 if "exists" in str(e) else 400, str(e), param="name", code="invalid_voice") from e
        # what the reference checks trimmed or warn about (e.g. heavily clipped); [] when all is well
        return {**voice_json(info, owner.admin), "warnings": list(features.notes)}

    @router.get("/voices")
    async def list_voices(request: Request) -> dict:
        """The caller's saved voices of the loaded model, newest first (the admin key: every owner's)."""
        owner = owner_of(request)
        voices = await asyncio.to_thread(service.voices.visible, owner)
        return {"object": "list", "data": [voice_json(v, owner.admin) for v in voices]}

    @router.get("/voices/{voice_id}")
    async def get_voice(voice_id: str, request: Request, owner: str | None = None) -> dict:
        """One of the caller's voices (the admin key may name another `owner`)."""
        caller = owner_of(request)
        try:
            info = await asyncio.to_thread(service.voices.of(caller, owner).info, voice_id)
        except VoiceError as e:
            raise ApiError(404, str(e), param="voice_id", code="voice_not_found") from e
        return voice_json(info, caller.admin)

    @router.delete("/voices/{voice_id}")
    async def delete_voice(voice_id: str, request: Request, owner: str | None = None) -> dict:
        """Delete one of the caller's voices (the admin key may name another `owner`)."""
        try:
            await asyncio.to_thread(service.voices.of(owner_of(request), owner).delete, voice_id)
        except VoiceError as e:
            raise ApiError(404, str(e), param="voice_id", code="voice_not_found") from e
        return {"id": voice_id, "object": "voice", "deleted": True}

    return router


async def _read_upload(upload: UploadFile, max_mb: int) -> bytes:
    """The upload's bytes; 413 when it passes `max_mb` (one byte more is read to tell), 400 when empty."""
    limit = max_mb * 1024 * 1024
    data = await upload.read(limit + 1)
    if len(data) > limit:
        raise ApiError(413, f"the audio upload is larger than {max_mb} MB ([limits] max_upload_mb); send a "
                       "shorter clip (1-30 s is enough)", param="audio", code="file_too_large")
    if not data:
        raise ApiError(400, "the audio upload is empty", param="audio", code="invalid_audio")
    return data
