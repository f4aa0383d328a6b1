"""One Ray Serve replica: one `StudioService` (model, vLLM engine, token2wav) on one GPU (`[cluster] num_gpus`).

Design notes: docs/cluster.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from app.cluster.bridge import collect, run_asgi
from app.config import Config

log = logging.getLogger(__name__)

OUT_OF_RESTARTS = "restart the server"  # the end of VLLMBackend.fault() once no restart is left


class StudioReplica:
    """A Serve deployment class (`app/cluster/deploy.py` applies its options from `[cluster]`)."""

    async def __init__(self, cfg: Config) -> None:
        import ray
        from ray import serve

        from app.server.main import build_api
        from app.service.service import StudioService

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node = ray.util.get_node_ip_address()
        self.service = StudioService(cfg)
        self.app, _gate = build_api(cfg, self.service)
        await self.service.start()  # never raises: the outcome is in ready / error
        if not self.service.ready:
            error = self.service.error or self.service.status
            await self.service.aclose()
            raise RuntimeError(f"replica {self.replica_id} could not start: {error}")
        log.info("replica %s ready (pid %d, node %s)", self.replica_id, os.getpid(), self.node)

    def identity(self) -> dict[str, Any]:
        """Which replica this is: Serve's replica id, its process id and its node's address."""
        return {"id": self.replica_id, "pid": os.getpid(), "node": self.node}

    async def asgi(self, req: dict[str, Any]) -> AsyncIterator[dict]:
        """One HTTP request (a bridge.request_dict) through the app; yields its ASGI messages as sent."""
        async with contextlib.aclosing(run_asgi(self.app, req, replica_id=self.replica_id)) as messages:
            async for message in messages:
                yield message

    async def call(self, req: dict[str, Any]) -> dict[str, Any]:
        """A whole small response (GET /health, /metrics) plus `identity()`: what `broadcast` collects."""
        return {**await collect(run_asgi(self.app, req, replica_id=self.replica_id)), "replica": self.identity()}

    # --- the page's calls (app/cluster/page.py: the studio page runs in the ingress) ------------------

    async def speak(self, req: Any, queue_wait_s: float, prepared: Any) -> AsyncIterator[Any]:
        """A page request: admitted here (this replica's slots and queue), its `AudioChunk`s as made, then its
        `RequestRecord`. Closing early (Stop, a closed tab) aborts the LM request as on the single server."""
        async with self.service.speak(req, prepared=prepared, queue_wait_s=queue_wait_s) as (_, chunks):
            async for chunk in chunks:
                yield chunk
        yield self.service.metrics.record(req.request_id)

    async def voice_from_audio(self, data: bytes, prompt_text: str) -> Any:
        """A reference clip's features (this replica's per-voice cache, keyed by content)."""
        self.service.require_ready()
        return await self.service.voice_from_audio(data, prompt_text)

    async def transcribe(self, data: bytes, retry: bool) -> Any:
        """Whisper's `Transcript` of a clip (this replica's transcriber, loaded on first use)."""
        return await self.service.asr.transcribe(data, retry=retry)

    def model_fingerprint(self) -> str:
        """The loaded model's fingerprint: the page's voice store writes saved voices with it."""
        return self.service.voices.model_fingerprint

    def check_health(self) -> None:
        """Serve's periodic probe: raise (Serve replaces the replica) once the engine is dead for good."""
        fault = self.service.engine_fault()
        if fault and fault.endswith(OUT_OF_RESTARTS):
            raise RuntimeError(fault)

    async def __del__(self) -> None:
        await self.service.aclose()
