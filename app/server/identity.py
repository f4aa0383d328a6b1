"""Who is calling: the owner of the voices a request may use, and the client its fair share is counted for
(docs/design.md)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

from starlette.requests import HTTPConnection
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from app.config import Config, ServerConfig
from app.service.owners import CALLER_KEY, NOBODY, Caller, Owner

log = logging.getLogger(__name__)
VISITOR_COOKIE = "cosyvoice_visitor"
SESSION_COOKIE, SESSION_MAX_AGE_S = "session", 14 * 24 * 3600  # Gradio's OAuth session (Starlette's defaults)
COOKIE_MAX_AGE_S = 400 * 24 * 3600  # browsers cap a cookie's life at 400 days
SECRET_FILE = ".visitor-secret"


def authorization(scope: dict) -> tuple[str, str]:
    """(scheme in lower case, credentials) of the request's first Authorization header; ("", "") if none."""
    scheme, _, token = HTTPConnection(scope).headers.get("authorization", "").partition(" ")
    return scheme.lower(), token.strip()


class ProxyClient:
    """uvicorn's ProxyHeadersMiddleware for the configured proxies: every route, the WebSocket door and Gradio
    read in `scope["client"]` (and "scheme") the client a trusted proxy names. No proxy configured: a no-op."""

    def __init__(self, app: Any, server: ServerConfig) -> None:
        self.app, self.any_peer = app, server.trust_proxy
        # the rightmost X-Forwarded-For entry that is not itself a trusted proxy (an appending proxy wrote it)
        self.networks = ProxyHeadersMiddleware(app, [str(n) for n in server.proxy_networks])

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self.any_peer and scope.get("client"):
            # trust_proxy: the peer, whoever it is, is the one proxy, so the last entry (uvicorn's "*" would
            # take the first, which the client itself writes)
            return await ProxyHeadersMiddleware(self.app, [scope["client"][0]])(scope, receive, send)
        return await self.networks(scope, receive, send)


def is_local(scope: dict) -> bool:
    """A loopback connection that no proxy forwarded (a proxied request is never "local")."""
    client = scope.get("client")
    if not client or "x-forwarded-for" in HTTPConnection(scope).headers:
        return False
    try:
        return ipaddress.ip_address(client[0]).is_loopback
    except ValueError:
        return client[0] == "localhost"


def caller_of(scope: dict) -> Caller:
    """The Caller AccessLimits found for `scope` (nobody's where no gate ran: tools, tests)."""
    return scope.get("state", {}).get(CALLER_KEY, NOBODY)


def session_user(scope: dict) -> str | None:
    """The Hugging Face user of Gradio's OAuth session cookie (a Space with hf_oauth), else None. Read as
    gradio/oauth.py's SessionMiddleware writes it, so /studio (outside Gradio's app) knows who signed in."""
    raw = HTTPConnection(scope).cookies.get(SESSION_COOKIE)
    if not raw or not os.environ.get("OAUTH_CLIENT_ID"):
        return None
    from itsdangerous import BadSignature, TimestampSigner  # gradio[oauth]'s, present where OAuth is

    key = hashlib.sha256((os.environ.get("OAUTH_CLIENT_SECRET", "") + "-v4").encode()).hexdigest()
    try:
        data = json.loads(base64.b64decode(TimestampSigner(key).unsign(raw.encode(), max_age=SESSION_MAX_AGE_S)))
    except (BadSignature, ValueError):
        return None
    info = data.get("oauth_info") or {}
    if info.get("expires_at") is not None and info["expires_at"] < time.time():
        return None
    return (info.get("userinfo") or {}).get("preferred_username") or None


def load_secret(voices_dir: str) -> bytes:
    """COSYVOICE_SECRET, else the key kept beside the voices (made once, readable by this user only); a folder
    that cannot be written gets a key for this process alone (cookies then last until a restart)."""
    if env := os.environ.get("COSYVOICE_SECRET"):
        return env.encode()
    path = Path(voices_dir).expanduser() / SECRET_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_bytes()
    except OSError as e:
        log.warning("cannot write %s (%s): visitor cookies are signed with a key that lasts until a restart",
                    path, e.strerror or type(e).__name__)
        return secrets.token_hex(32).encode()
    with os.fdopen(fd, "wb") as f:  # another process racing here reads the file the winner wrote
        f.write(secrets.token_hex(32).encode())
    return path.read_bytes()


