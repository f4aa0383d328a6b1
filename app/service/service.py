"""The studio's process singleton: model, LM backend, synthesizer, saved voices and metrics.
Design notes: docs/design.md."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from app.config import Config
from app.engine.lm_backend import SpeechTokenSource, make_backend
from app.engine.pipeline import Synthesizer
from app.engine.requests import AudioChunk, RequestStats, SynthesisRequest
from app.message import Message
from app.model.frontend import VoiceFeatures
from app.model.hparams import ModelFolderError
from app.model.loader import CosyVoice2Model, load_model
from app.model.source import model_fingerprint, resolve_model_dir
from app.service.admission import Admission
from app.service.asr import Transcriber
from app.service.fair_share import FairShare
from app.service.metrics import Metrics
from app.service.owners import NOBODY, Caller, OwnedVoices
from app.service.take_end import is_out_of_memory, until_stopped
from app.service.timings import Aligner
from app.service.voices import ClipCache

if TYPE_CHECKING:
    from app.service.prepare import Prepared

log = logging.getLogger(__name__)

ASSETS_DIR = Path(__file__).resolve().parents[2] / "assets"
VOICE_CACHE_SIZE = 32  # reference clips whose features stay in memory (keyed by content + transcript)
WARMUP_TEXT = "Hello."
OOM_ADVICE = "the GPU is out of memory: try a shorter text or fewer users"


class NotReadyError(RuntimeError):
    """A request arrived before the model and engine were ready (or after they failed)."""


class EngineDeadError(NotReadyError):
    """The LM engine died; it is being restarted (or is out of restarts). Not this request's fault."""


class GpuOutOfMemoryError(ValueError):
    """This request ran out of GPU memory and was refused (a ValueError like other refusals: the page says
    "Synthesis failed: ..."); the memory it held is freed and the server keeps serving."""


def _engine_message(fault: str) -> str:
    """What a request hears while the engine is down: the fault, and whether waiting helps."""
    return f"the speech {fault}" + ("; try again in a minute" if "restarting" in fault else "")


def public_facts(cfg: Config, **facts: Any) -> dict[str, Any]:
    """`facts` and what every visitor may know of the app: its version, whose saved voices are whose."""
    from app import __version__

    return {**facts, "version": __version__, "voices": cfg.voices.resolved(cfg.server)}


class Studio(Protocol):
    """What the page and the doors use of a service: `StudioService`, or `ClusterService` (app/cluster/page.py)
    on a cluster's ingress, whose `backend` is None (the replicas hold the LM)."""

    cfg: Config
    metrics: Metrics
    voices: OwnedVoices
    backend: SpeechTokenSource | None
    status: str

    def facts(self) -> dict[str, Any]: ...

    def public_health(self) -> dict[str, Any]: ...

    def require_ready(self) -> Any: ...

    def engine_fault(self) -> str | None: ...


