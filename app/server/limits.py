"""Who may call what, and how often: the login guard of /studio and /v1, the /v1 bearer key, the allowed
origins, and the per-client rate limit, for every door, the WebSocket one included (docs/design.md)."""

from __future__ import annotations

import base64
import json
import logging
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from fastapi import HTTPException

from app.config import Config
from app.server.errors import ApiError, error_response
from app.server.identity import Identity, authorization, with_cookie
from app.server.origins import OriginPolicy
from app.service.owners import ARRIVAL_KEY

log = logging.getLogger(__name__)
SYNTH_PATHS = frozenset({"/v1/audio/speech", "/v1/voices", "/studio/speech"})  # POST only
SOCKET_PATH = "/v1/audio/speech/stream"  # one session: one synthesis request of the client's rate limit
# ElevenLabs' sockets (app/server/elevenlabs_ws.py): /v1/text-to-speech/{voice_id}/<one of these>, counted alike
EL_SOCKET_ENDS = ("/stream-input", "/multi-stream-input")
SOCKET_CODE_BASE = 4000  # a socket's refusal closes with HTTP's status + this (app/server/ws_speech.py)
QUEUE_JOIN_PATH = "/gradio_api/queue/join"
UPLOAD_PATH = "/gradio_api/upload"  # the page's files: references, a take's WAV for another download format
LOGIN_CHECK = "/gradio_api/login_check"  # the page's own test of its login cookie: 200 or 401
UPLOADS_PER_REQUEST = 2  # a client's uploads per minute: this many times its synthesis requests
LIMITED_EVENTS = ("synthesize", "save_voice")  # the page's events that run the model
MAX_JOIN_BODY = 64 * 1024  # a queue/join body is small JSON (files are uploaded before it)
MAX_CLIENTS = 10_000  # buckets kept; the longest idle client is forgotten (= back to a full bucket)
BODY_SLACK_BYTES = 1 << 20  # a /v1 request body may exceed [limits] max_upload_mb by this (form fields, boundaries)


class RateLimiter:
    """A token bucket per client key: bursts of up to `per_minute` (>= 1: Gate makes none for 0), refilled at
    per_minute / 60 per second. Event-loop only. `acquire(key)` takes a token and returns 0.0, or returns the
    wait in s, taking nothing."""

    def __init__(self, per_minute: int, *, max_clients: int = MAX_CLIENTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity, self.rate_per_s = float(per_minute), per_minute / 60.0
        self.max_clients, self.clock = max_clients, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, monotonic s)

    def acquire(self, key: str) -> float:
        now = self.clock()
        tokens, then = self._buckets.pop(key, (self.capacity, now))
        tokens = min(self.capacity, tokens + (now - then) * self.rate_per_s)
        wait_s = max(0.0, (1.0 - tokens) / self.rate_per_s)
        if wait_s == 0.0:
            tokens -= 1.0
        self._buckets[key] = (tokens, now)  # most recently seen last
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        return wait_s

    def __len__(self) -> int:
        return len(self._buckets)


def basic_credentials(scope: dict) -> tuple[str, str] | None:
    """(user, password) from an `Authorization: Basic` header (the first one), else None."""
    scheme, token = authorization(scope)
    if scheme != "basic":
        return None
    try:
        user, sep, password = base64.b64decode(token, validate=True).decode("utf-8").partition(":")
    except ValueError:  # not base64 (binascii.Error), not UTF-8 (UnicodeDecodeError)
        return None
    return (user, password) if sep else None


