"""The cluster's front door: a FastAPI app on Ray Serve's HTTP proxy, in front of the `StudioReplica`s.

    /v1/*     forwarded to one replica (Serve routes by load: fewest ongoing requests of two picked),
              the response streamed back message by message (`bridge.PassThroughResponse`)
    /health   every replica's GET /health (`handle.broadcast`), merged (app/cluster/metrics.py)
    /metrics  every replica's GET /metrics with a `replica` label, plus cosyvoice_cluster_* totals

A replica that dies before it answered (Ray reports the actor gone) is skipped: the request goes to
another replica, up to `[cluster] request_retries` times, then 503 `replica_unavailable`. One that dies
mid-body breaks the client's connection (the body never ends cleanly). The studio page is not served
here (its Gradio session state lives in one process; README "Scale-out").
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request  # at module level: the routes' annotations are resolved by name
from fastapi.responses import JSONResponse, Response

from app.cluster.bridge import PassThroughResponse, request_dict
from app.cluster.metrics import merge_health, merge_metrics
from app.config import Config

log = logging.getLogger(__name__)

PAGE_NOTE = ("The studio page runs with `python app.py`; this cluster serves the API: /v1 (docs at /v1/docs "
             "on a replica), /health and /metrics.")


def ingress_class(cfg: Config) -> type:
    """The ingress deployment's class, its FastAPI routes bound to `cfg` (a Serve ingress is declared on a class)."""
    import ray.exceptions
    from ray import serve

    from app.server.errors import ApiError, error_response, install_error_handlers
    from app.server.limits import AccessLimits, Gate
    from app.server.openai_api import BODY_SLACK_BYTES
    from app.server.speech import RETRY_AFTER_S

    gone = (ray.exceptions.RayActorError,)  # ActorDiedError, ActorUnavailableError: the replica is gone
    srv, cl = cfg.server, cfg.cluster
    max_body = cfg.limits.max_upload_mb * 1024 * 1024 + BODY_SLACK_BYTES
    api = FastAPI(title=f"{cfg.ui.title} (cluster)", docs_url=None, redoc_url=None, openapi_url=None)
    # one rate-limit bucket per client for the whole cluster (each replica applies the same limits again,
    # never more tightly: it sees a share of the same client's requests)
    api.add_middleware(AccessLimits, gate=Gate(users=srv.auth_users, api_key=srv.api_key,
                                               rate_limit_per_minute=srv.rate_limit_per_minute,
                                               trust_proxy=srv.trust_proxy))
    install_error_handlers(api)

    @serve.ingress(api)
    class StudioIngress:
        def __init__(self, replicas: Any) -> None:
            self.replicas = replicas  # DeploymentHandle of StudioReplica

        async def _each(self, request: Request, path: str) -> list[Any]:
            """Every live replica's whole answer to GET `path` (the caller's headers), or the exception."""
            req = {"method": "GET", "path": path, "query_string": b"", "headers": list(request.scope["headers"]),
                   "body": b"", "client": request.scope.get("client")}
            try:
                return await self.replicas.broadcast("call", req).results_async(
                    timeout_s=cl.replica_timeout_s, return_exceptions=True)
            except Exception as e:  # timed out, or no replica is running yet: said in the body
                return [e]

        @api.get("/health")
        async def health(self, request: Request) -> JSONResponse:
            """200 when at least one replica is ready, else 503; each replica's /health under "replicas"."""
            body = merge_health(await self._each(request, "/health"))
            return JSONResponse(body, status_code=200 if body["ready"] else 503)

        @api.get("/metrics")
        async def metrics(self, request: Request) -> Response:
            """Prometheus text: every replica's families with a `replica` label, then cluster totals."""
            import prometheus_client

            texts, states = {}, {}
            for i, a in enumerate(await self._each(request, "/metrics")):
                if isinstance(a, BaseException) or a["status"] != 200:
                    states[f"unreachable-{i}"] = "unreachable"
                    continue
                rid = a["replica"]["id"]
                texts[rid] = a["body"].decode()
                states[rid] = "ready" if "\ncosyvoice_ready 1.0" in "\n" + texts[rid] else "not_ready"
            return Response(merge_metrics(texts, states), media_type=prometheus_client.CONTENT_TYPE_LATEST)

        @api.get("/")
        async def page(self) -> JSONResponse:
            return JSONResponse({"note": PAGE_NOTE})

        @api.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
        async def forward(self, request: Request, path: str):
            """One replica's answer to this /v1 request, streamed as it sends it."""
            req = await request_dict(request, max_body)
            last: BaseException | None = None
            for attempt in range(1 + cl.request_retries):
                stream = self.replicas.options(stream=True).asgi.remote(req)
                try:
                    start = await stream.__anext__()  # the status line: after the first audio for speech
                except gone as e:
                    stream.cancel()
                    last = e
                    log.warning("replica gone before answering %s (attempt %d): %s", req["path"], attempt + 1, e)
                    continue
                return PassThroughResponse(start, stream, on_close=_closer(stream))
            return error_response(ApiError(
                503, f"no replica could take the request (the last one: {type(last).__name__}); try again in a "
                "minute while the cluster restarts replicas", code="replica_unavailable",
                headers={"Retry-After": str(RETRY_AFTER_S)}))

    return StudioIngress


def _closer(stream: Any):
    async def close() -> None:
        stream.cancel()  # a no-op after the end; on a client gone it cancels the replica's generator
    return close