class Identity:
    """The owner and client of each request (docs/design.md)."""

    def __init__(self, cfg: Config) -> None:
        srv = cfg.server
        self.keys: list[tuple[str, Owner]] = [(k, Owner(f"key:{o}")) for o, k in srv.api_key_pairs]
        if srv.api_key:
            self.keys.append((srv.api_key, Owner("key:api")))
        if srv.admin_key:
            self.keys.append((srv.admin_key, Owner("admin", admin=True)))
        self.private = cfg.voices.resolved(srv) == "private"
        # a proxy on this machine (nginx on 127.0.0.1): then a loopback connection is any client's, not an admin's
        self.local_proxy = srv.trust_proxy or any(ipaddress.ip_address(a) in net for net in srv.proxy_networks
                                                  for a in ("127.0.0.1", "::1"))
        self.any_key = bool(self.keys)
        self._voices_dir, self._secret = srv.voices_dir, b""

    def bearer(self, scope: dict) -> Owner | None:
        """The owner of the API key in `Authorization: Bearer` (every key compared in constant time), else None."""
        scheme, token = authorization(scope)
        if scheme != "bearer" or not token:
            return None
        found = [owner for key, owner in self.keys if secrets.compare_digest(token.encode(), key.encode())]
        return found[-1] if found else None  # a list, not next(): no timing hint of which key matched

    def identify(self, scope: dict, basic_user: str | None) -> tuple[Caller, str | None]:
        """Who sent `scope` (`basic_user`: a valid HTTP Basic login's user), also written into its state, and a
        Set-Cookie value for the answer (a new visitor) or None."""
        ip = (scope.get("client") or ("unknown",))[0]  # as a trusted proxy names it (ProxyClient)
        set_cookie = None
        if (owner := self.bearer(scope)) is not None:
            client = owner.id
        elif basic_user:  # a login is often one password for a whole group: its share stays per address
            owner, client = Owner(f"user:{basic_user}"), f"ip:{ip}"
        else:
            visitor, set_cookie = self._visitor(scope) if self.private else ("", None)
            hf_user = session_user(scope) if self.private else None  # as the page's profile: private scope only
            owner = Owner(f"hf:{hf_user}" if hf_user else f"visitor:{visitor}" if visitor else "")
            client = f"ip:{ip}"
        # an admin: the admin key, or this machine itself: a loopback connection no proxy forwarded, unless a
        # trusted proxy runs on this machine (then every client arrives from loopback)
        admin = owner.admin or (not self.local_proxy and is_local(scope))
        caller = scope.setdefault("state", {})[CALLER_KEY] = Caller(owner, client, admin)
        return caller, set_cookie

    def _sign(self, visitor: str) -> str:
        self._secret = self._secret or load_secret(self._voices_dir)
        mac = hmac.new(self._secret, visitor.encode(), hashlib.sha256).digest()[:18]
        return base64.urlsafe_b64encode(mac).decode()

    def _visitor(self, scope: dict) -> tuple[str, str | None]:
        # (visitor id, Set-Cookie value or None): the cookie's id if its signature holds, else a new id whose
        # cookie also goes into the request's own headers (a proxy behind us, e.g. the cluster's replicas,
        # then sees the same visitor on this first request)
        conn = HTTPConnection(scope)
        visitor, _, mac = conn.cookies.get(VISITOR_COOKIE, "").partition(".")
        if visitor and mac and hmac.compare_digest(mac, self._sign(visitor)):
            return visitor, None
        visitor = secrets.token_hex(12)
        value = f"{visitor}.{self._sign(visitor)}"
        others = [p.strip() for h in conn.headers.getlist("cookie") for p in h.split(";")
                  if p.strip() and p.strip().partition("=")[0] != VISITOR_COOKIE]
        scope["headers"] = [*(h for h in scope.get("headers", ()) if h[0] != b"cookie"),
                            (b"cookie", "; ".join([*others, f"{VISITOR_COOKIE}={value}"]).encode())]
        https = scope.get("scheme") == "https" or "https" in conn.headers.getlist("x-forwarded-proto")
        attrs = "SameSite=None; Secure" if https else "SameSite=Lax"  # a Space's page is an iframe over HTTPS
        return visitor, f"{VISITOR_COOKIE}={value}; Path=/; Max-Age={COOKIE_MAX_AGE_S}; HttpOnly; {attrs}"


def with_cookie(send, set_cookie: str):
    """`send` that adds `set_cookie` to the response's start message."""
    async def sending(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", set_cookie.encode())]}
        await send(message)
    return sending
