"""Errors in the OpenAI API's JSON shape: {"error": {"message", "type", "param", "code"}} (docs/design.md)."""

from __future__ import annotations

import difflib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

# HTTP status -> OpenAI error type; any other (400, 405, 413, 415, 422) is "invalid_request_error"
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 409: "conflict_error",
               429: "rate_limit_error", 500: "server_error", 503: "service_unavailable_error", 507: "server_error"}
# what each error status means on /v1, for the schema (`error_responses`); a route that documents "4XX" gets no
# FastAPI 422 in the schema (a validation error is answered 400 here)
ERROR_MEANINGS = {
    "4XX": "refused: the error body says why and what to do (a malformed request is 400, never 422)",
    400: "invalid request: the message says which field (`param`) and what to do",
    401: "missing or wrong API key (only where the server has keys)",
    403: "an option this server does not offer to this caller",
    404: "no such voice (another owner's voice reads as unknown)",
    405: "no such method on this route (the Allow header lists the ones there are)",
    409: "a voice of that name exists (send overwrite=true), or a stored voice is unusable",
    413: "the request body or upload is larger than [limits] max_upload_mb",
    429: "too many requests from this client (Retry-After says when to try again)",
    503: "not ready yet, busy, or out of memory (Retry-After says when to try again)",
    507: "the server cannot write its voices folder (read-only or full); saved voices still work",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error shape, as every /v1 error is answered."""

    error: ErrorDetail


def error_responses(*statuses: int | str) -> dict:
    """`responses=` for a route's schema: each of `statuses` with its meaning and the error body."""
    return {s: {"model": ErrorBody, "description": ERROR_MEANINGS[s]} for s in statuses}


def _union_tag(part: object) -> bool:
    """Whether a pydantic error location part names a union's branch ("str", "VoiceRef"), not a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or part[:1].isupper())


def body_fields(request: Request) -> list[str]:
    """The fields the request's route takes in its body (JSON or form), in their order; [] if unknown."""
    field = getattr(request.scope.get("route"), "body_field", None)
    model = getattr(getattr(field, "field_info", None), "annotation", None)
    return list(getattr(model, "model_fields", {}))


class ApiError(Exception):
    """An error answered as `status` with an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def error_response(e: ApiError) -> JSONResponse:
    body = {"message": e.message, "type": ERROR_TYPES.get(e.status, "invalid_request_error"), "param": e.param,
            "code": e.code}
    return JSONResponse({"error": body}, status_code=e.status, headers=e.headers)


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped errors for /v1 routes (the Gradio app mounted at "/" keeps its own)."""

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, e: ApiError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        # an unknown field first (a misspelt name also shows as the real field "missing", which misleads), a
        # type mismatch last (a union's other branch: `voice` {"id": too long} is no string either)
        first = min(e.errors() or [{}], key=lambda x: (x.get("type") != "extra_forbidden",
                                                       str(x.get("type", "")).endswith("_type")))
        param = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "form")
                         and not _union_tag(p)) or None
        msg = first.get("msg", "invalid request")
        message = f"{param}: {msg}" if param else str(msg)
        if first.get("type") == "json_invalid":
            message, param = "the request body is not valid JSON", None
        elif first.get("type") == "extra_forbidden" and (accepted := body_fields(request)):
            near = difflib.get_close_matches(str(param), accepted, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            message = f"unknown field '{param}'{hint}: {request.url.path} accepts {', '.join(accepted)}"
        return error_response(ApiError(400, message, param=param, code=first.get("type")))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        # a 404 is never a /v1 path's (api_router's catch-all routes every one): the page's own paths keep Gradio's
        if e.status_code == 404 and not request.url.path.startswith("/v1/"):
            return JSONResponse({"detail": e.detail}, status_code=e.status_code, headers=e.headers)
        return error_response(ApiError(e.status_code, str(e.detail or "error"), headers=e.headers))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)  # no body: user text stays out
        return error_response(ApiError(500, "internal server error; the request was not completed"))
