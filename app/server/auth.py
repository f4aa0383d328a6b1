"""Optional bearer-token auth for the /v1 API (`[server] api_key`, or COSYVOICE_API_KEY in app.py).

With a key set, every /v1 route needs `Authorization: Bearer <key>` (what the `openai` SDK sends
for `api_key=`); compared in constant time. /health and /metrics stay open for probes and scrapers.
"""

from __future__ import annotations

import secrets

from fastapi import Request

from app.server.errors import ApiError


def bearer_auth(api_key: str):
    """A FastAPI dependency that checks the bearer token against `api_key` ("" = no auth)."""

    async def check(request: Request) -> None:
        if not api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (the server's "
                           "[server] api_key / COSYVOICE_API_KEY)", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    return check