class StudioService:
    """One per process: owns the model, the LM backend, the `Synthesizer`, `VoiceStore` and `Metrics`."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.status = Message("state_waiting", "waiting to start")
        self.ready = False
        self.error = ""
        self.random_model = False  # True: running on generated weights (output is noise)
        self.model_dir: Path | None = None
        self.model: CosyVoice2Model | None = None
        self.backend: Any = None  # SpeechTokenSource, once started
        self.synth: Synthesizer | None = None
        self.voices = OwnedVoices(cfg.server.voices_dir, cfg.voices.resolved(cfg.server),
                                  cfg.limits.max_transcript_chars)
        self.metrics = Metrics()
        self.started_at = time.time()
        self.start_s: float | None = None
        self.voice_cache: ClipCache[VoiceFeatures] = ClipCache(VOICE_CACHE_SIZE)
        self.admission = Admission(cfg.server, self.metrics)  # every door's, one for the process
        self.share = FairShare(cfg.server.streams_per_client, self.metrics)  # per client, at every door
        self.asr = Transcriber(cfg.asr)  # Whisper for blank transcripts, loaded on first use
        # word timings for the doors that ask (app/service/take_timings.py), on the Transcriber's Whisper (loaded on
        # the first aligned sentence, never at start)
        self.aligner = Aligner(cfg.asr, self.asr)
        self.n_out_of_memory = 0  # requests refused because they ran out of (GPU) memory

    # --- start / stop ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Resolve, load, start the backend, warm up. Never raises: failures end in `status`/`error`."""
        t0 = time.perf_counter()
        try:
            self.model_dir, self.random_model = await asyncio.to_thread(
                resolve_model_dir, self.cfg.model, lambda status: setattr(self, "status", status))
            m = self.cfg.model
            self.status = Message("state_loading", "loading model")
            self.model = await asyncio.to_thread(
                load_model, self.model_dir, device=m.device, llm_dtype=m.llm_dtype, flow_dtype=m.flow_dtype,
                hift_dtype=m.hift_dtype, text_frontend=m.text_frontend, nsf_noise=self.cfg.streaming.nsf_noise)
            self.voices.model_fingerprint = await asyncio.to_thread(model_fingerprint, self.model_dir)
            self.status = Message("state_starting", "starting engine")
            self.backend = await make_backend(self.cfg, self.model)
            self.synth = Synthesizer(self.model, self.backend, self.cfg)
            self.status = Message("state_warming", "warming up")
            await self._warm_up()
        except Exception as e:  # shown on the page and in /health; the process keeps serving the page
            # a traceback, but for a bad model folder of the user's (its message says what is wrong)
            log.error("start failed: %s", e, exc_info=not isinstance(e, ModelFolderError))
            self.error = str(e) or type(e).__name__
            self.status = Message("state_error", "error: {error}", error=self.error)
            return
        self.start_s = time.perf_counter() - t0
        self.ready = True
        self.status = Message("state_ready", "ready")
        log.info("ready in %.1f s (model %s, backend %s)", self.start_s, self.model_dir, self.backend.name)

    async def _warm_up(self) -> None:
        """HiFT graphs captured, then one short request through every stage (first-call costs are paid before
        users arrive)."""
        await asyncio.to_thread(self.synth.capture_graphs)
        example = json.loads((ASSETS_DIR / "examples.json").read_text(encoding="utf-8"))["voices"][0]
        voice = await self.voice_from_audio(ASSETS_DIR / example["audio"], example["transcript"])
        req = SynthesisRequest(text=WARMUP_TEXT, voice=voice, seed=0, stream=True)
        async with contextlib.aclosing(self.synth.stream(req)) as chunks:
            async for _ in chunks:
                pass

    async def aclose(self) -> None:
        self.ready = False
        self.status = Message("state_stopped", "stopped")
        if self.synth is not None:
            await self.synth.aclose()
        elif self.backend is not None:
            await self.backend.aclose()

    # --- requests --------------------------------------------------------------------------------

    def require_ready(self) -> Synthesizer:
        if not self.ready or self.synth is None:
            raise self._not_ready()
        return self.synth

    def _not_ready(self) -> NotReadyError:
        if self.error:
            return NotReadyError(Message("start_failed", "the model failed to start: {error}", error=self.error))
        return NotReadyError(Message("loading", "the model is still loading ({status}); try again in a moment",
                                     status=self.status))

    async def voice_from_audio(self, src: str | Path | bytes, prompt_text: str) -> VoiceFeatures:
        """Features of a reference clip (file path or its bytes), cached by content and transcript."""
        if self.model is None:
            raise self._not_ready()
        return await self.voice_cache.get(src, prompt_text, self.model.frontend.voice_from_audio)

    def engine_fault(self) -> str | None:
        """Why the LM engine cannot serve now ("engine died: ..."), None when it can (or is not started)."""
        return self.backend.health().fault if self.backend is not None else None

    @contextlib.asynccontextmanager
    async def speak(self, req: SynthesisRequest, *, prepared: Prepared | None = None, caller: Caller = NOBODY,
                    queue_wait_s: float = 0.0, stop: asyncio.Event | None = None,
                    tokens: AsyncIterator[list[int]] | None = None
                    ) -> AsyncIterator[tuple[float, AsyncIterator[AudioChunk]]]:
        """The one way every door speaks a prepared request: `caller.client`'s fair share (app/service/fair_share.py;
        "" = not counted, e.g. a replica whose ingress counted it), then the process's one admission (a slot,
        or a place in its queue: `BusyError` when full), then `stream`. Yields (queue wait s: `queue_wait_s`
        spent before this door plus the admission's, the chunks); leaving the block closes the stream
        (aborting the LM request if it is still running) and frees the slot and the share's place. `tokens`:
        see `Synthesizer.stream` (the WebSocket door's bi-streaming decode)."""
        async with contextlib.AsyncExitStack() as stack:
            stack.enter_context(self.share.hold(caller.client))  # before the queue: over its share, it waits nowhere
            queue_s = queue_wait_s + await stack.enter_async_context(self.admission.admit())
            chunks = await stack.enter_async_context(contextlib.aclosing(
                self.stream(req, queue_wait_s=queue_s, prepared=prepared, stop=stop, tokens=tokens)))
            yield queue_s, chunks

    async def stream(self, req: SynthesisRequest, *, queue_wait_s: float = 0.0, prepared: Prepared | None = None,
                     stop: asyncio.Event | None = None, tokens: AsyncIterator[list[int]] | None = None
                     ) -> AsyncIterator[AudioChunk]:
        """`Synthesizer.stream(req)`, counted in `metrics` (closing early aborts the LM request); its
        `RequestRecord` also keeps `prepared`'s voice name, notes and reference time. Raises `EngineDeadError`
        at once while the engine is down, `GpuOutOfMemoryError` when the request runs out of memory. A request
        ended early keeps its stats so far; `stop` (the page's Stop) ends it at once, its record `stopped`."""
        synth = self.require_ready()
        if fault := self.engine_fault():
            raise EngineDeadError(_engine_message(fault))
        self.metrics.request_started()
        stats, outcome, n_samples, final = None, "error", 0, False
        so_far: list[RequestStats] = []  # the synthesizer's stats at its end (the only ones of an early end)
        try:
            async with contextlib.aclosing(synth.stream(req, on_end=so_far.append, tokens=tokens)) as made, \
                    contextlib.aclosing(until_stopped(made, stop)) as chunks:  # (closed first)
                async for chunk in chunks:
                    stats, final = chunk.stats or stats, chunk.is_final
                    n_samples += chunk.samples.size
                    yield chunk
            outcome = "ok" if final else "cancelled"  # no final chunk: the page's Stop ended it
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "ok" if stats is not None else "cancelled"
            raise
        except Exception as e:
            if fault := self.engine_fault():
                raise EngineDeadError(_engine_message(fault)) from e
            if is_out_of_memory(e):
                self.n_out_of_memory += 1
                log.warning("request %s ran out of memory (%s); refused", req.request_id, type(e).__name__)
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    torch.cuda.empty_cache()  # what the failed request held goes back to the others
                raise GpuOutOfMemoryError(OOM_ADVICE) from e
            raise
        finally:
            about = {} if prepared is None else dict(voice=prepared.voice_name, notes=prepared.notes,
                                                     reference_s=prepared.reference_s, owner=prepared.owner)
            stopped = outcome == "cancelled" and stop is not None and stop.is_set()
            self.metrics.request_finished(stats or (so_far[-1] if so_far else None), queue_wait_s, outcome, request=req,
                                          n_samples=n_samples, stopped=stopped, **about)

    # --- facts -----------------------------------------------------------------------------------

    def facts(self) -> dict[str, Any]:
        """What runs: model folder, device and dtypes, backend facts (engine args, quantization, ...)."""
        m = self.cfg.model
        facts: dict[str, Any] = {"mode": self.cfg.mode, "model_dir": str(self.model_dir) if self.model_dir else None,
                                 "random_model": self.random_model,
                                 "device": m.device if self.model is None else str(self.model.device),
                                 "dtypes": {"llm (torch)": m.llm_dtype, "flow": m.flow_dtype, "hift": m.hift_dtype}}
        if self.backend is not None:
            facts.update(self.backend.facts())
        if self.synth is not None:
            facts["token2wav"] = self.synth.facts()
        if self.start_s is not None:
            facts["service_start_s"] = round(self.start_s, 1)
        return facts

    def model_name(self) -> str:
        """The model's name without its path: "Org/Name" of a Hugging Face snapshot, else the folder's name."""
        if self.model_dir is None:
            return self.cfg.model.repo_id if not self.cfg.model.dir else Path(self.cfg.model.dir).name
        parts = self.model_dir.parts
        if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
            return parts[-3].removeprefix("models--").replace("--", "/")
        return self.model_dir.name

    def public_health(self) -> dict[str, Any]:
        """What /health tells anybody: ready, backend, the model's name, the version, whether saved voices are
        each owner's or shared (no paths, no settings)."""
        backend = self.backend.name if self.backend is not None else self.cfg.engine.backend
        return public_facts(self.cfg, ready=self.ready and self.engine_fault() is None, backend=backend,
                            model=self.model_name(), random_model=self.random_model)

    def health(self) -> dict[str, Any]:
        """Readiness with the reason, plus live counters (the JSON of GET /health)."""
        h = self.backend.health() if self.backend is not None else None
        fault = h.fault if self.ready and h else None
        return {"ready": self.ready and fault is None, "status": fault or self.status, "error": self.error or None,
                "model": self.model_name(),
                "random_model": self.random_model, "active_streams": self.metrics.active_streams,
                "http_waiting": self.admission.waiting,
                "lm_unfinished": h.unfinished if h else None, "requests": self.metrics.counters(),
                "faults": {"out_of_memory": self.n_out_of_memory, "engine_deaths": h.deaths if h else 0,
                           "engine_restarts": h.restarts if h else 0},
                "facts": self.facts()}
