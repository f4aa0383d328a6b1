"""The synthesis pipeline: request -> text segments -> LM token stream -> audio chunks.

One `Synthesizer` per process is shared by every request. All per-request state (segments, token
list, LM stream, `Token2WavStream`, worker affinity, timings) lives on one `Utterance`
(app/engine/utterance.py), made by `stream()` and dying with it.
Flow/HiFT work runs as jobs of the `Token2WavScheduler` (the single owner of that compute: worker
threads, earliest deadline first), so the event loop stays free and requests interleave chunk by chunk.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from functools import partial

import numpy as np
import torch

from app.audio import MEL_FRAMES_PER_TOKEN
from app.config import Config
from app.engine.flow_budget import FlowBudget
from app.engine.inputs import ENDOFPROMPT
from app.engine.lm_backend import LMRequest, SpeechTokenSource
from app.engine.requests import AudioChunk, RequestStats, SynthesisRequest
from app.engine.t2w_scheduler import Token2WavScheduler
from app.engine.utterance import Segment, Utterance
from app.model.flow.graphs import EstimatorGraphs
from app.model.flow.incremental import state_bytes
from app.model.flow.prompt_cache import PromptCache
from app.model.frontend import VoiceFeatures
from app.model.loader import CosyVoice2Model
from app.model.token2wav import ChunkPlan, StreamOptions, Token2WavStream, flow_batch, flow_step


class EmptyTextError(ValueError):
    """Nothing speakable is left after normalisation."""


class Synthesizer:
    """Owns the shared model, the LM backend and the token->wave worker."""

    def __init__(self, model: CosyVoice2Model, lm: SpeechTokenSource, cfg: Config) -> None:
        self.model, self.lm, self.cfg = model, lm, cfg
        self.sampling = cfg.sampling.resolved(model.hparams.llm)  # RAS: the checkpoint's yaml unless overridden
        s = cfg.streaming
        fd = model.hparams.flow
        self.stream_opts = StreamOptions(
            first_hop_tokens=s.first_hop_tokens, hop_growth=s.hop_growth, max_hop_tokens=s.max_hop_tokens,
            chunk_tokens=fd.encoder.static_chunk_size, pre_lookahead=fd.pre_lookahead_len,
            crossfade=s.crossfade, align_first_hop=s.align_first_hop, incremental=cfg.engine.flow_incremental)
        e = cfg.engine
        # incremental flow: per-voice prompt prefixes (shared, read only) and the budget of all streams' states
        self.prompt_cache = PromptCache(max_bytes=int(e.prompt_cache_gib * 2**30)) if e.flow_incremental else None
        self.flow_budget = FlowBudget(int(e.flow_state_gib * 2**30))
        # CUDA graphs of the flow estimator (off on CPU: nothing to capture there)
        self.flow_graphs = EstimatorGraphs(model.flow.decoder["estimator"], bucket_frames=e.flow_graph_bucket_frames,
                                           max_graphs=e.flow_max_graphs) \
            if e.flow_cuda_graphs and torch.device(model.device).type == "cuda" else None
        self._t2w = Token2WavScheduler(e.token2wav_workers, model.device, max_batch=e.flow_batch,
                                       flow_fn=partial(flow_batch, model.flow, graphs=self.flow_graphs))

    # --- voices ------------------------------------------------------------------------------

    def voice_from_audio(self, src, prompt_text: str) -> VoiceFeatures:
        """Reference audio (path or bytes) + transcript -> reusable voice features (blocking)."""
        return self.model.frontend.voice_from_audio(src, prompt_text)

    # --- LM inputs ---------------------------------------------------------------------------

    def lm_request(self, req: SynthesisRequest, segment: str, index: int) -> LMRequest:
        fe, llm, voice = self.model.frontend, self.model.llm, req.voice
        text_ids = fe.text_ids(segment)
        empty = torch.zeros(0, dtype=torch.int32)
        if req.mode == "zero_shot":
            prompt_ids, prompt_speech = voice.prompt_text_ids, voice.speech_tokens[0]
        elif req.mode == "cross_lingual":
            prompt_ids, prompt_speech = empty, empty
        else:  # instruct: the instruction replaces the transcript; it must end with <|endofprompt|>
            instruct = req.instruct_text if ENDOFPROMPT in req.instruct_text else req.instruct_text + ENDOFPROMPT
            prompt_ids, prompt_speech = fe.text_ids(instruct), empty
        with torch.inference_mode():
            lm_input = llm.build_lm_input(text_ids, prompt_ids, prompt_speech)
        s = self.sampling
        if req.fixed_tokens:  # benchmark mode: a set output length whatever the (random) weights sample
            min_tokens = max_tokens = req.fixed_tokens
        else:
            min_tokens, max_tokens = int(len(text_ids) * s.min_len_ratio), int(len(text_ids) * s.max_len_ratio)
        return LMRequest(
            request_id=f"{req.request_id}-{index}", prompt_embeds=lm_input[0].float().cpu(), min_tokens=min_tokens,
            max_tokens=max_tokens, seed=req.seed + index, sampling=s, ignore_eos=bool(req.fixed_tokens))

    # --- streaming ---------------------------------------------------------------------------

    async def _run_t2w(self, u: Utterance, plan: ChunkPlan) -> np.ndarray:
        seg = u.segment
        # tokens stay on the CPU here: a CUDA copy from the event loop would wait for the GPU's queue
        tokens = torch.tensor([seg.tokens], dtype=torch.int64)
        if seg.t2w.opts.incremental and plan.streaming and not seg.resolve:
            return await self._t2w.run(partial(self._incremental_chunk, u, tokens, plan), deadline=u.deadline(),
                                       key=u.worker)
        item = seg.t2w.flow_item(tokens, plan)
        return await self._t2w.run_flow(item, partial(u.finish_chunk, plan), deadline=u.deadline(), key=u.worker)

    def _incremental_chunk(self, u: Utterance, tokens: torch.Tensor, plan: ChunkPlan) -> np.ndarray:
        """One streaming hop through the incremental flow, then HiFT (on a token->wave worker)."""
        t0 = time.perf_counter()
        seg, flow = u.segment, self.model.flow
        t2w = seg.t2w
        first_bytes = state_bytes(flow, MEL_FRAMES_PER_TOKEN * (t2w.n_prompt + plan.n_tokens))
        if self.flow_budget.admit(t2w, t2w.flow_state_bytes, first_bytes):
            if self.prompt_cache is not None and t2w.voice_prefix is None and not t2w.flow_state_bytes:
                p = t2w.prompt
                t2w.voice_prefix = self.prompt_cache.get(u.voice_key, flow, p.tokens, p.mel, p.embedding)
            mel = flow_step(flow, t2w.flow_state, tokens, plan)
            self.flow_budget.update(t2w, t2w.flow_state_bytes)
        else:  # no room: this segment re-solves from now on (the same mel, at the re-solve's cost)
            seg.resolve = True
            t2w.drop_flow_state()
            mel = flow_batch(flow, [t2w.flow_item(tokens, plan)], graphs=self.flow_graphs)[0]
        return u.finish_chunk(plan, mel, time.perf_counter() - t0)

    async def stream(self, req: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        """Audio chunks of `req` in order; the last one has `is_final=True` and the stats."""
        segments = self.model.frontend.split_text(req.text)
        if not segments:
            raise EmptyTextError("the text has nothing speakable after normalisation; type some words")
        u = Utterance(req, segments, n_workers=self.cfg.engine.token2wav_workers)
        device = self.model.device
        prompt = req.voice.flow_prompt(device)
        hift_gen = torch.Generator(device=device).manual_seed(req.seed)  # NSF noise, per request
        for seg_i, text in enumerate(segments):
            t2w = Token2WavStream(self.model.flow, self.model.hift, prompt, self.stream_opts,
                                  stream=req.stream, speed=req.speed, generator=hift_gen)
            u.segment = seg = Segment(seg_i, text, t2w, self.lm.stream(self.lm_request(req, text, seg_i)), [])
            try:
                while not t2w.done:
                    plan = t2w.next_plan(len(seg.tokens), seg.lm_finished)
                    if plan is None:
                        t = time.perf_counter()
                        try:
                            new = await anext(seg.lm)
                        except StopAsyncIteration:
                            new, seg.lm_finished = [], True
                        u.add_tokens(new, time.perf_counter() - t)
                        continue
                    if plan.finalize and not seg.tokens:  # the LM stopped at once: nothing to vocode
                        t2w.done = True
                        samples = np.zeros(0, dtype=np.float32)
                    else:
                        samples = await self._run_t2w(u, plan)
                    is_final = u.is_last_segment and plan.finalize
                    index = u.chunk_index
                    u.emitted(samples.shape[0])
                    yield AudioChunk(samples=samples, index=index, segment=seg_i, is_final=is_final,
                                     stats=u.stats() if is_final else None)
            finally:
                await seg.lm.aclose()  # aborts the LM request if we stopped early
                self.flow_budget.release(t2w)

    async def synthesize(self, req: SynthesisRequest) -> tuple[np.ndarray, RequestStats]:
        """Whole utterance at once: ([N] float32 at 24 kHz, stats)."""
        parts, stats = [], None
        async for chunk in self.stream(req):
            parts.append(chunk.samples)
            stats = chunk.stats or stats
        assert stats is not None
        return np.concatenate(parts) if parts else np.zeros(0, np.float32), stats

    async def aclose(self) -> None:
        await self.lm.aclose()
        self._t2w.shutdown()
