"""Malformed requests to the page's Gradio API answered 404, with one log line and no traceback (docs/design.md)."""

from __future__ import annotations

import json
import logging
import re
from typing import Any
from urllib.parse import parse_qs

from fastapi.responses import JSONResponse

from app.server.limits import peek_body

log = logging.getLogger(__name__)

# POSTs naming an event: the queue's join (by fn_index) and the named routes (by API name or fn_index)
EVENT_POST_RE = re.compile(r"/gradio_api/(?:queue/join|(?:run|api|call(?:/v2)?)/(?P<name>[^/]+))/?")
# the streams of a session's messages: by session hash, or by the event id a /call POST answered
STREAM_GET_RE = re.compile(r"/gradio_api/(?:queue/data|call(?:/v2)?/[^/]+/(?P<event>[^/]+))/?")
MAX_BODY_BYTES = 256 * 1024  # an event's JSON (files are uploaded before it); a longer body is not checked
SHOWN_CHARS = 40  # of a name or id a client sent, in the answer (never in the log)
DIRECT_RUN_RE = re.compile(r"/gradio_api/(?:run|api)/[^/]+/?")  # answered in the response itself (no queue)
MALFORMED_TITLE = "Malformed request"  # the gr.Error title of app/ui/layout.py's `malformed`


class GradioGuard:
    """ASGI middleware in front of the Gradio app mounted at "/" (`gradio_app`: its `gradio.routes.App`)."""

    def __init__(self, app: Any, gradio_app: Any) -> None:
        self.app, self.gradio_app = app, gradio_app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/gradio_api/"):
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        problem = None
        if method == "POST" and (m := EVENT_POST_RE.fullmatch(path)):
            body, receive = await peek_body(receive, MAX_BODY_BYTES)
            problem = self._unknown_event(m.group("name"), body)
        elif method == "GET" and (m := STREAM_GET_RE.fullmatch(path)):
            problem = self._unknown_stream(m.group("event"), scope)
        if problem is None:
            wrapped = _malformed_as_400(send) if method == "POST" and DIRECT_RUN_RE.fullmatch(path) else send
            return await self.app(scope, receive, wrapped)
        log.info("refused a malformed Gradio request: %s %s: %s", method, path.split("/")[2], problem[0])
        await JSONResponse({"detail": f"{problem[1]}; see the page's \"Use via API\" for its endpoints"}, 404)(
            scope, receive, send)

    def _unknown_event(self, name: str | None, body: bytes) -> tuple[str, str] | None:
        """(log line, answer) when the event the body (or `name`) asks for is none of the page's, else None."""
        try:
            sent = json.loads(body)
        except ValueError:
            return None  # Gradio's own 422 says so
        if not isinstance(sent, dict):
            return None
        fns = self.gradio_app.get_blocks().fns
        index = sent.get("fn_index")
        if isinstance(index, int) and not isinstance(index, bool):
            return None if index in fns else ("unknown fn_index", f"no event with fn_index {index}")
        if index is not None:
            return None  # not an integer: Gradio's own 422
        if name is None:
            return ("no fn_index", "a queue/join request needs the event's fn_index")
        if any(fn.api_name == name for fn in fns.values()):
            return None
        return ("unknown API name", f"no API endpoint named {name[:SHOWN_CHARS]!r}")

    def _unknown_stream(self, event_id: str | None, scope: dict) -> tuple[str, str] | None:
        """(log line, answer) when the stream asked for has no messages waiting (Gradio's own test), else None."""
        queue = self.gradio_app.get_blocks()._queue
        if event_id is None:
            session = (parse_qs(scope.get("query_string", b"").decode("latin-1")).get("session_hash") or [None])[0]
            if session is None:
                return None  # Gradio's own 422
        else:  # as Gradio resolves it: a running event's session, a finished one's, else the id itself
            event = queue.event_ids_to_events.get(event_id)
            session = event.session_hash if event is not None else next(
                (s for s, ids in queue.pending_event_ids_session.items() if event_id in ids), event_id)
        if session in queue.pending_messages_per_session:
            return None
        shown = (event_id or session)[:SHOWN_CHARS]
        return ("unknown session or event", f"no event {shown!r} is waiting for its messages")


def _malformed_as_400(send: Any) -> Any:
    """`send` for a direct run: Gradio answers every error there 500; a malformed request's becomes 400."""
    held: dict | None = None

    async def sending(message: dict) -> None:
        nonlocal held
        if message["type"] == "http.response.start" and message["status"] == 500:
            held = message  # JSONResponse: one body message follows
            return
        if held is not None and message["type"] == "http.response.body":
            try:
                title = json.loads(message.get("body", b"")).get("title")
            except (ValueError, AttributeError):
                title = None
            start, held = (dict(held, status=400) if title == MALFORMED_TITLE else held), None
            await send(start)
        await send(message)

    return sending
