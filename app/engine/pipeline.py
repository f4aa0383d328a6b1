"""The synthesis pipeline: request -> text segments -> LM token stream -> audio chunks. Design notes: docs/design.md."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from app.config import Config
from app.engine.call_sizing import CallBudget
from app.engine.flow_budget import FlowBudget, pool_bytes
from app.engine.lm_backend import LMRequest, SpeechTokenSource
from app.engine.requests import AudioChunk, RequestStats, SynthesisRequest, Turn
from app.engine.t2w_scheduler import Token2WavScheduler
from app.engine.utterance import ChunkFinish, Segment, Utterance, vocode_chunks
from app.message import Message
from app.model.flow.graphs import EstimatorGraphs
from app.model.flow.incremental.paged import KVPool, PoolFull, block_bytes, blocks_needed
from app.model.flow.incremental.paged_graphs import PagedGraphs, make_pool
from app.model.flow.incremental.prompt_cache import PromptCache
from app.model.flow.incremental.state import FlowState, VoicePrefix
from app.model.flow.work import FlowWork
from app.model.flow_calls import IncrementalItem, flow_batch
from app.model.frontend import VoiceFeatures
from app.model.hift_graphs import HiftGraphs, row_buckets, schedule_frames
from app.model.llm import ENDOFPROMPT, build_lm_ids
from app.model.loader import CosyVoice2Model
from app.model.token2wav import ChunkPlan, Token2WavStream

log = logging.getLogger(__name__)


class EmptyTextError(ValueError):
    """Nothing speakable is left after normalisation."""


class Synthesizer:
    """Owns the shared model, the LM backend and the token->wave worker."""

    def __init__(self, model: CosyVoice2Model, lm: SpeechTokenSource, cfg: Config) -> None:
        self.model, self.lm, self.cfg = model, lm, cfg
        self.sampling = cfg.sampling.resolved(model.hparams.llm)  # RAS: the checkpoint's yaml unless overridden
        s, e, fd = cfg.streaming, cfg.engine, model.hparams.flow
        # every Token2WavStream: the schedule, the incremental switch, the yaml's chunk and look-ahead (tokens)
        self.streaming, self.incremental = s, False  # True once the state pool is sized
        self.chunk_tokens, self.pre_lookahead = fd.encoder.static_chunk_size, fd.pre_lookahead_len
        # incremental flow: per-voice prompt prefixes (shared, read only), the budget of all streams' states; its
        # pool sized from the memory left: on CUDA at warm-up (`capture_graphs`; streams re-solve until then)
        self.cuda = torch.device(model.device).type == "cuda"  # CUDA graphs only there (none to capture on a CPU)
        self.flow_pool: KVPool | None = None
        self.paged_graphs: PagedGraphs | None = None
        self.prompt_cache: PromptCache | None = None
        self.flow_budget = FlowBudget(0)
        self.state_sizing = ""  # how the pool was sized (facts)
        self.resolved_streams = 0  # segments that found no room for their state and re-solved (/metrics)
        if e.flow_incremental and not self.cuda:
            self._start_incremental()
        # CUDA graphs of the flow estimator's ODE solve; batched HiFT after each flow call (graphs of its step)
        self.flow_graphs = EstimatorGraphs(model.flow.decoder["estimator"], bucket_frames=e.flow_graph_bucket_frames,
                                           max_graphs=e.flow_max_graphs) if e.flow_cuda_graphs and self.cuda else None
        self.hift_graphs = HiftGraphs() if e.hift_graphs and self.cuda else None  # captured by `capture_graphs`
        self.flow_work = FlowWork.of(model.flow)  # estimator FLOPs and padding of every flow call (facts)
        # calls sized by deadlines on CUDA; a CPU call's seconds dwarf any allowance: one call for every due hop
        budget = CallBudget(e.first_call_ms / 1e3, e.max_call_ms / 1e3) if self.cuda else None
        self._t2w = Token2WavScheduler(e.token2wav_workers, model.device, max_batch=e.flow_batch,
                                       flow_fn=self._flow_batch, finish_batch=self._vocode_chunks, budget=budget)

    def _vocode_chunks(self, finishes: list[ChunkFinish], mels: list[torch.Tensor], flow_s: float):
        # the scheduler's finish_batch: HiFT batched per mel length through `self.hift_graphs` (tests swap it)
        return vocode_chunks(self.model.hift, finishes, mels, flow_s, self.hift_graphs)

    def _flow_batch(self, items: list) -> list:
        # the scheduler's flow_fn: one flow call for its jobs (the paged graphs read once the pool exists)
        return flow_batch(self.model.flow, items, graphs=self.flow_graphs, paged_graphs=self.paged_graphs,
                          work=self.flow_work)

    def capture_graphs(self) -> None:
        """Warm-up only (before the first request): capture the HiFT graphs of every (rows, frames) bucket for
        every token->wave worker, then (CUDA, engine.flow_incremental) size the flow state pool from the memory
        left and capture its paged graphs; the sets are then frozen, nothing is captured while serving (a
        capture broke other threads' CUDA work, docs/performance.md). A second call does nothing."""
        e = self.cfg.engine
        if self.hift_graphs is not None and not self.hift_graphs.frozen:
            frames = schedule_frames(self.streaming, chunk_tokens=self.chunk_tokens, pre_lookahead=self.pre_lookahead)
            self.hift_graphs.capture(self.model.hift, row_buckets(e.hift_graph_rows), frames, self._t2w.streams,
                                     max_graphs=e.hift_max_graphs)
        if e.flow_incremental and self.cuda and not self.incremental:
            self._start_incremental()

    def _start_incremental(self) -> None:
        """The state pool (and its graphs on CUDA), the prompt cache and the budget; streams then run the
        incremental path. Sized by `pool_bytes`: CUDA from the device memory free now, the CPU from a GiB key."""
        e, flow = self.cfg.engine, self.model.flow
        free = None
        if self.cuda:  # what the model, vLLM's engine and the HiFT graphs left (our cache's spare blocks too)
            torch.cuda.synchronize(self.model.device)
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info(self.model.device)[0]
        n = pool_bytes(fraction=e.flow_state_fraction, max_gib=e.flow_state_max_gib, cpu_gib=e.flow_state_gib,
                       block_bytes=block_bytes(flow), free_bytes=free)
        self.state_sizing = (f"{e.flow_state_fraction} of {free / 2**30:.1f} GiB free after warm-up"
                             + (f", at most {e.flow_state_max_gib} GiB" if e.flow_state_max_gib > 0 else "")
                             if free is not None else f"flow_state_gib {e.flow_state_gib}")
        # one block pool (a full pool refuses hops: the re-solve takes over)
        self.flow_pool, self.paged_graphs = make_pool(
            flow, n, graphs=e.flow_paged_graphs and self.cuda, max_rows=e.flow_paged_graph_rows,
            max_blocks=e.flow_paged_graph_blocks, encoder_graphs=e.flow_encoder_graphs)
        self.prompt_cache = PromptCache(max_bytes=int(e.prompt_cache_gib * 2**30), pool=self.flow_pool)
        self.flow_budget = FlowBudget(n)
        self.incremental = True
        log.info("flow state: paged pool, %.2f GiB (%s)", n / 2**30, self.state_sizing)

    def prompt(self, req: SynthesisRequest, voice: VoiceFeatures | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt text ids, prompt speech tokens), 1-D int32, of `req`'s mode in `voice` (default: the
        request's): the transcript and the voice's tokens (zero-shot), none (cross-lingual), or the
        instruction (instruct: it replaces the transcript and must end with <|endofprompt|>)."""
        empty = torch.zeros(0, dtype=torch.int32)
        voice = voice or req.voice
        if req.mode == "zero_shot":
            return voice.prompt_text_ids.reshape(-1), voice.speech_tokens[0].reshape(-1)
        if req.mode == "cross_lingual":
            return empty, empty
        instruct = req.instruct_text if ENDOFPROMPT in req.instruct_text else req.instruct_text + ENDOFPROMPT
        return self.model.frontend.text_ids(instruct), empty

    def lm_request(self, req: SynthesisRequest, segment: str, index: int,
                   voice: VoiceFeatures | None = None) -> LMRequest:
        """The LM request of segment `index` (its text `segment`), in `voice` (default: the request's)."""
        text_ids = self.model.frontend.text_ids(segment)
        lm_ids = tuple(build_lm_ids(text_ids, *self.prompt(req, voice)))
        s = self.sampling
        # benchmark mode (fixed_tokens): a set output length whatever the (random) weights sample
        min_tokens, max_tokens = (req.fixed_tokens,) * 2 if req.fixed_tokens else s.length_limits(len(text_ids))
        return LMRequest(
            request_id=req.request_id, prompt_ids=lm_ids, min_tokens=min_tokens,
            max_tokens=max_tokens, seed=req.seed + index, sampling=s, ignore_eos=bool(req.fixed_tokens))

    async def _run_t2w(self, u: Utterance, plan: ChunkPlan) -> np.ndarray:
        seg = u.segment
        # tokens stay on the CPU here: a CUDA copy from the event loop would wait for the GPU's queue
        tokens = torch.tensor([seg.tokens], dtype=torch.int64)
        t2w = seg.t2w
        run = lambda item: self._t2w.run_flow(item, ChunkFinish(u, plan), deadline=u.deadline(), key=u.worker,
                                              on_worker=u.pin, first=u.first_audio is None)
        incremental = t2w.incremental and plan.streaming and not seg.resolve
        if incremental and self.flow_budget.admit(t2w, self._bytes_after(t2w, plan)):
            try:  # the hop is a flow job of its own batch key (concurrent streams' hops share one estimator call)
                return await run(IncrementalItem(partial(self._flow_state, t2w, u.voice_key(seg.voice)),
                                                 tokens[:, : plan.n_tokens], plan.finalize, plan.token_offset))
            except PoolFull:  # the pool filled between admission and the worker
                pass
            finally:  # this stream's job is over (done, failed, cancelled or refused): count what it holds
                self.flow_budget.update(t2w, t2w.flow_state_bytes)
        if incremental:  # no room: this segment re-solves from now on (the same mel, at the re-solve's cost)
            seg.resolve = True
            self.resolved_streams += 1
            t2w.drop_flow_state()
            self.flow_budget.release(t2w)
        return await run(t2w.flow_item(tokens, plan))

    def _bytes_after(self, t2w: Token2WavStream, plan: ChunkPlan) -> int:
        # the bytes a stream's state may hold after this hop (its own: a voice prefix is held once, by the cache);
        # whole blocks of the pool; the worker's allocation checks the pool itself (PoolFull -> re-solve)
        state, n_tokens = t2w.flow_state_or_none, t2w.n_prompt + plan.n_tokens
        pool = self.flow_pool
        own = len(state.est.table) - state.est.n_shared if state is not None else 0
        return (own + blocks_needed(pool, state, n_tokens)) * pool.block_bytes + pool.tail_bytes

    def _flow_state(self, t2w: Token2WavStream, voice_key) -> FlowState:
        # the stream's incremental state, from its voice's prefix (a prompt cache miss builds it here, on a worker)
        if self.prompt_cache is not None and t2w.voice_prefix is None and t2w.flow_state_or_none is None:
            def begin(prefix: VoicePrefix) -> FlowState:  # under the cache's lock (its blocks are held then)
                t2w.voice_prefix = prefix
                return t2w.flow_state

            p = t2w.prompt
            return self.prompt_cache.start(voice_key, self.model.flow, p.tokens, p.mel, p.embedding, begin)
        return t2w.flow_state

    async def stream(self, req: SynthesisRequest, on_end: Callable[[RequestStats], None] | None = None,
                     tokens: AsyncIterator[list[int]] | None = None) -> AsyncIterator[AudioChunk]:
        """Audio chunks of `req` in order; the last one has `is_final=True` and the stats. `on_end` gets the
        stats so far when the stream ends, however it ends (a stopped request's are on no chunk). `tokens`:
        the speech tokens of the whole text from elsewhere (bi-streaming's decode), spoken as one segment in
        place of the request's own LM requests; closing this stream closes it."""
        u = Utterance(req, self.segments(req) if tokens is None else [Turn(req.text, req.voice)])
        device = self.model.device
        prompts = {id(t.voice): t.voice.flow_prompt(device) for t in req.parts}  # the flow's view of each voice
        hift_gen = torch.Generator(device=device).manual_seed(req.seed)  # NSF noise, per request
        try:
            if tokens is not None:
                u.start_next_lm(tokens)  # the first segment takes it as its LM stream
            for seg_i, seg in enumerate(u.segments):
                async with contextlib.aclosing(self._segment(u, seg_i, seg, prompts[id(seg.voice)],
                                                             hift_gen)) as chunks:
                    async for chunk in chunks:  # closed at once when the caller stops early (aborts the LM)
                        yield chunk
        finally:  # a next segment's LM started early (see `_segment`) and never reached
            if on_end is not None:
                on_end(u.stats())
            await u.drop_next_lm()

    def segments(self, req: SynthesisRequest) -> list[Turn]:
        """The request's sentences in order, each with its voice (the official text split, turn by turn);
        `EmptyTextError` before any audio when a turn (or the text) has nothing speakable."""
        out = []
        for i, turn in enumerate(req.parts, 1):
            sentences = self.model.frontend.split_text(turn.text)
            if not sentences:
                raise EmptyTextError(Message("turn_unspeakable", "turn {i} ([{speaker}]) has nothing speakable after "
                                             "normalisation; type some words", i=i, speaker=turn.speaker)
                                     if req.turns else Message("normalised_empty", "the text has nothing speakable "
                                                               "after normalisation; type some words"))
            out += [Turn(text, turn.voice, turn.speaker) for text in sentences]
        return out

    async def _segment(self, u: Utterance, seg_i: int, segment: Turn, prompt,
                       hift_gen) -> AsyncIterator[AudioChunk]:
        # once this segment's LM has finished, the next segment's LM request starts (`Utterance.start_next_lm`):
        # its prefill and first hop run while our last chunks are vocoded, so the join does not stall
        # (the same requests and seeds as one after the other)
        req, t2w = u.request, Token2WavStream(self.model.flow, self.model.hift, prompt, self.streaming,
                                             stream=u.request.stream, incremental=self.incremental,
                                             chunk_tokens=self.chunk_tokens, pre_lookahead=self.pre_lookahead,
                                             speed=u.request.speed, generator=hift_gen, flow_pool=self.flow_pool)
        lm, first = u.take_next_lm()
        lm = lm or self.lm.stream(self.lm_request(req, segment.text, seg_i, segment.voice))
        u.segment = seg = Segment(t2w, lm, [], segment.voice)
        try:
            while not t2w.done:
                plan = t2w.next_plan(len(seg.tokens), seg.lm_finished)
                if plan is None:
                    t = time.perf_counter()
                    try:
                        new = await (first if first is not None else anext(seg.lm))
                    except StopAsyncIteration:
                        new, seg.lm_finished = [], True
                        if seg_i + 1 < len(u.segments):
                            nxt = u.segments[seg_i + 1]
                            u.start_next_lm(self.lm.stream(self.lm_request(req, nxt.text, seg_i + 1, nxt.voice)))
                    first = None
                    u.add_tokens(new, time.perf_counter() - t)
                    continue
                u.planned()
                if plan.finalize and not seg.tokens:  # the LM stopped at once: nothing to vocode
                    t2w.done = True
                    samples = np.zeros(0, dtype=np.float32)
                else:
                    samples = await self._run_t2w(u, plan)
                is_final = seg_i == len(u.segments) - 1 and plan.finalize
                index = u.n_chunks
                u.emitted(samples.shape[0])
                yield AudioChunk(samples=samples, index=index, segment=seg_i, is_final=is_final,
                                 stats=u.stats() if is_final else None)
        finally:
            await seg.lm.aclose()  # aborts the LM request if we stopped early
            self.flow_budget.release(t2w)
            if t2w.flow_state_or_none is not None:  # pooled blocks back, after any hop of ours still running
                try:  # (our worker runs jobs one at a time, so this waits for it)
                    await self._t2w.run(t2w.drop_flow_state, deadline=time.perf_counter(), key=u.worker)
                finally:  # idempotent; also when the scheduler is closed
                    t2w.drop_flow_state()

    def facts(self) -> dict[str, Any]:
        """The token->wave stage as configured and as it runs (workers, batching, graphs, caches)."""
        e, graphs, cache, budget = self.cfg.engine, self.flow_graphs, self.prompt_cache, self.flow_budget
        # which flow path streaming hops take: "paged incremental" (the O(chunk) path; a stream that finds its pool
        # full re-solves), "re-solve" (off, or on CUDA before warm-up)
        path = "paged incremental" if self.incremental else "re-solve"
        facts: dict[str, Any] = {"workers": e.token2wav_workers, "flow_batch": e.flow_batch,
                                 "flow_path": path, "flow_work": self.flow_work.snapshot(), "calls": self._t2w.facts(),
                                 "flow_cuda_graphs": None if graphs is None else vars(graphs.stats) | {
                                     "kept": graphs.n_graphs, "bucket_frames": graphs.bucket_frames}}
        if self.hift_graphs is not None:  # engine.hift_graphs on a GPU
            facts["hift_graphs"] = vars(self.hift_graphs.stats) | {"kept": self.hift_graphs.n_graphs,
                                                                   "frozen": self.hift_graphs.frozen}
        if cache is not None and (pool := self.flow_pool) is not None:  # engine.flow_incremental on
            pg = self.paged_graphs
            facts["flow_incremental"] = {
                "prompt_cache": vars(cache.stats) | {"voices": len(cache), "bytes": cache.nbytes},
                "state_bytes": budget.held_bytes, "state_max_bytes": budget.max_bytes, "sized": self.state_sizing,
                "refused_streams": budget.refused, "resolved_streams": self.resolved_streams,
                "pool_blocks": pool.n_blocks, "pool_free_blocks": pool.free_blocks, "pool_refused": pool.refused,
                "position_table_bytes": sum(t.nbytes for t in pool.encoder.positions),  # all streams' rows
                "paged_graphs": None if pg is None else pg.facts,
                "encoder_graphs": None if pg is None or pg.encoder is None else pg.encoder.facts}
        return facts

    async def aclose(self) -> None:
        await self.lm.aclose()
        self._t2w.shutdown()
