"""The cluster's front door: a FastAPI app on Ray Serve's HTTP proxy, in front of the `StudioReplica`s.

Design notes: docs/cluster.md.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from fastapi import FastAPI, Request  # at module level: the routes' annotations are resolved by name
from fastapi.responses import JSONResponse, Response

from app.cluster.bridge import PassThroughResponse, request_dict
from app.cluster.metrics import merge_health, merge_metrics
from app.config import Config
from app.message import Message

log = logging.getLogger(__name__)


def ingress_class(cfg: Config) -> type:
    """The ingress deployment's class for `cfg` (its app is built in the replica: `build_ingress_app`)."""
    from ray import serve

    @serve.ingress()
    class StudioIngress:
        async def __init__(self, replicas: Any) -> None:
            from app.cluster.page import ClusterService

            self.replicas = replicas  # DeploymentHandle of StudioReplica
            self.page = ClusterService(cfg, replicas)
            await self.page.refresh()

        def __serve_build_asgi_app__(self) -> Any:
            return build_ingress_app(cfg, self.replicas, self.page)

    return StudioIngress


def build_ingress_app(cfg: Config, replicas: Any, page: Any) -> Any:
    """The ingress's ASGI app: the routes above for the `replicas` handle, the page on `page` (a ClusterService)."""
    from app.server.errors import install_error_handlers
    from app.server.identity import ProxyClient
    from app.server.limits import AccessLimits, Gate
    from app.server.main import mount_page
    from app.server.origins import add_cors
    from app.server.studio_stream import add_studio_routes
    from app.server.studio_timings import PageTimings

    api = FastAPI(title=f"{cfg.ui.title} (cluster)", docs_url=None, redoc_url=None, openapi_url=None)
    add_cors(api, cfg.server)  # inside the gate, as build_api's
    # one rate-limit bucket per client for the whole cluster (each replica applies the same limits again to
    # /v1, never more tightly: it sees a share of the same client's requests); the page's login is checked here
    gate = Gate(cfg)
    api.add_middleware(AccessLimits, gate=gate)  # refusals cost no other middleware
    api.add_middleware(ProxyClient, server=cfg.server)  # outermost: the client a proxy names (replicas get it)
    install_error_handlers(api)
    add_ops_routes(api, cfg, replicas, page)
    add_forward_route(api, cfg, replicas)
    # before the page: its mount at "/" takes every path not routed by then
    # the page's takes are made on the replicas: their word timings are not (no aligner at the ingress)
    off = Message("page_timings_cluster", "word timings are not made for the page on a cluster")
    add_studio_routes(api, page, weakref.WeakValueDictionary(), PageTimings(page, off))
    return mount_page(api, gate, page)


def add_ops_routes(api: FastAPI, cfg: Config, replicas: Any, page: Any) -> None:
    """/health and /metrics: every replica's, merged."""
    from app.cluster.page import LOCAL_CLIENT
    from app.server.identity import caller_of

    async def each(request: Request, path: str) -> list[Any]:
        """Every live replica's whole answer to GET `path` (the caller's headers), or the exception."""
        req = {"method": "GET", "path": path, "query_string": b"", "headers": list(request.scope["headers"]),
               "body": b"", "client": LOCAL_CLIENT}  # the ingress reads the details; it tells strangers less
        try:
            return await replicas.broadcast("call", req).results_async(
                timeout_s=cfg.cluster.replica_timeout_s, return_exceptions=True)
        except Exception as e:  # timed out, or no replica is running yet: said in the body
            return [e]

    @api.get("/health")
    async def health(request: Request) -> JSONResponse:
        """200 when at least one replica is ready, else 503; each replica's /health under "replicas"."""
        body = merge_health(await each(request, "/health"))
        await page.observe(body)  # the page's status is this fresh too
        if not caller_of(request.scope).admin:  # anybody: ready, backend, model name, version, voices
            body = page.public_health(ready=body["ready"])
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @api.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus text: every replica's families with a `replica` label, then cluster totals."""
        import prometheus_client

        texts, states = {}, {}
        for i, a in enumerate(await each(request, "/metrics")):
            if isinstance(a, BaseException) or a["status"] != 200:
                states[f"unreachable-{i}"] = "unreachable"
                continue
            rid = a["replica"]["id"]
            texts[rid] = a["body"].decode()
            states[rid] = "ready" if "\ncosyvoice_ready 1.0" in "\n" + texts[rid] else "not_ready"
        merged = merge_metrics(texts, states)
        if not caller_of(request.scope).admin:  # no paths, engine arguments or versions (docs/access.md)
            from app.server.prometheus import public_text

            merged = public_text(merged, page.model_name())
        return Response(merged, media_type=prometheus_client.CONTENT_TYPE_LATEST)


def add_forward_route(api: FastAPI, cfg: Config, replicas: Any) -> None:
    """/v1/*: to one replica, retried on another while replicas are gone before answering."""
    import ray.exceptions

    from app.server.errors import ApiError, error_response
    from app.service.refusals import RETRY_AFTER_S

    gone = (ray.exceptions.RayActorError,)  # ActorDiedError, ActorUnavailableError: the replica is gone

    @api.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def forward(request: Request, path: str):
        """One replica's answer to this /v1 request, streamed as it sends it."""
        req = await request_dict(request)
        last: BaseException | None = None
        for attempt in range(1 + cfg.cluster.request_retries):
            stream = replicas.options(stream=True).asgi.remote(req)
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


def _closer(stream: Any):
    async def close() -> None:
        stream.cancel()  # a no-op after the end; on a client gone it cancels the replica's generator
    return close
