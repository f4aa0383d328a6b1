"""The studio page on the cluster's ingress: `ClusterService`, the part of `StudioService` the page uses.

Design notes: docs/cluster.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from app.config import Config
from app.engine.requests import AudioChunk, SynthesisRequest
from app.service.fair_share import FairShare
from app.service.metrics import Metrics, RequestRecord
from app.service.owners import NOBODY, Caller, OwnedVoices
from app.service.service import NotReadyError, public_facts

log = logging.getLogger(__name__)

LOCAL_CLIENT = ("127.0.0.1", 0)  # the ingress asks the replicas as a local client (their /health details)
HEALTH_TTL_S = 2.0  # the page's readings of the cluster's state are at most this old (plus one refresh)


def page_config(cfg: Config) -> Config:
    """`cfg` for the page in the ingress: its Gradio queue runs (and holds waiting) as many syntheses as the
    cluster at its largest, each replica's own admission (slots + queue) being the real limit."""
    s, n = cfg.server, cfg.cluster.max_replicas
    return replace(cfg, server=replace(s, concurrency_limit=s.concurrency_limit * n,
                                       queue_max_size=s.queue_max_size * n))


class ReplicaGoneError(NotReadyError):
    """The replica serving a request went away before it finished (the page says "Not ready")."""


class ClusterAsr:
    """`Transcriber`'s surface for the page: the clip goes to a replica's Whisper (no download progress)."""

    def __init__(self, service: ClusterService) -> None:
        self.cfg, self._service = service.cfg.asr, service

    async def transcribe(self, src: str | Path | bytes, *, report: Any = None, retry: bool = False) -> Any:
        return await self._service.call("transcribe", await _bytes(src), retry)


async def _bytes(src: str | Path | bytes) -> bytes:
    return src if isinstance(src, bytes) else await asyncio.to_thread(Path(src).read_bytes)


