"""Which web pages may call this server from a visitor's browser: the page's own origin, a Space's, and
`[server] allowed_origins` (docs/access.md). A request without an `Origin` header is no browser's cross-site
call (curl, the SDKs, a same-origin navigation) and passes; any other origin is refused, since the visitor's
cookie (`SameSite=None` on a Space) would otherwise let a hostile page speak in that visitor's voices."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware

from app.config import ServerConfig

DEFAULT_PORTS = {"http": 80, "https": 443}
# the speech answers' facts a listed page may read (a credentialed answer cannot expose "*")
EXPOSED_HEADERS = ("X-Request-Id", "X-Seed", "X-Mode", "X-Queue-Ms", "X-TTFA-Ms", "X-Server-Ms", "X-Sample-Rate",
                   "Retry-After", "Content-Disposition")


def origin_key(origin: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an origin ("https://a.b[:port]"), in lower case; None for "null" (a sandboxed
    frame, a local file) or a malformed one."""
    try:
        parts = urlsplit(origin.strip())
        scheme = parts.scheme.lower()
        port = parts.port or DEFAULT_PORTS.get(scheme)
    except ValueError:  # a port out of range or not a number
        return None
    if not parts.hostname or port is None:
        return None
    return scheme, parts.hostname.lower(), port


class OriginPolicy:
    """`allows(scope)`: whether the request's `Origin` may call: none (no browser's cross-site call), the page's
    own, or one of `[server] allowed_origins`."""

    def __init__(self, server: ServerConfig) -> None:
        self.allowed = frozenset(filter(None, map(origin_key, server.origin_list)))
        self.proxied = server.proxied  # a proxy in front may rewrite Host: X-Forwarded-Host names the page's then

    def allows(self, scope: dict) -> bool:
        headers = Headers(scope=scope)
        if (origin := headers.get("origin")) is None:
            return True
        if (key := origin_key(origin)) is None:
            return False
        if key in self.allowed:
            return True
        hosts = [headers.get("host", "")]
        if self.proxied:
            hosts += [h.split(",")[0] for h in headers.getlist("x-forwarded-host")]
        # the page's own origin: its host and port, whichever scheme (TLS may end at a proxy in front)
        scheme = key[0]
        return any(h.strip() and origin_key(f"{scheme}://{h.strip()}") == key for h in hosts)


def add_cors(app: Any, server: ServerConfig) -> None:
    """CORS answers for the listed origins only, on every route, the page's included: Gradio's own middleware
    (which reflects any Origin with credentials) steps aside for a parent app that has Starlette's. Add it
    inside `AccessLimits`, which refuses an unlisted foreign origin before it."""
    origins = [f"{scheme}://{host}" + ("" if DEFAULT_PORTS[scheme] == port else f":{port}")
               for scheme, host, port in filter(None, map(origin_key, server.origin_list))]
    app.add_middleware(CORSMiddleware, allow_origins=origins, allow_credentials=True, allow_methods=["*"],
                       allow_headers=["*"], expose_headers=EXPOSED_HEADERS)
