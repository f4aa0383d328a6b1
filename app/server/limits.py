"""Who may call what, and how often: the login guard of /studio and /v1, the /v1 bearer key, the allowed
origins, and the per-client rate limit, for every door, the WebSocket one included (docs/design.md)."""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from fastapi import Request

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
# the socket's refusals, as its own (app/server/ws_speech.py): HTTP's status + 4000
SOCKET_UNAUTHORIZED, SOCKET_FORBIDDEN, SOCKET_RATE_LIMITED = 4401, 4403, 4429
QUEUE_JOIN_PATH = "/gradio_api/queue/join"
UPLOAD_PATH = "/gradio_api/upload"  # the page's files: references, a take's WAV for another download format
LOGIN_CHECK = "/gradio_api/login_check"  # the page's own test of its login cookie: 200 or 401
UPLOADS_PER_REQUEST = 2  # a client's uploads per minute: this many times its synthesis requests
LIMITED_EVENTS = ("synthesize", "save_voice")  # the page's events that run the model
DOC_PATHS = frozenset({"/v1/docs", "/v1/openapi.json"})
MAX_JOIN_BODY = 64 * 1024  # a queue/join body is small JSON (files are uploaded before it)
MAX_CLIENTS = 10_000  # buckets kept; the longest idle client is forgotten (= back to a full bucket)


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


def bearer_auth(identity: Identity):
    """A FastAPI dependency: a configured API key in `Authorization: Bearer` (none configured = no auth)."""

    async def check(request: Request) -> None:
        if identity.any_key and identity.bearer(request.scope) is None:
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (the server's "
                           "[server] api_key / api_keys / admin_key)", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    return check


def basic_credentials(scope: dict) -> tuple[str, str] | None:
    """(user, password) from an `Authorization: Basic` header (the first one), else None."""
    scheme, token = authorization(scope)
    if scheme != "basic":
        return None
    try:
        user, sep, password = base64.b64decode(token, validate=True).decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return (user, password) if sep else None


class Gate:
    """The settings `AccessLimits` applies; `gradio_app` and `limited_fns` are filled in once Gradio is mounted."""

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
        """Whether `path` may be served to this request (the /v1 routes check their key themselves)."""
        ident = self.identity
        if path == "/metrics":
            if not (self.users or ident.any_key or self.metrics_token):
                return True
            scheme, token = authorization(scope)
            metrics_ok = bool(self.metrics_token) and scheme == "bearer" and secrets.compare_digest(
                token.encode(), self.metrics_token.encode())
            return metrics_ok or ident.bearer(scope) is not None or (bool(self.users) and await self.logged_in(scope))
        if path in DOC_PATHS and ident.any_key:
            return ident.bearer(scope) is not None
        if not self.users:
            return True
        if path.startswith("/studio/") or (path.startswith("/v1/") and not ident.any_key):
            return await self.logged_in(scope)
        return True


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
        if scope["type"] == "websocket":
            return await self.socket(scope, receive, send, caller.client)
        if not gate.origins.allows(scope):  # preflights too: a listed origin's are answered by CORSMiddleware
            gate.on_refused("origin")
            return await error_response(ApiError(403, ORIGIN_REFUSED, code="origin_not_allowed"))(scope, receive, send)
        if set_cookie:
            send = with_cookie(send, set_cookie)
        if gate.limiter is not None and scope.get("method") == "POST":
            limited = path in SYNTH_PATHS
            if path == QUEUE_JOIN_PATH and gate.limited_fns:
                body, receive = await peek_body(receive, MAX_JOIN_BODY)
                limited = _fn_index(body) in gate.limited_fns
            bucket, what, reason = (gate.limiter, "synthesis requests", "rate_limit") if limited else \
                (gate.uploads, "uploads", "uploads") if path == UPLOAD_PATH else (None, "", "")
            if (refused := gate.rate_refusal(bucket, what, reason, caller.client)) is not None:
                return await error_response(refused)(scope, receive, send)
        if await gate.allowed(scope, path):
            return await self.app(scope, receive, send)
        if gate.identity.any_key and (path.startswith("/v1/") or path == "/metrics"):
            refused = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key", headers={"www-authenticate": "Bearer"})
        else:
            refused = ApiError(401, LOGIN_REQUIRED, code="login_required",
                               headers={"www-authenticate": 'Basic realm="CosyVoice2 Studio", charset="UTF-8"'})
        await error_response(refused)(scope, receive, send)

    async def socket(self, scope: dict, receive: Any, send: Any, client: str) -> None:
        """A WebSocket session: the same origin, rate limit and login as HTTP; a refusal is an `error` message
        and a 44xx close (the socket's own codes), with one log line and no traceback."""
        gate, path = self.gate, scope.get("path", "")
        refused = None
        if not gate.origins.allows(scope):
            gate.on_refused("origin")
            refused = SOCKET_FORBIDDEN, ORIGIN_REFUSED
        elif is_synthesis_socket(path) and (e := gate.rate_refusal(gate.limiter, "synthesis requests", "rate_limit",
                                                             client)) is not None:
            refused = SOCKET_RATE_LIMITED, e.message
        elif not await gate.allowed(scope, path):
            refused = SOCKET_UNAUTHORIZED, LOGIN_REQUIRED
        if refused is None:
            return await self.app(scope, receive, send)
        log.info("refused a WebSocket session on %s (%d): %s", path, refused[0], refused[1].split(":")[0])
        await refuse_socket(receive, send, *refused)


def is_synthesis_socket(path: str) -> bool:
    """A socket whose session is a synthesis request of its client's per-minute limit."""
    return path == SOCKET_PATH or (path.startswith("/v1/text-to-speech/") and path.endswith(EL_SOCKET_ENDS))


ORIGIN_REFUSED = ("origin not allowed: this server takes browser requests from its own page and the origins in "
                  "[server] allowed_origins only")
LOGIN_REQUIRED = ("log in first: open the page and sign in, or send HTTP Basic credentials (the server's "
                  "[server] auth / COSYVOICE_AUTH)")


async def refuse_socket(receive: Any, send: Any, code: int, reason: str) -> None:
    """Accept the WebSocket (a close before accepting reaches a browser as 1006, without the reason), send
    `{"type": "error", "code", "message"}` and close with `code`."""
    if (await receive())["type"] != "websocket.connect":
        return
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.send", "text": json.dumps({"type": "error", "code": code, "message": reason})})
    await send({"type": "websocket.close", "code": code, "reason": reason.encode()[:120].decode(errors="ignore")})


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
