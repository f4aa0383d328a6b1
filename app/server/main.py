"""The one server: FastAPI with /health, /metrics and the /v1 API, the Gradio studio mounted at "/" (docs/design.md)."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from typing import Any

import gradio as gr
from fastapi import FastAPI, Request  # Request at module level: the routes' annotations are resolved by name
from fastapi.responses import JSONResponse
from starlette.routing import Mount

from app.config import Config
from app.server.elevenlabs_ws import elevenlabs_router
from app.server.errors import install_error_handlers
from app.server.identity import ProxyClient, caller_of
from app.server.limits import LIMITED_EVENTS, AccessLimits, Gate
from app.server.openai_api import api_router
from app.server.origins import add_cors
from app.server.prometheus import add_metrics_route
from app.server.studio_stream import PageStreams, add_studio_routes
from app.server.studio_timings import PageTimings, page_timings_off
from app.server.ws_speech import ws_router
from app.service.service import ASSETS_DIR, StudioService


def build_server(cfg: Config):
    """The ASGI app `python app.py` serves."""
    service = StudioService(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        task = asyncio.create_task(service.start())  # the page is served (with the status) meanwhile
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await service.aclose()

    api, gate = build_api(cfg, service, lifespan)
    ending = asyncio.Event()  # set at Ctrl+C / SIGTERM (app.py): the open pages' streams end
    api.add_middleware(PageStreams, ending=ending)
    api.state.end_page_streams = ending.set
    api.add_middleware(ProxyClient, server=cfg.server)  # outermost: every layer reads the client a proxy names
    return mount_page(api, gate, service)


def mount_page(api: Any, gate: Any, service: Any) -> Any:
    """Mount the studio page for `service` at "/" on `api` (routes added after it are never reached) and
    tell `gate` (its `AccessLimits`) the page's login tokens and rate-limited events; returns the app.
    Also the cluster's ingress (app/cluster/ingress.py), whose `service` is a `ClusterService`."""
    from app.ui.layout import build_demo  # the page only: a cluster replica never imports it

    cfg = service.cfg
    srv = cfg.server
    demo, i18n = build_demo(service)
    app = gr.mount_gradio_app(api, demo, path="/", i18n=i18n, allowed_paths=[str(ASSETS_DIR)],
                              max_file_size=f"{cfg.limits.max_upload_mb}mb", ssr_mode=False,
                              footer_links=["api", "gradio", "settings"], auth=srv.auth_users or None,
                              auth_message="Sign in to use the CosyVoice2 Studio." if srv.auth_users else None)
    gate.gradio_app = next(r.app for r in api.routes if isinstance(r, Mount) and r.path == "")
    gate.limited_fns = frozenset(i for i, fn in demo.fns.items() if fn.api_name in LIMITED_EVENTS)
    # Gradio refuses API file inputs that were not uploaded through it (a FileData naming any server
    # path) only once `has_launched` is set, which `launch()` does and mounting never does
    demo.has_launched = True
    return app


def build_api(cfg: Config, service: StudioService, lifespan: Any = None) -> tuple[Any, Any]:
    """The FastAPI app without the page: /health, /metrics, /v1 and /studio for `service`, behind
    `AccessLimits`; returns (app, gate). `build_server` mounts the page on it; a Ray Serve replica
    (app/cluster/replica.py) serves it as it is, its service started by the replica itself."""
    api = FastAPI(title=cfg.ui.title, lifespan=lifespan, docs_url="/v1/docs", redoc_url=None,
                  openapi_url="/v1/openapi.json")
    add_cors(api, cfg.server)  # inside the gate: CORS answers for the listed origins only (docs/access.md)
    gate = Gate(cfg, service.metrics.share_refused)
    api.add_middleware(AccessLimits, gate=gate)  # outermost: refusals cost no other middleware
    install_error_handlers(api)

    @api.get("/health", tags=["ops"])
    def health(request: Request):
        """200 when ready to synthesise, else 503. Anybody: ready, backend, model name, version; the admin key
        and local clients: also the reason, counters and engine facts (paths, engine arguments)."""
        # the admin's view is the public one and more, never less
        body = {**service.public_health(), **service.health()} if caller_of(request.scope).admin else \
            service.public_health()
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    add_metrics_route(api, service)

    stops = weakref.WeakValueDictionary()  # the page's Stop reaches its takes through either door
    timings = PageTimings(service, page_timings_off(service.cfg.asr))  # so do the words panel's timings
    api.include_router(ws_router(service, gate.identity, stops, timings))  # before api_router's catch-all /v1 route
    api.include_router(elevenlabs_router(service, gate.identity, stops))  # ElevenLabs' socket paths, the same seam
    api.include_router(api_router(service))
    add_studio_routes(api, service, stops, timings)
    return api, gate