class Gate:
    """The settings `AccessLimits` applies, and its decisions; `gradio_app` and `limited_fns` are filled in once
    Gradio is mounted."""

    def __init__(self, cfg: Config, on_refused: Callable[[str], None] | None = None) -> None:
        srv = cfg.server
        self.identity = Identity(cfg)
        self.origins = OriginPolicy(srv)
        self.users, self.metrics_token = srv.auth_users, srv.metrics_token
        self.limiter = RateLimiter(srv.requests_per_minute) if srv.requests_per_minute > 0 else None
        self.uploads = RateLimiter(UPLOADS_PER_REQUEST * srv.requests_per_minute) if self.limiter is not None else None
        self.on_refused = on_refused or (lambda _reason: None)  # counts a refusal by reason (/metrics)
        self.gradio_app: Any = None  # the mounted page (ASGI): asked whether a login cookie is its own
        self.limited_fns: frozenset[int] = frozenset()  # fn_index of LIMITED_EVENTS
        self.max_body = cfg.limits.max_upload_mb * 1024 * 1024 + BODY_SLACK_BYTES  # a /v1 request body, bytes
        self.too_long = (f"the request body is larger than {cfg.limits.max_upload_mb} MB ([limits] max_upload_mb); "
                         "send a shorter clip (1-30 s is enough)")

    def capped(self, scope: dict, receive: Any) -> tuple[ApiError | None, Any]:
        """(a 413 for a /v1 body whose Content-Length passes `max_body`: refused unread, else None; `receive` that
        cuts a longer body off as soon as it passes the limit). FastAPI spools a whole multipart body before any
        route runs; the HTTPException raised from its read is answered by the app's handler."""
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), b"")
        if declared.isdigit() and int(declared) > self.max_body:
            return ApiError(413, self.too_long, code="file_too_large"), receive
        seen = 0

        async def receive_capped() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body:
                raise HTTPException(413, self.too_long)
            return message

        return None, receive_capped

    def rate_refusal(self, bucket: RateLimiter | None, what: str, reason: str, client: str) -> ApiError | None:
        """A 429 when `client` has no token left in `bucket` (counted as `reason`), else None (a token taken)."""
        if bucket is None or (wait_s := bucket.acquire(client)) <= 0:
            return None
        self.on_refused(reason)
        retry_s = max(1, math.ceil(wait_s))
        return ApiError(429, f"rate limit: at most {int(bucket.capacity)} {what} per minute per client; try again "
                        f"in {retry_s} s", code="rate_limit_exceeded", headers={"retry-after": str(retry_s)})

    def basic_user(self, scope: dict) -> str | None:
        """The user of valid HTTP Basic credentials of a configured login, else None."""
        if (creds := basic_credentials(scope)) is None:
            return None
        ok = [secrets.compare_digest(creds[0].encode(), user.encode()) & secrets.compare_digest(
            creds[1].encode(), password.encode()) for user, password in self.users]
        return creds[0] if any(ok) else None  # every pair compared (a list): no timing hint of which user exists

    async def logged_in(self, scope: dict) -> bool:
        """A login cookie the Gradio page accepts (its own check, `LOGIN_CHECK`: 200 or 401), or HTTP Basic
        credentials of a configured user."""
        if basic_credentials(scope) is not None:
            return self.basic_user(scope) is not None
        if self.gradio_app is None:
            return False
        status = 0

        async def nothing() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def answered(message: dict) -> None:
            nonlocal status
            status = message.get("status", status)

        cookies = [(k, v) for k, v in scope.get("headers", []) if k == b"cookie"]
        # (an HTTP request, also for a WebSocket session's scope)
        await self.gradio_app({**scope, "type": "http", "method": "GET", "path": LOGIN_CHECK,
                               "raw_path": LOGIN_CHECK.encode(), "root_path": "", "query_string": b"",
                               "headers": cookies, "state": {}},
                              nothing, answered)  # a state of its own: the page's app writes none into ours
        return status == 200

    async def allowed(self, scope: dict, path: str) -> bool:
        """Whether `path` may be served to this request."""
        ident = self.identity
        if path == "/metrics":
            if not (self.users or ident.any_key or self.metrics_token):
                return True
            scheme, token = authorization(scope)
            metrics_ok = bool(self.metrics_token) and scheme == "bearer" and secrets.compare_digest(
                token.encode(), self.metrics_token.encode())
            return metrics_ok or ident.bearer(scope) is not None or (bool(self.users) and await self.logged_in(scope))
        if path.startswith("/v1/") and ident.any_key and scope["type"] == "http":  # the API, its docs: a key
            # (a socket's key is its door's: ElevenLabs' comes in its own header or first message)
            return ident.bearer(scope) is not None
        if not self.users:
            return True
        if path.startswith("/studio/") or (path.startswith("/v1/") and not ident.any_key):
            return await self.logged_in(scope)
        return True

    async def refusal(self, scope: dict, receive: Any, path: str, client: str) -> tuple[ApiError | None, Any]:
        """The rate limit's, the login's (or key's) or the /v1 body cap's refusal of a request from an allowed
        origin, else None; and the `receive` to serve it with."""
        limited, receive = await self.limited(scope, receive, path)
        bucket, what, reason = (self.limiter, "synthesis requests", "rate_limit") if limited else \
            (self.uploads, "uploads", "uploads") if path == UPLOAD_PATH and scope.get("method") == "POST" else \
            (None, "", "")
        if (refused := self.rate_refusal(bucket, what, reason, client)) is not None:
            return refused, receive
        if not await self.allowed(scope, path):
            if self.identity.any_key and (path.startswith("/v1/") or path == "/metrics"):
                return ApiError(401, KEY_REFUSED, code="invalid_api_key", headers={"www-authenticate": "Bearer"}), \
                    receive
            return ApiError(401, LOGIN_REQUIRED, code="login_required", headers={
                "www-authenticate": 'Basic realm="CosyVoice2 Studio", charset="UTF-8"'}), receive
        if scope["type"] == "http" and path.startswith("/v1/"):
            return self.capped(scope, receive)
        return None, receive

    async def limited(self, scope: dict, receive: Any, path: str) -> tuple[bool, Any]:
        """Whether the request is a synthesis request of its client's rate limit (a queue/join body is read for
        the event it names), and the `receive` to serve it with."""
        if scope["type"] == "websocket":
            return is_synthesis_socket(path), receive
        if self.limiter is None or scope.get("method") != "POST":
            return False, receive
        if path == QUEUE_JOIN_PATH and self.limited_fns:
            body, receive = await peek_body(receive, MAX_JOIN_BODY)
            return _fn_index(body) in self.limited_fns, receive
        return path in SYNTH_PATHS, receive


