"""The speech LM on vLLM: one shared engine per process, fed prompt embeddings, streaming tokens.
Design notes: docs/design.md."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from app.config import Config, SamplingConfig, VLLMConfig
from app.engine.lm_backend import BackendHealth, LMRequest
from app.engine.vllm_start import (
    EngineDiedError,
    EngineStartError,
    check_lm_folder,
    check_source,
    cpu_env,
    death_reason,
    engine_kwargs,
    explain_start_failure,
    stop_engine,
    token_prompt,
    unset_env,
)
from app.model.llm import EOS_TOKEN, N_SPEECH_ROWS, SOS_ID, SPEECH_TOKEN_SIZE, STOP_TOKENS, TASK_ID_ID
from app.model.vllm_export import export_lm_for_vllm
from app.vllm_lm import model as vllm_model
from app.vllm_lm.quiet import quiet_env

log = logging.getLogger(__name__)
_running: object | None = None  # the one engine of this process (a backend, or "starting")


def new_engine(kwargs: dict[str, Any]) -> Any:
    """AsyncLLM with these arguments; blocks for the start (15-60 s): call it in a worker thread."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))


class VLLMBackend:
    """`SpeechTokenSource` on one shared vLLM engine (continuous batching of every request)."""

    name = "vllm"

    def __init__(self, engine: Any, cfg: VLLMConfig, model_path: Path, kwargs: dict[str, Any], *,
                 started_at: float, env: dict[str, str]) -> None:
        self.engine, self.cfg, self.model_path = engine, cfg, model_path
        self._kwargs, self._env = kwargs, env
        self.start_s = time.perf_counter() - started_at  # engine start (after the export)
        self._ids = itertools.count()
        self._closed = False
        self._facts = self._read_facts()  # the engine's resolved config is fixed once it runs
        self._loop = asyncio.get_running_loop()  # the serving loop (made there, by start)
        self._watched: Any = None  # the engine whose output-handler task we watch
        self._recovery: asyncio.Task | None = None  # restarting after a death (kept when out of restarts)
        self._death = self._restart_error = ""  # why the engine died / its last restart failed ("" = fine)
        self.n_deaths = self.n_restarts = 0

    @classmethod
    async def start(cls, cfg: Config | VLLMConfig, model_dir: str | Path) -> VLLMBackend:
        """Export (cached) and start the engine (~20 s on CPU). Raises `EngineStartError` (with the setting to
        change) when it cannot start, or one already runs here."""
        global _running
        if _running is not None:
            raise EngineStartError("a vLLM engine already runs in this process; share that VLLMBackend "
                                   "(one engine per process owns the step loop)")
        _running = "starting"
        try:
            _running = backend = await cls._start(cfg.vllm if isinstance(cfg, Config) else cfg, Path(model_dir))
        except BaseException:
            _running = None
            raise
        return backend

    @classmethod
    async def _start(cls, cfg: VLLMConfig, model_dir: Path) -> VLLMBackend:
        if cfg.quantized_dir:
            model_path = Path(cfg.quantized_dir).expanduser().resolve()
            if not (model_path / "config.json").is_file():
                raise EngineStartError(f"vllm.quantized_dir {model_path} has no config.json; "
                                       "make it with `python -m app.tools.quantize EXPORT_DIR OUT_DIR`")
            await asyncio.to_thread(check_source, model_path, model_dir)
        else:
            model_path = await asyncio.to_thread(export_lm_for_vllm, model_dir,
                                                 Path(cfg.export_cache_dir).expanduser(), dtype=cfg.dtype)
        export = check_lm_folder(model_path)
        try:
            from vllm.platforms import current_platform
        except ImportError as e:
            raise EngineStartError(f"vLLM is not importable ({e}); install requirements.txt (GPU) or "
                                   "requirements-cpu.txt, or set [engine] backend = \"torch\"") from e
        quiet = quiet_env(Path(cfg.export_cache_dir).expanduser())  # start-up notes a user cannot act on
        env = {k: v for k, v in (cpu_env(cfg) | quiet).items() if k not in os.environ}  # a user's own setting wins
        vllm_model.register()  # the engine's view of the export: the id space's table, a speech-sized head
        kwargs = engine_kwargs(cfg, model_path, gpu=not current_platform.is_cpu()) | {
            "hf_overrides": vllm_model.hf_overrides(export)}
        os.environ.update(env)  # before vLLM starts: its engine processes inherit them
        t0 = time.perf_counter()
        try:
            # no local name for the engine: exceptions vLLM keeps from its imports hold this frame,
            # and a local here would keep the AsyncLLM alive after aclose()
            # the start (15-60 s) runs in a worker thread so the serving loop keeps answering meanwhile
            return cls(await asyncio.to_thread(new_engine, kwargs), cfg,
                       model_path, kwargs, started_at=t0, env=env)
        except Exception as e:  # pydantic ValidationError, ValueError, RuntimeError from the engine core, ...
            unset_env(env)
            raise EngineStartError(explain_start_failure(e, cfg, export.get("max_position_embeddings"))) from e

    # --- requests ------------------------------------------------------------------------------

    def sampling_params(self, req: LMRequest, prompt_len: int) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = req.sampling
        max_tokens = min(req.max_tokens, self.cfg.max_model_len - prompt_len)
        common = dict(seed=req.seed, max_tokens=max_tokens, stop_token_ids=sorted(STOP_TOKENS), detokenize=False,
                      temperature=1.0, output_kind=RequestOutputKind.DELTA)
        if req.ignore_eos:  # fixed length: stop ids masked before RAS sees the logits (as the torch backend)
            common["allowed_token_ids"] = list(range(SPEECH_TOKEN_SIZE))
        if self.cfg.ras:  # the logits processor turns logits into the RAS distribution; plain draw after it
            # unset fields (a caller that did not resolve the config) take RASParams' defaults, the official yaml's
            ras = {k: getattr(s, k) for k in ("top_p", "top_k", "win_size", "tau_r") if getattr(s, k) is not None}
            ras.update(min_tokens=req.min_tokens, eos=EOS_TOKEN, n_valid=N_SPEECH_ROWS)
            if req.history:  # only the window's tail travels to the engine
                ras["history"] = list(req.history[-s.win_size:] if s.win_size else req.history)
            return SamplingParams(**common, extra_args={"cosyvoice_ras": ras})
        # fallback without RAS: vLLM's nucleus; min_tokens bans all three stop ids, not only eos
        return SamplingParams(**common, top_p=s.top_p, top_k=s.top_k, min_tokens=min(req.min_tokens, max_tokens))

    async def stream(self, req: LMRequest) -> AsyncIterator[list[int]]:
        """New speech-token ids (< 6561) per engine step, until a stop id or max_tokens; leaving early
        (aclose, cancellation, an exception in the consumer) aborts the request."""
        if self._closed:
            raise RuntimeError("the vLLM backend is closed")
        engine = self.engine  # this request's engine, also after a restart swapped self.engine
        if engine is None or engine.errored:
            raise EngineDiedError(self.fault() or "the vLLM engine is not running")
        prompt_len = len(req.prompt_ids)
        if prompt_len >= self.cfg.max_model_len:
            raise ValueError(f"the LM prompt has {prompt_len} positions, vllm.max_model_len is "
                             f"{self.cfg.max_model_len}: use a shorter reference clip or raise vllm.max_model_len")
        params = self.sampling_params(req, prompt_len)
        rid = f"{req.request_id}#{next(self._ids)}"  # unique: an abort by id hits only this stream
        gen = engine.generate(token_prompt(engine, list(req.prompt_ids)), params, request_id=rid)
        finished = False
        try:
            async for out in gen:
                if self._watched is not engine:  # the output handler exists once a request was added
                    self._watch(engine)
                # ids >= 6561 are stop ids (end the request) or padding rows (never sampled)
                ids = [t for t in out.outputs[0].token_ids if t < SPEECH_TOKEN_SIZE]
                if ids:
                    yield ids
                if out.finished:
                    finished = True
                    reason = out.outputs[0].finish_reason
                    if reason not in (None, "stop", "length", "abort"):
                        raise RuntimeError(f"vLLM ended request {rid}: {reason}")
                    return
        except Exception as e:
            if engine.errored:  # vLLM's EngineDeadError, or a socket error while it went down
                self._on_engine_stopped(engine)  # also when it died before its handler was watched
                raise EngineDiedError(self.fault() or "the vLLM engine died") from e
            raise
        finally:
            await gen.aclose()  # vLLM's generate() aborts its request on GeneratorExit/cancel
            if not finished and not engine.errored:
                await engine.abort(rid)  # no-op when generate() already did it

    def n_unfinished(self) -> int:
        """Requests the engine front end still tracks (0 once every stream ended or was aborted)."""
        engine = self.engine
        if self._closed or engine is None or engine.errored:  # a dead engine tracks nothing that will run
            return 0
        # the output processor's count: what 0.32's AsyncLLM.get_num_unfinished_requests returns (0.26 has none)
        return int(engine.output_processor.get_num_unfinished_requests())

    # --- engine death and restart -----------------------------------------------------------------

    def fault(self) -> str | None:
        """Why the engine cannot serve now ("engine died: ..."), or None while it runs. Any thread."""
        engine, n, most = self.engine, self.n_restarts, self.cfg.max_restarts
        if self._closed:
            return None
        if self._death and self._recovery is not None and not self._recovery.done():
            return f"engine died: {self._death}; restarting it (restart {n} of {most})"
        if self._death:
            return (f"engine died: {self._death}; {self._restart_error or 'no restarts left'} "
                    f"([vllm] max_restarts = {most}); restart the server")
        if engine is not None and engine.errored:  # died, not yet handled on the loop: hand it over
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._on_engine_stopped, engine)
            return f"engine died: {death_reason(engine)}"
        return None

    def _watch(self, engine: Any) -> None:
        """`_on_engine_stopped` once the engine's output-handler task ends (only on death or shutdown)."""
        task, self._watched = getattr(engine, "output_handler", None), engine
        if isinstance(task, asyncio.Future):
            task.add_done_callback(lambda _t: self._on_engine_stopped(engine))
        else:  # another vLLM layout: /health and requests still notice (fault() reads `errored`)
            log.warning("cannot watch the vLLM engine's output handler; engine death is noticed on use")

    def _on_engine_stopped(self, engine: Any) -> None:
        """On the loop: a watched engine stopped. A death (not our own shutdown) starts the recovery."""
        if self._closed or engine is not self.engine or self._death or not engine.errored:
            return
        self._death, self.n_deaths = death_reason(engine), self.n_deaths + 1
        log.error("vLLM engine died: %s", self._death)
        self._recovery = asyncio.get_running_loop().create_task(self._recover(), name="vllm-engine-recovery")

    async def _recover(self) -> None:
        """Restart the engine (backing off after a failed start) until it serves or no restarts are left."""
        while self.n_restarts < self.cfg.max_restarts and not self._closed:
            self.n_restarts += 1
            t0 = time.perf_counter()
            try:
                await self._restart()
            except Exception as e:  # the next attempt may find the memory freed
                self._restart_error = f"restart {self.n_restarts} failed: {str(e).splitlines()[0] if str(e) else e!r}"
                log.exception("vLLM engine restart %d failed", self.n_restarts)
                await asyncio.sleep(min(30.0, 2.0 ** self.n_restarts))
                continue
            log.warning("vLLM engine restarted in %.1f s (restart %d of %d)", time.perf_counter() - t0,
                        self.n_restarts, self.cfg.max_restarts)
            self._death, self._restart_error, self._recovery = "", "", None
            return

    async def _restart(self) -> None:
        """A new engine with the same arguments in place of the dead one, probed with one token."""
        old, self.engine = self.engine, None
        with contextlib.suppress(Exception):  # vLLM's monitor already shut half of it down
            old.shutdown()
        del old
        gc.collect()
        os.environ.update(self._env)  # set since start (unless someone removed them): the same engine again
        t0 = time.perf_counter()
        self.engine = await asyncio.to_thread(new_engine, self._kwargs)
        self.start_s, self._facts = time.perf_counter() - t0, self._read_facts()
        probe = LMRequest(request_id="restart-probe", prompt_ids=(SOS_ID, TASK_ID_ID), min_tokens=0,
                          max_tokens=1, seed=0, sampling=SamplingConfig())
        async for _ in self.stream(probe):  # also starts its output handler, which `_watch` needs
            pass

    def _read_facts(self) -> dict[str, Any]:
        import vllm

        mc = self.engine.vllm_config.model_config
        return {
            "backend": self.name, "vllm": vllm.__version__,
            "model_path": str(self.model_path),
            "dtype": str(mc.dtype).removeprefix("torch."), "quantization": mc.quantization or "none",
            "sampler": "RAS (app.vllm_lm.ras)" if self.cfg.ras else "vLLM top-k/top-p (no RAS)",
            "max_model_len": mc.max_model_len, "block_size": self.engine.vllm_config.cache_config.block_size,
            "engine_args": {k: v for k, v in self._kwargs.items() if k != "model"},
            "cpu_env": {k: os.environ[k] for k in cpu_env(self.cfg) if k in os.environ},
            "start_s": round(self.start_s, 2),
        }

    def health(self) -> BackendHealth:
        return BackendHealth(unfinished=self.n_unfinished(), fault=self.fault(), deaths=self.n_deaths,
                             restarts=self.n_restarts)

    def facts(self) -> dict[str, Any]:
        """What runs, for panels and logs: backend, dtype, quantization, engine arguments, start time."""
        return {**self._facts, "running": not self._closed and self.fault() is None,
                "engine_deaths": self.n_deaths, "engine_restarts": self.n_restarts}

    async def aclose(self) -> None:
        """Shut the engine down (its processes or driver thread end); a new one may be started afterwards."""
        global _running
        if self._closed:
            return
        self._closed = True
        if self._recovery is not None and not self._recovery.done():
            self._recovery.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._recovery
        engine, self.engine = self.engine, None
        try:
            if engine is not None:
                stop_engine(engine)
        finally:
            del engine
            gc.collect()  # free the AsyncLLM now; its __del__ fails at interpreter exit
            unset_env(self._env)  # a later engine in this process reads its own config again
            if _running is self:
                _running = None