class ClusterService:
    """The page's service in the ingress: state from the replicas' /health, work on the replicas."""

    backend = None  # no engine in this process (the panels' memory sample is the ingress's own)

    def __init__(self, cfg: Config, replicas: Any) -> None:
        import ray.exceptions

        self.cfg, self.replicas = page_config(cfg), replicas  # DeploymentHandle of StudioReplica
        self._gone = (ray.exceptions.RayActorError,)  # ActorDiedError, ActorUnavailableError
        self._task_error = ray.exceptions.RayTaskError
        self.metrics = Metrics()  # the page's requests, finished with the replicas' records (`add`)
        self.asr = ClusterAsr(self)
        # the shared store, owners and all (app/service/owners.py); fingerprint: the replicas', once one answered
        self.voices = OwnedVoices(cfg.server.voices_dir, cfg.voices.resolved(cfg.server),
                                  cfg.limits.max_transcript_chars)
        self.share = FairShare(cfg.server.streams_per_client, self.metrics)  # the page's clients, as on one server
        self.health: dict[str, Any] = {"ready": False, "status": "waiting for the replicas", "replicas": []}
        self._fetched_at = -float("inf")  # time.monotonic()
        self._fingerprinted = False
        self._refreshing: Any = None  # the pending refresh (a concurrent.futures.Future)
        self._loop = asyncio.get_running_loop()  # made on the ingress's loop, where the handle's calls run

    # --- the cluster's state ----------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read every replica's /health (and, once, the model fingerprint) into `health`."""
        from app.cluster.metrics import merge_health

        req = {"method": "GET", "path": "/health", "query_string": b"", "headers": [], "body": b"",
               "client": LOCAL_CLIENT}  # the details: a local client
        try:
            answers = await self.replicas.broadcast("call", req).results_async(
                timeout_s=self.cfg.cluster.replica_timeout_s, return_exceptions=True)
        except Exception as e:  # timed out, or no replica runs yet
            answers = [e]
        await self.observe(merge_health(answers))

    async def observe(self, health: dict[str, Any]) -> None:
        """Take a fresh merged /health (the ingress's own GET /health passes its answer here too); once a
        replica is ready, ask one for the model's fingerprint (saved voices are written with it)."""
        self.health, self._fetched_at = health, time.monotonic()
        if health["ready"] and not self._fingerprinted:
            with contextlib.suppress(Exception):  # asked again at the next reading
                self.voices.model_fingerprint = await self.replicas.model_fingerprint.remote()
                self._fingerprinted = True

    def _state(self) -> dict[str, Any]:
        """The last merged /health; one older than HEALTH_TTL_S starts a refresh (read from any thread)."""
        stale = time.monotonic() - self._fetched_at > HEALTH_TTL_S
        if stale and (self._refreshing is None or self._refreshing.done()):
            self._refreshing = asyncio.run_coroutine_threadsafe(self.refresh(), self._loop)
        return self.health

    @property
    def ready(self) -> bool:  # a replica is ready, and saved voices can be written for its model
        return bool(self._state()["ready"]) and self._fingerprinted

    @property
    def error(self) -> str:
        return ""  # a replica that fails to start is retried by Serve: the cluster is "loading" meanwhile

    @property
    def random_model(self) -> bool:
        return any(r.get("random_model") for r in self._state()["replicas"])

    @property
    def status(self) -> str:
        """"ready on 2 of 2 replicas (ab12cd34 on 10.0.0.1, ...)", or what the replicas say while they start."""
        h = self._state()
        ready = [r for r in h["replicas"] if r.get("ready")]
        if not ready:
            states = sorted({str(r.get("status")) for r in h["replicas"]}) or [h["status"]]
            return "; ".join(states)
        names = ", ".join(f"{r['id'][:8]} on {r['node']}" for r in ready)
        return f"ready on {len(ready)} of {len(h['replicas'])} replicas ({names})"

    def engine_fault(self) -> str | None:  # each replica restarts its own engine; `status` names the ready ones
        return None

    def require_ready(self) -> None:
        if not self.ready:
            raise NotReadyError(f"the cluster is still starting ({self.status}); try again in a moment")

    def model_name(self) -> str:
        ready = [r for r in self._state()["replicas"] if r.get("ready")]
        return str(ready[0].get("model", "")) if ready else ""

    def public_health(self, ready: bool | None = None) -> dict[str, Any]:
        """`StudioService.public_health` of the cluster (`ready`: from a fresh /health, else the last seen)."""
        return public_facts(self.cfg, ready=self.ready if ready is None else ready,
                            backend=self.facts().get("backend"), model=self.model_name(),
                            random_model=self.random_model)

    def facts(self) -> dict[str, Any]:
        """A ready replica's facts (backend, device, model), the replicas, and the cluster's totals."""
        h = self._state()
        ready = [r for r in h["replicas"] if r.get("ready")]
        facts = dict(ready[0].get("facts") or {}) if ready else {}
        facts["replicas"] = {r.get("id", f"#{i}"): f"{r['state']} (node {r.get('node')}, pid {r.get('pid')})"
                             for i, r in enumerate(h["replicas"])}
        facts["cluster"] = {k: h[k] for k in ("active_streams", "requests") if k in h}
        return facts

    # --- work on a replica ------------------------------------------------------------------------

    def _unwrapped(self, e: BaseException) -> BaseException:
        """What the replica raised (Ray wraps it, with the replica's traceback in its text)."""
        cause = getattr(e, "cause", None) if isinstance(e, self._task_error) else None
        return cause if isinstance(cause, BaseException) else e

    async def _on_a_replica(self, start: Any) -> Any:
        """`await start()` (a call on a replica, by Serve's router); once more, on another replica, while the one
        it reached is gone before answering (`[cluster] request_retries`); a replica's own error as it raised it."""
        last: BaseException | None = None
        for _ in range(1 + self.cfg.cluster.request_retries):
            try:
                return await start()
            except self._gone as e:
                last = e
            except self._task_error as e:
                raise self._unwrapped(e) from None
        raise ReplicaGoneError(f"no replica could take the request ({type(last).__name__}); try again in a minute")

    async def call(self, method: str, *args: Any) -> Any:
        """`StudioReplica.<method>(*args)` on one replica (another if it is gone before answering)."""
        return await self._on_a_replica(lambda: getattr(self.replicas, method).remote(*args))

    async def voice_from_audio(self, src: str | Path | bytes, prompt_text: str) -> Any:
        """Features of a reference clip, computed (and cached by content) on a replica."""
        return await self.call("voice_from_audio", await _bytes(src), prompt_text)

    async def _open(self, req: SynthesisRequest, queue_wait_s: float, prepared: Any) -> tuple[Any, Any]:
        """(the replica's stream, its first item); a replica gone before its first item is replaced."""
        async def start() -> tuple[Any, Any]:
            stream = self.replicas.options(stream=True).speak.remote(req, queue_wait_s, prepared)
            try:
                return stream, await stream.__anext__()
            except BaseException:
                stream.cancel()
                raise

        return await self._on_a_replica(start)

    @contextlib.asynccontextmanager
    async def speak(self, req: SynthesisRequest, *, prepared: Any = None, caller: Caller = NOBODY,
                    queue_wait_s: float = 0.0, stop: asyncio.Event | None = None
                    ) -> AsyncIterator[tuple[float, AsyncIterator[AudioChunk]]]:
        """`StudioService.speak` for the page: the client's fair share here, admission on the replica (its wait
        is in the record, not in the yielded queue wait)."""
        with self.share.hold(caller.client):
            async with contextlib.aclosing(self.stream(req, queue_wait_s=queue_wait_s, prepared=prepared,
                                                       stop=stop)) as chunks:
                yield queue_wait_s, chunks

    async def stream(self, req: SynthesisRequest, *, queue_wait_s: float = 0.0, prepared: Any = None,
                     stop: asyncio.Event | None = None) -> AsyncIterator[AudioChunk]:
        """`StudioService.stream` on a replica: the same chunks; the record kept in `metrics` by the end.
        Closing it early cancels the replica's call (its `finally` aborts the LM request)."""
        self.require_ready()
        self.metrics.request_started()
        rec, outcome, stream = None, "error", None
        try:
            stream, item = await self._open(req, queue_wait_s, prepared)
            while True:
                if isinstance(item, RequestRecord):
                    rec = item
                    break
                if item.is_final:  # its record comes next: taken before the caller may stop reading
                    rec = await anext(stream, None)
                yield item
                item = await stream.__anext__()
            outcome = "ok"
        except StopAsyncIteration:
            outcome = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        except self._gone as e:
            raise ReplicaGoneError("the replica serving this request stopped; try again") from e
        except self._task_error as e:
            raise self._unwrapped(e) from None
        finally:
            if stream is not None:
                stream.cancel()  # a no-op after the end
            if isinstance(rec, RequestRecord):
                self.metrics.add(rec)  # numbered here: each replica counts on its own
            else:  # ended without the replica's record: counted with what is known here
                self.metrics.request_finished(None, queue_wait_s, outcome, request=req,
                                              stopped=outcome == "cancelled" and stop is not None and stop.is_set(),
                                              owner=getattr(prepared, "owner", ""))