class AccessLimits:
    """ASGI middleware applying a `Gate` to every door, HTTP and WebSocket alike: identity, the origin, the rate
    limit, then the login guard. It also stamps each request's arrival (`ARRIVAL_KEY`), so a handler can tell
    how long it queued."""

    def __init__(self, app: Any, gate: Gate) -> None:
        self.app, self.gate = app, gate

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})[ARRIVAL_KEY] = time.monotonic()
        gate, path = self.gate, scope.get("path", "")
        caller, set_cookie = gate.identity.identify(scope, gate.basic_user(scope) if gate.users else None)
        if not gate.origins.allows(scope):  # preflights too: a listed origin's are answered by CORSMiddleware
            gate.on_refused("origin")
            refused = ApiError(403, ORIGIN_REFUSED, code="origin_not_allowed")
        else:
            if set_cookie and scope["type"] == "http":
                send = with_cookie(send, set_cookie)
            refused, receive = await gate.refusal(scope, receive, path, caller.client)
        if refused is None:
            return await self.app(scope, receive, send)
        if scope["type"] == "http":
            return await error_response(refused)(scope, receive, send)
        code = SOCKET_CODE_BASE + refused.status  # the socket's own codes (a close before accepting reaches no one)
        log.info("refused a WebSocket session on %s (%d): %s", path, code, refused.message.split(":")[0])
        await refuse_socket(receive, send, code, refused.message)


def is_synthesis_socket(path: str) -> bool:
    """A socket whose session is a synthesis request of its client's per-minute limit."""
    return path == SOCKET_PATH or (path.startswith("/v1/text-to-speech/") and path.endswith(EL_SOCKET_ENDS))


ORIGIN_REFUSED = ("origin not allowed: this server takes browser requests from its own page and the origins in "
                  "[server] allowed_origins only")
KEY_REFUSED = ("missing or wrong API key: send 'Authorization: Bearer <key>' (the server's [server] api_key / "
               "api_keys / admin_key)")
LOGIN_REQUIRED = ("log in first: open the page and sign in, or send HTTP Basic credentials (the server's "
                  "[server] auth / COSYVOICE_AUTH)")


async def refuse_socket(receive: Any, send: Any, code: int, reason: str) -> None:
    """Accept the WebSocket (a close before accepting reaches a browser as 1006, without the reason), then its
    `socket_refusal`."""
    if (await receive())["type"] == "websocket.connect":
        for message in ({"type": "websocket.accept"}, *socket_refusal(code, reason)):
            await send(message)


def socket_refusal(code: int, reason: str) -> tuple[dict, dict]:
    """A socket's refusal as ASGI messages: `{"type": "error", "code", "message"}`, then the close with `code`
    (its reason cut to fit a close frame)."""
    return ({"type": "websocket.send", "text": json.dumps({"type": "error", "code": code, "message": reason})},
            {"type": "websocket.close", "code": code, "reason": reason.encode()[:120].decode(errors="ignore")})


async def peek_body(receive: Any, limit: int) -> tuple[bytes, Any]:
    """The first body bytes (up to `limit` or the end), and a `receive` replaying the messages read, then reading on."""
    messages, body = [], bytearray()
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        body += message.get("body", b"")
        if not message.get("more_body", False) or len(body) > limit:
            break

    async def replayed() -> dict:
        return messages.pop(0) if messages else await receive()

    return bytes(body), replayed


def _fn_index(body: bytes) -> int | None:
    """The event a queue/join body names (None: not JSON, not an object, or no integer `fn_index`)."""
    try:
        value = json.loads(body).get("fn_index")
    except (ValueError, AttributeError):  # not JSON, or not an object
        return None
    return value if isinstance(value, int) else None
