"""Errors in the OpenAI API's JSON shape: {"error": {"message", "type", "param", "code"}}.

Every /v1 route raises `ApiError`; the handlers installed by `install_error_handlers` also turn
FastAPI's request-validation errors (422 by default) into OpenAI's 400 `invalid_request_error`
naming the field, and an unexpected exception into a 500 without internals.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

# HTTP status -> OpenAI error type; any other (400, 405, 413, 415, 422) is "invalid_request_error"
ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 409: "conflict_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable_error"}


class ApiError(Exception):
    """An error answered as `status` with an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message, e.param, e.code), status_code=e.status, headers=e.headers)


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped errors for /v1 routes (the Gradio app mounted at "/" keeps its own)."""

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, e: ApiError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        first = (e.errors() or [{}])[0]
        param = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "form")) or None
        msg = first.get("msg", "invalid request")
        message = f"{param}: {msg}" if param else str(msg)
        if first.get("type") == "json_invalid":
            message, param = "the request body is not valid JSON", None
        return JSONResponse(error_body(400, message, param, first.get("type")), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        path = request.url.path
        if not path.startswith("/v1/") and e.status_code == 404 and path not in ("/health", "/metrics"):
            return JSONResponse({"detail": e.detail}, status_code=e.status_code, headers=e.headers)
        message = str(e.detail) if e.detail else "error"
        if e.status_code == 404:
            message = f"no route {request.method} {path}"
        return JSONResponse(error_body(e.status_code, message), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)  # no body: user text stays out
        return JSONResponse(error_body(500, "internal server error; the request was not completed"), status_code=500)
