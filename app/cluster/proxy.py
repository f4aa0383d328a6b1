"""Serve's HTTP proxy, extended by Serve's own hook (`middlewares()`, named by
RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=app.cluster.proxy:middlewares): one X-Request-ID per response.
Design notes: docs/cluster.md.
"""

from __future__ import annotations

from typing import Any

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "app.cluster.proxy:middlewares"
REQUEST_ID = b"x-request-id"


class OneRequestId:
    """ASGI middleware: at most one X-Request-ID per response, the first (the app's own)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_one(message: dict) -> None:
            if message["type"] == "http.response.start":
                seen, headers = False, []
                for k, v in message.get("headers", []):
                    if k.lower() == REQUEST_ID:
                        if seen:
                            continue
                        seen = True
                    headers.append((k, v))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_one)


def middlewares() -> list:
    """What Serve's proxy callback returns: Starlette `Middleware`s, applied outside Serve's own."""
    from starlette.middleware import Middleware

    return [Middleware(OneRequestId)]
