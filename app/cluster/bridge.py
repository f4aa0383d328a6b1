"""HTTP over a Ray Serve handle: the ingress sends a request as a plain dict, a replica runs it through
the single-process FastAPI app (app/server/main.py:build_api) and yields the ASGI messages it sends.
Design notes: docs/cluster.md.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

REPLICA_HEADER = b"x-replica"  # which replica answered (added to every forwarded response)


async def request_dict(request: Request) -> dict[str, Any]:
    """The ingress side: `request` as a picklable dict. Its body is read whole: the ingress's AccessLimits
    (app/server/limits.py, `Gate.capped`) has refused a /v1 body over the cap before or while it is read."""
    parts = [piece async for piece in request.stream()]
    client = request.scope.get("client")
    return {"method": request.method, "path": request.url.path, "query_string": request.scope["query_string"],
            "headers": list(request.scope["headers"]), "body": b"".join(parts),
            "client": tuple(client) if client else None}


async def run_asgi(app: Callable, req: dict[str, Any], *, replica_id: str) -> AsyncIterator[dict]:
    """The replica side: run `req` through the ASGI `app`, yielding the messages it sends.

    Closing this generator early (the client went away, so Serve cancels it) tells the app the client
    disconnected and cancels it: the route's `finally` aborts the LM request and frees its slot.
    """
    sent: asyncio.Queue[dict | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": req["body"], "more_body": False}
        await disconnected.wait()  # Starlette listens for the disconnect while it streams
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, replica_id.encode())]}
        await sent.put(message)

    path = req["path"]
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": req["method"], "scheme": "http", "path": path, "raw_path": path.encode(),
             "root_path": "", "query_string": req["query_string"], "headers": req["headers"],
             "client": req["client"], "server": None, "state": {}}
    task = asyncio.create_task(app(scope, receive, send))
    task.add_done_callback(lambda _t: sent.put_nowait(None))  # the end (or the app's error) wakes the loop
    try:
        while (message := await sent.get()) is not None:
            yield message
        task.result()  # an error the app raised (after or instead of a response) propagates
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def collect(messages: AsyncIterator[dict]) -> dict[str, Any]:
    """A whole response from `run_asgi`'s messages: {"status", "headers", "body"} (for small answers)."""
    out: dict[str, Any] = {"status": 500, "headers": [], "body": b""}
    parts = []
    async for m in messages:
        if m["type"] == "http.response.start":
            out["status"], out["headers"] = m["status"], m.get("headers", [])
        elif m["type"] == "http.response.body":
            parts.append(m.get("body", b""))
    out["body"] = b"".join(parts)
    return out


def header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    return next((v.decode("latin-1") for k, v in headers if k.lower() == name), None)


class PassThroughResponse(Response):
    """The ingress side: an ASGI response that sends a replica's start message, then its body messages
    as they arrive. A replica that dies mid-body makes this raise, so the client's connection breaks
    (no final chunk): a cut stream never looks like a short success. (A `Response` only so that FastAPI
    returns it as it is; Starlette's body and header handling are not used.)"""

    def __init__(self, start: dict, rest: AsyncIterator[dict], on_close: Callable) -> None:
        self.start, self.rest, self.on_close = start, rest, on_close
        self.status_code, self.background = start["status"], None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await send({"type": "http.response.start", "status": self.start["status"],
                        "headers": self.start.get("headers", [])})
            ended = False
            async for m in self.rest:
                if m["type"] == "http.response.body":
                    ended = not m.get("more_body", False)
                    await send({"type": "http.response.body", "body": m.get("body", b""), "more_body": not ended})
            if not ended:
                raise ConnectionError("the replica ended the response without its last part")
        finally:
            await self.on_close()
