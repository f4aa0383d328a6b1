"""The studio's process singleton: model, LM backend, synthesizer, saved voices and metrics.

`StudioService(cfg)` does nothing until `await start()`, which runs once on the server's event
loop (the FastAPI lifespan): it resolves the model folder (`--model-dir` / COSYVOICE_MODEL_DIR
via `[model] dir`, else a huggingface_hub download of `[model] repo_id`, else a generated tiny
random model when offline), loads it in a worker thread, starts the LM backend on the loop (vLLM's
AsyncLLM must live there), and warms up with one short request. `status` says where it is;
requests before `ready` get `NotReadyError`. `stream(req)` wraps `Synthesizer.stream` and records
every request in `metrics`.

Faults stop at this boundary, and the service keeps serving: a dead LM engine (the vLLM backend
restarts it) makes `stream` fail at once with `EngineDeadError` and `/health` say "engine died: ...";
an out-of-memory error in a request (token2wav or the LM) frees the CUDA cache, is counted, and is
refused with advice (`GpuOutOfMemoryError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import torch

from app.config import Config
from app.engine.backends import make_backend
from app.engine.metrics import Metrics
from app.engine.pipeline import Synthesizer
from app.engine.requests import AudioChunk, SynthesisRequest
from app.engine.voices import VoiceStore
from app.model.frontend import VoiceFeatures
from app.model.hparams import ModelFolderError
from app.model.loader import REQUIRED_FILES, CosyVoice2Model, check_model_dir, load_model

log = logging.getLogger(__name__)

ASSETS_DIR = Path(__file__).resolve().parents[2] / "assets"
# only what the loader reads (no BlankEN safetensors, JIT/TensorRT/ONNX-estimator extras): ~3 GB
DOWNLOAD_PATTERNS = [f for f in REQUIRED_FILES if "/" not in f] + ["CosyVoice-BlankEN/*.json",
                                                                    "CosyVoice-BlankEN/*.txt"]
VOICE_CACHE_SIZE = 32  # reference clips whose features stay in memory (keyed by content + transcript)
WARMUP_TEXT = "Hello."
OOM_ADVICE = "the GPU is out of memory: try a shorter text or fewer users"


class NotReadyError(RuntimeError):
    """A request arrived before the model and engine were ready (or after they failed)."""


class BusyError(RuntimeError):
    """Every HTTP slot is running and the waiting line is full: try again later."""


class EngineDeadError(NotReadyError):
    """The LM engine died; it is being restarted (or is out of restarts). Not this request's fault."""


class GpuOutOfMemoryError(ValueError):
    """This request ran out of GPU memory and was refused (a ValueError like other refusals: the page says
    "Synthesis failed: ..."); the memory it held is freed and the server keeps serving."""


def _engine_message(fault: str) -> str:
    """What a request hears while the engine is down: the fault, and whether waiting helps."""
    return f"the speech {fault}" + ("; try again in a minute" if "restarting" in fault else "")


def is_out_of_memory(e: BaseException) -> bool:
    """`torch.OutOfMemoryError`, or an error whose text (or whose cause's, e.g. vLLM's) says out of memory."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False


def _progress_class(report: Callable[[int, int], None]) -> type:
    """A huggingface_hub tqdm that also reports the snapshot's byte progress to `report(done, total)`."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    class Progress(hf_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._bytes_bar = kwargs.get("name") == "huggingface_hub.snapshot_download"  # the reconstruct bar
            self._done = int(kwargs.get("initial") or 0)
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            self._done += int(n or 0)
            if self._bytes_bar and self.total:
                report(self._done, int(self.total))
            return super().update(n)

    return Progress


def download_model(repo_id: str, report: Callable[[int, int], None]) -> Path:
    """The files the loader needs from `repo_id` (a cached snapshot first, then the Hub)."""
    from huggingface_hub import snapshot_download

    with contextlib.suppress(OSError, ValueError):  # not (fully) cached: download below
        path = Path(snapshot_download(repo_id, allow_patterns=DOWNLOAD_PATTERNS, local_files_only=True))
        check_model_dir(path)
        return path
    return Path(snapshot_download(repo_id, allow_patterns=DOWNLOAD_PATTERNS, tqdm_class=_progress_class(report)))


def random_model(folder: Path) -> Path:
    """A tiny random model in `folder`, generated once (atomically: built beside it, then renamed)."""
    with contextlib.suppress(ModelFolderError):
        check_model_dir(folder)
        return folder
    from app.tools.make_model import make_model
    from app.tools.model_sizes import TINY

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        make_model(tmp / "m", TINY, seed=0)
        shutil.rmtree(folder, ignore_errors=True)  # a broken leftover
        (tmp / "m").rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def model_fingerprint(model_dir: Path) -> str:
    """Identity of the voice-feature extractors (speech tokenizer, CAM++, text tokenizer) of a folder.

    Size plus the first MiB of each file: cheap, and different for every model we know of.
    """
    h = hashlib.sha256()
    for name in ("speech_tokenizer_v2.onnx", "campplus.onnx", "CosyVoice-BlankEN/vocab.json",
                 "CosyVoice-BlankEN/tokenizer.json"):
        f = model_dir / name
        if f.is_file():
            with f.open("rb") as fh:
                h.update(f"{name}:{f.stat().st_size}:".encode() + fh.read(1 << 20))
    return h.hexdigest()[:16]


