"""The synthesis pipeline: request -> text segments -> LM token stream -> audio chunks.

One `Synthesizer` per process is shared by every request. Per-request state (token list,
`Token2WavStream`, generators, timings) lives in locals of `stream()` and dies with it.
Flow/HiFT work runs as jobs of the `Token2WavScheduler` (the single owner of that compute: worker
threads, earliest deadline first), so the event loop stays free and requests interleave chunk by chunk.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from app.audio import OUTPUT_SAMPLE_RATE_HZ
from app.config import Config
from app.engine.lm_backend import LMRequest, SpeechTokenSource
from app.engine.requests import AudioChunk, RequestStats, SynthesisRequest
from app.engine.t2w_scheduler import Token2WavScheduler
from app.model.flow.graphs import EstimatorGraphs
from app.model.frontend import VoiceFeatures
from app.model.loader import CosyVoice2Model
from app.model.token2wav import StreamOptions, Token2WavStream, flow_batch

ENDOFPROMPT = "<|endofprompt|>"


class EmptyTextError(ValueError):
    """Nothing speakable is left after normalisation."""


@dataclass
class _Timings:
    t0: float = field(default_factory=time.perf_counter)
    first_audio: float | None = None
    lm_s: float = 0.0
    flow_s: float = 0.0
    hift_s: float = 0.0
    n_tokens: int = 0
    n_samples: int = 0
    n_chunks: int = 0


class Synthesizer:
    """Owns the shared model, the LM backend and the token->wave worker."""

    def __init__(self, model: CosyVoice2Model, lm: SpeechTokenSource, cfg: Config) -> None:
        self.model, self.lm, self.cfg = model, lm, cfg
        s = cfg.streaming
        fd = model.hparams.flow
        self.stream_opts = StreamOptions(
            first_hop_tokens=s.first_hop_tokens, hop_growth=s.hop_growth, max_hop_tokens=s.max_hop_tokens,
            chunk_tokens=fd.encoder.static_chunk_size, pre_lookahead=fd.pre_lookahead_len,
            crossfade=s.crossfade, align_first_hop=s.align_first_hop)
        e = cfg.engine
        # CUDA graphs of the flow estimator (off on CPU: nothing to capture there)
        self.flow_graphs = EstimatorGraphs(model.flow.decoder["estimator"], bucket_frames=e.flow_graph_bucket_frames,
                                           max_graphs=e.flow_max_graphs) \
            if e.flow_cuda_graphs and torch.device(model.device).type == "cuda" else None
        self._t2w = Token2WavScheduler(e.token2wav_workers, model.device, max_batch=e.flow_batch,
                                       flow_fn=partial(flow_batch, model.flow, graphs=self.flow_graphs))
        self._keys = itertools.count()  # spreads requests over the token2wav workers

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
        s = self.cfg.sampling
        if req.fixed_tokens:  # benchmark mode: a set output length whatever the (random) weights sample
            min_tokens = max_tokens = req.fixed_tokens
        else:
            min_tokens, max_tokens = int(len(text_ids) * s.min_len_ratio), int(len(text_ids) * s.max_len_ratio)
        return LMRequest(
            request_id=f"{req.request_id}-{index}", prompt_embeds=lm_input[0].float().cpu(), min_tokens=min_tokens,
            max_tokens=max_tokens, seed=req.seed + index, sampling=s, ignore_eos=bool(req.fixed_tokens))

    # --- streaming ---------------------------------------------------------------------------

    async def _run_t2w(self, t2w: Token2WavStream, tokens: list[int], plan, tm: _Timings, key: int) -> np.ndarray:
        # deadline: a first chunk's listener waits since the request began; a later chunk's audio is
        # needed when what was already sent has played out
        deadline = tm.t0 if tm.first_audio is None else tm.first_audio + tm.n_samples / OUTPUT_SAMPLE_RATE_HZ

        def finish(mel: torch.Tensor, flow_s: float) -> np.ndarray:  # on the worker, after the flow call
            hift_s = t2w.hift_s
            wave = t2w.finish(mel, plan)
            t2w.flow_s += flow_s
            tm.flow_s += flow_s  # the whole (maybe shared) flow call: the time this request waited on it
            tm.hift_s += t2w.hift_s - hift_s
            return wave.cpu().numpy().astype(np.float32, copy=False)

        # tokens stay on the CPU here: a CUDA copy from the event loop would wait for the GPU's queue
        item = t2w.flow_item(torch.tensor([tokens], dtype=torch.int64), plan)
        return await self._t2w.run_flow(item, finish, deadline=deadline, key=key)

    async def stream(self, req: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        """Audio chunks of `req` in order; the last one has `is_final=True` and the stats."""
        tm = _Timings()
        key = next(self._keys)
        segments = self.model.frontend.split_text(req.text)
        if not segments:
            raise EmptyTextError("the text has nothing speakable after normalisation; type some words")
        device = self.model.device
        prompt = req.voice.flow_prompt(device)
        hift_gen = torch.Generator(device=device).manual_seed(req.seed)  # NSF noise, per request
        index = 0
        for seg_i, segment in enumerate(segments):
            last_segment = seg_i == len(segments) - 1
            lm_req = self.lm_request(req, segment, seg_i)
            t2w = Token2WavStream(self.model.flow, self.model.hift, prompt, self.stream_opts,
                                  stream=req.stream, speed=req.speed, generator=hift_gen)
            tokens: list[int] = []
            finished = False
            stream = self.lm.stream(lm_req)
            try:
                while not t2w.done:
                    plan = t2w.next_plan(len(tokens), finished)
                    if plan is None:
                        t = time.perf_counter()
                        try:
                            new = await anext(stream)
                            tokens.extend(new)
                            tm.n_tokens += len(new)
                        except StopAsyncIteration:
                            finished = True
                        tm.lm_s += time.perf_counter() - t
                        continue
                    if plan.finalize and not tokens:  # the LM stopped at once: nothing to vocode
                        t2w.done = True
                        samples = np.zeros(0, dtype=np.float32)
                    else:
                        samples = await self._run_t2w(t2w, tokens, plan, tm, key)
                    is_final = last_segment and plan.finalize
                    tm.n_samples += samples.shape[0]
                    tm.n_chunks += 1
                    if tm.first_audio is None and samples.shape[0]:
                        tm.first_audio = time.perf_counter()
                    stats = self._stats(tm, len(segments)) if is_final else None
                    yield AudioChunk(samples=samples, index=index, segment=seg_i, is_final=is_final, stats=stats)
                    index += 1
            finally:
                await stream.aclose()  # aborts the LM request if we stopped early

    def _stats(self, tm: _Timings, n_segments: int) -> RequestStats:
        now = time.perf_counter()
        first = tm.first_audio if tm.first_audio is not None else now
        return RequestStats(
            ttfa_ms=(first - tm.t0) * 1e3, wall_s=now - tm.t0, audio_s=tm.n_samples / OUTPUT_SAMPLE_RATE_HZ,
            n_tokens=tm.n_tokens, n_segments=n_segments, n_chunks=tm.n_chunks, lm_s=tm.lm_s,
            flow_s=tm.flow_s, hift_s=tm.hift_s)

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