class StudioService:
    """One per process: owns the model, the LM backend, the `Synthesizer`, `VoiceStore` and `Metrics`."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.status = "waiting to start"
        self.ready = False
        self.error = ""
        self.random_model = False  # True: running on generated weights (output is noise)
        self.model_dir: Path | None = None
        self.model: CosyVoice2Model | None = None
        self.backend: Any = None  # SpeechTokenSource, once started
        self.synth: Synthesizer | None = None
        self.voices = VoiceStore(cfg.server.voices_dir)
        self.metrics = Metrics()
        self.started_at = time.time()
        self.start_s: float | None = None
        self._voice_cache: OrderedDict[str, VoiceFeatures] = OrderedDict()
        self._slots: asyncio.Semaphore | None = None  # HTTP API admission (created on the serving loop)
        self.http_waiting = 0  # HTTP requests waiting for a slot
        self.n_out_of_memory = 0  # requests refused because they ran out of (GPU) memory

    # --- start / stop ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Resolve, load, start the backend, warm up. Never raises: failures end in `status`/`error`."""
        t0 = time.perf_counter()
        try:
            self.model_dir = await asyncio.to_thread(self._resolve_model_dir)
            self.status = "loading model"
            m = self.cfg.model
            self.model = await asyncio.to_thread(
                load_model, self.model_dir, device=m.device, llm_dtype=m.llm_dtype, flow_dtype=m.flow_dtype,
                hift_dtype=m.hift_dtype, text_frontend=m.text_frontend, nsf_noise=self.cfg.streaming.nsf_noise)
            self.voices.model_fingerprint = await asyncio.to_thread(model_fingerprint, self.model_dir)
            self.status = "starting engine"
            self.backend = await make_backend(self.cfg, self.model)
            self.synth = Synthesizer(self.model, self.backend, self.cfg)
            self.status = "warming up"
            await self._warm_up()
        except Exception as e:  # shown on the page and in /health; the process keeps serving the page
            log.exception("start failed")
            self.error = str(e) or type(e).__name__
            self.status = f"error: {self.error}"
            return
        self.start_s = time.perf_counter() - t0
        self.ready = True
        self.status = "ready"
        log.info("ready in %.1f s (model %s, backend %s)", self.start_s, self.model_dir, self.backend.name)

    def _resolve_model_dir(self) -> Path:
        m = self.cfg.model
        if m.dir:  # given explicitly: use it or fail, never fall back silently
            path = Path(m.dir).expanduser().resolve()
            check_model_dir(path)
            return path
        if m.download:
            self.status = f"looking for {m.repo_id} (cache, then the Hugging Face Hub)"
            try:
                return download_model(m.repo_id, self._report_download)
            except Exception as e:  # offline, DNS, HTTP errors, HF_HUB_OFFLINE=1: all mean "use the fallback"
                log.warning("cannot download %s (%s): falling back to a generated tiny random model",
                            m.repo_id, str(e).splitlines()[0] if str(e) else type(e).__name__)
        self.status = "generating a tiny random model (no weights available; output will be noise)"
        self.random_model = True
        return random_model(Path(m.random_model_dir).expanduser().resolve())

    def _report_download(self, done: int, total: int) -> None:
        self.status = f"downloading {self.cfg.model.repo_id}: {done / 1e9:.2f} / {total / 1e9:.2f} GB"

    async def _warm_up(self) -> None:
        """One short request through every stage (first-call costs are paid before users arrive)."""
        example = json.loads((ASSETS_DIR / "examples.json").read_text(encoding="utf-8"))["voices"][0]
        voice = await self.voice_from_audio(ASSETS_DIR / example["audio"], example["transcript"])
        req = SynthesisRequest(text=WARMUP_TEXT, voice=voice, seed=0, stream=True)
        async with contextlib.aclosing(self.synth.stream(req)) as chunks:
            async for _ in chunks:
                pass

    async def aclose(self) -> None:
        self.ready = False
        self.status = "stopped"
        if self.synth is not None:
            await self.synth.aclose()
        elif self.backend is not None:
            await self.backend.aclose()

    # --- requests --------------------------------------------------------------------------------

    def require_ready(self) -> Synthesizer:
        if not self.ready or self.synth is None:
            if self.error:
                raise NotReadyError(f"the model failed to start: {self.error}")
            raise NotReadyError(f"the model is still loading ({self.status}); try again in a moment")
        return self.synth

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[float]:
        """One of `server.concurrency_limit` HTTP-API slots (the page has Gradio's own queue).

        Waits in line behind the running requests; with `server.queue_max_size` already waiting it
        raises `BusyError` at once instead. Yields the seconds it waited.
        """
        srv = self.cfg.server
        if self._slots is None:
            self._slots = asyncio.Semaphore(srv.concurrency_limit)
        if self._slots.locked() and self.http_waiting >= srv.queue_max_size:
            self.metrics.request_finished(None, 0.0, "rejected")
            raise BusyError(f"the server is busy ({srv.concurrency_limit} requests running, {self.http_waiting} "
                            "waiting); try again in a few seconds")
        t0 = time.monotonic()
        self.http_waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.http_waiting -= 1
        try:
            yield time.monotonic() - t0
        finally:
            self._slots.release()

    async def voice_from_audio(self, src: str | Path | bytes, prompt_text: str) -> VoiceFeatures:
        """Features of a reference clip (file path or its bytes), cached by content and transcript.

        The blocking work (decode, speech tokenizer, CAM++, prompt mel) runs in a worker thread.
        """
        if self.model is None:
            raise NotReadyError(f"the model is still loading ({self.status}); try again in a moment")
        data = src if isinstance(src, bytes) else await asyncio.to_thread(Path(src).read_bytes)
        key = hashlib.sha256(data + b"\0" + prompt_text.encode("utf-8")).hexdigest()
        voice = self._voice_cache.get(key)
        if voice is None:  # the path (not the bytes) keeps the file's suffix for format errors
            voice = await asyncio.to_thread(self.model.frontend.voice_from_audio, src, prompt_text)
            self._voice_cache[key] = voice
            while len(self._voice_cache) > VOICE_CACHE_SIZE:
                self._voice_cache.popitem(last=False)
        self._voice_cache.move_to_end(key)
        return voice

    def engine_fault(self) -> str | None:
        """Why the LM engine cannot serve now ("engine died: ..."), None when it can (or is not started)."""
        fault = getattr(self.backend, "fault", None)
        return fault() if fault is not None else None

    async def stream(self, req: SynthesisRequest, *, queue_wait_s: float = 0.0) -> AsyncIterator[AudioChunk]:
        """`Synthesizer.stream(req)`, counted in `metrics` (closing early aborts the LM request).

        Raises `EngineDeadError` at once while the engine is down, and `GpuOutOfMemoryError` (after
        freeing the CUDA cache) when the request runs out of memory.
        """
        synth = self.require_ready()
        if fault := self.engine_fault():
            raise EngineDeadError(_engine_message(fault))
        self.metrics.request_started()
        stats, outcome = None, "error"
        try:
            async with contextlib.aclosing(synth.stream(req)) as chunks:
                async for chunk in chunks:
                    stats = chunk.stats or stats
                    yield chunk
            outcome = "ok"
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
            self.metrics.request_finished(stats, queue_wait_s, outcome)

    # --- facts -----------------------------------------------------------------------------------

    def lm_unfinished(self) -> int | None:
        """LM requests the backend still tracks (vLLM: the engine's unfinished requests)."""
        b = self.backend
        if b is None:
            return None
        if hasattr(b, "n_unfinished"):
            return int(b.n_unfinished())
        return int(getattr(b, "n_active", 0))

    def facts(self) -> dict[str, Any]:
        """What runs: model folder, device and dtypes, backend facts (engine args, quantization, ...)."""
        m = self.cfg.model
        facts: dict[str, Any] = {"model_dir": str(self.model_dir) if self.model_dir else None,
                                 "random_model": self.random_model, "device": m.device,
                                 "dtypes": {"llm (torch)": m.llm_dtype, "flow": m.flow_dtype, "hift": m.hift_dtype}}
        if self.model is not None:
            facts["device"] = str(self.model.device)
        if self.backend is not None:
            backend_facts = self.backend.facts() if hasattr(self.backend, "facts") else {"backend": self.backend.name}
            facts.update(backend_facts)
        if self.synth is not None:
            e = self.cfg.engine
            graphs = self.synth.flow_graphs  # CUDA graphs of the flow estimator, when on
            facts["token2wav"] = {"workers": e.token2wav_workers, "flow_batch": e.flow_batch,
                                  "flow_cuda_graphs": None if graphs is None else vars(graphs.stats) | {
                                      "kept": graphs.n_graphs, "bucket_frames": graphs.bucket_frames}}
        if self.start_s is not None:
            facts["service_start_s"] = round(self.start_s, 1)
        return facts

    def health(self) -> dict[str, Any]:
        """Readiness with the reason, plus live counters (the JSON of GET /health)."""
        fault = self.engine_fault() if self.ready else None
        b = self.backend
        return {"ready": self.ready and fault is None, "status": fault or self.status, "error": self.error or None,
                "random_model": self.random_model, "active_streams": self.metrics.active_streams,
                "http_waiting": self.http_waiting,
                "lm_unfinished": self.lm_unfinished(), "requests": self.metrics.counters(),
                "faults": {"out_of_memory": self.n_out_of_memory, "engine_deaths": getattr(b, "n_deaths", 0),
                           "engine_restarts": getattr(b, "n_restarts", 0)},
                "facts": self.facts()}
