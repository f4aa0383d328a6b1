"""Speech tokens -> 24 kHz waveform, streamed, with all per-request state in one object.

Design notes: docs/model.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from app.config import StreamingConfig
from app.model.flow.incremental.paged import KVPool
from app.model.flow.incremental.state import FlowState, VoicePrefix, incremental_inference
from app.model.flow_calls import FlowItem, FlowPrompt, flow_batch
from app.model.hift_batch import HiftRow, make_row, vocode_rows

MEL_CACHE_FRAMES = 8  # mel frames re-fed to HiFT at the start of the next chunk
SOURCE_CACHE_SAMPLES = MEL_CACHE_FRAMES * 480  # 3840: NSF source phase continuity (160 ms)
CROSSFADE_SAMPLES = SOURCE_CACHE_SAMPLES  # 3840 samples held back and cross-faded
# the flow's two facts, as CosyVoice2's cosyvoice2.yaml has them (the pipeline passes the checkpoint's own)
CHUNK_TOKENS = 25  # flow.encoder.static_chunk_size: tokens per attention chunk (the prompt pad aligns to it)
PRE_LOOKAHEAD_TOKENS = 3  # flow.pre_lookahead_len: tokens a hop needs past its end


@dataclass(frozen=True)
class ChunkPlan:
    """One token2wav call: run the flow on tokens[:n_tokens], keep mel from token_offset on."""

    n_tokens: int
    token_offset: int
    streaming: bool  # chunk-causal attention in the flow
    finalize: bool  # last chunk: no look-ahead hold-back, emit the held-back tail


def _crossfade_windows(kind: str, n: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(fade_in, fade_out) weights, each [n], applied as new*fade_in + old_tail*fade_out."""
    if kind == "hamming":  # np.hamming(2n): rising half for the new chunk, falling half for the old
        w = torch.hamming_window(2 * n, periodic=False, dtype=torch.float64)
        return w[:n].float().to(device), w[n:].float().to(device)
    if kind == "complementary":
        t = (torch.arange(n, dtype=torch.float64) + 0.5) / n
        fade_in = torch.sin(0.5 * math.pi * t) ** 2
        return fade_in.float().to(device), (1.0 - fade_in).float().to(device)
    raise ValueError(f"unknown crossfade {kind!r}")


def flow_step(flow, state: FlowState, tokens: Tensor, plan: ChunkPlan) -> Tensor:
    """New mel frames [1, 80, T] (float32) of one stream's `plan`, from its incremental `state`.

    tokens: [1, N >= plan.n_tokens] generated tokens. Streaming plans (hops, and a chunk-causal
    final) compute only the frames after the state's committed chunks and commit this call's
    whole chunks; the official final (streaming=False, full attention) cannot reuse them and runs
    today's full re-solve (`flow_batch`), exact; the state is finished after a final plan.
    """
    if plan.streaming:
        return incremental_inference(flow, state, tokens[:, : plan.n_tokens], finalize=plan.finalize,
                                     token_offset=plan.token_offset)
    prompt = FlowPrompt(state.prompt_tokens, state.prompt_mel, state.embedding)
    item = FlowItem(tokens[:, : plan.n_tokens], prompt, plan.streaming, plan.finalize, plan.token_offset)
    state.finished = state.finished or plan.finalize
    return flow_batch(flow, [item])[0]


class Token2WavStream:
    """Per-request token->wave state: hop schedule, token offset, HiFT mel/source/speech caches.

    Usage: whenever tokens arrive, `plan = s.next_plan(n_available, lm_finished)`; if a plan is
    returned, its flow call (`flow_item` + `flow_batch`, or an `IncrementalItem`) gives the mel and
    `wave = s.finish(mel, plan)` ([N] float32 at 24 kHz) (app/engine/pipeline.py). Exactly one plan has
    `finalize=True`; after it `s.done` is True. With `stream=False` only that final plan exists.
    The shared flow/hift modules are never mutated.
    """

    def __init__(self, flow, hift, prompt: FlowPrompt, streaming: StreamingConfig, *, stream: bool,
                 incremental: bool = False, chunk_tokens: int = CHUNK_TOKENS,
                 pre_lookahead: int = PRE_LOOKAHEAD_TOKENS, speed: float = 1.0,
                 generator: torch.Generator | None = None, voice_prefix: VoicePrefix | None = None,
                 flow_pool: KVPool | None = None) -> None:
        if speed != 1.0 and stream:
            raise ValueError("speed change is only supported without streaming (as upstream)")
        if voice_prefix is not None and not incremental:
            raise ValueError("voice_prefix is used by the incremental flow only: pass incremental=True")
        if incremental and flow_pool is None:
            raise ValueError("the incremental flow keeps its states in a pool: pass flow_pool (a KVPool)")
        self.voice_prefix = voice_prefix  # shared, read only (PromptCache entry)
        self.flow_pool = flow_pool  # the paged state pool of the incremental flow
        self._flow_state: FlowState | None = None  # incremental flow state, made on first use
        self.flow, self.hift, self.prompt, self.streaming = flow, hift, prompt, streaming
        # streaming hops through the incremental flow (exact w.r.t. the re-solve, O(new chunk) work)
        self.incremental = incremental
        self.chunk_tokens, self.pre_lookahead = chunk_tokens, pre_lookahead  # the flow's, in tokens
        self.stream, self.speed, self.generator = stream, speed, generator
        self.n_prompt = n_prompt = prompt.tokens.shape[1]
        # pad so the first chunk ends on a chunk edge of prompt + generated tokens (official); without
        # align_first_hop exactly first_hop_tokens (earlier first audio; the first chunk's frames after the
        # last edge saw only part of their chunk). Later hops always end on an edge.
        self.prompt_pad = -n_prompt % chunk_tokens if streaming.align_first_hop else 0
        self.hop = streaming.first_hop_tokens
        self.token_offset = 0
        self.done = False
        self._mel_cache: Tensor | None = None  # [1, 80, 8]
        self._source_cache: Tensor | None = None  # [1, 1, 3840]
        self._speech_tail: Tensor | None = None  # [1, 3840]

    def _this_hop(self) -> int:
        if self.token_offset == 0:
            return self.hop + self.prompt_pad
        # later hops end on a chunk edge of prompt + generated tokens, so every emitted frame was
        # computed with its whole chunk: + 0 in the official schedule (25 + pad, then 50, 100, ...)
        return self.hop + -(self.n_prompt + self.token_offset + self.hop) % self.chunk_tokens

    def next_plan(self, n_available: int, lm_finished: bool) -> ChunkPlan | None:
        """The next chunk to compute given `n_available` tokens, or None to wait for more."""
        if self.done:
            return None
        if self.stream:
            hop = self._this_hop()
            if n_available - self.token_offset >= hop + self.pre_lookahead:
                return ChunkPlan(self.token_offset + hop + self.pre_lookahead, self.token_offset,
                                 streaming=True, finalize=False)
        if lm_finished:
            causal = self.stream and self.streaming.final_call == "chunk_causal"  # else full attention
            return ChunkPlan(n_available, self.token_offset, streaming=causal, finalize=True)
        return None

    def flow_item(self, tokens: Tensor, plan: ChunkPlan) -> FlowItem:
        """The flow call of `plan` on `tokens` [1, N >= plan.n_tokens], for `flow_batch`."""
        return FlowItem(tokens[:, : plan.n_tokens], self.prompt, plan.streaming, plan.finalize, plan.token_offset)

    @property
    def flow_state(self) -> FlowState:
        """This request's incremental flow state (from the voice prefix if one was given)."""
        if self._flow_state is None:
            p = self.prompt
            self._flow_state = FlowState(self.flow, p.tokens, p.mel, p.embedding, prefix=self.voice_prefix,
                                         pool=self.flow_pool)
        return self._flow_state

    @property
    def flow_state_or_none(self) -> FlowState | None:
        """The incremental state if one was made (None before the first hop and after the final)."""
        return self._flow_state

    @property
    def flow_state_bytes(self) -> int:
        """Bytes the incremental flow state holds now (0 before its first hop and after the final)."""
        return self._flow_state.nbytes if self._flow_state is not None else 0

    def drop_flow_state(self) -> None:
        """Free the incremental state (its pooled blocks too); later hops then re-solve (`flow_item` +
        `flow_batch`), same mel. Idempotent: the stream's `finally` calls it."""
        if self._flow_state is not None:
            self._flow_state.release()
        self._flow_state = None

    def flow_mel(self, tokens: Tensor, plan: ChunkPlan) -> Tensor:
        """Flow stage of `plan` alone: new mel frames [1, 80, T] (float32), prefix before offset cut."""
        if self.incremental:
            return flow_step(self.flow, self.flow_state, tokens, plan)
        return flow_batch(self.flow, [self.flow_item(tokens, plan)])[0]

    @torch.inference_mode()
    def vocode(self, mel: Tensor, plan: ChunkPlan) -> Tensor:
        """HiFT stage of `plan`: returns the samples to emit, [N] float32; updates the caches."""
        row = self.hift_row(mel, plan)
        return self.emit(row, *vocode_rows(self.hift, [row])[0], plan)

    @torch.inference_mode()
    def hift_row(self, mel: Tensor, plan: ChunkPlan) -> HiftRow:
        """`plan`'s HiFT input from its flow output `mel` [1, 80, T]: the mel cache prepended (and the
        speed change of a final), the source cache, and this stream's NSF noise (drawn now)."""
        if self._mel_cache is not None:
            mel = torch.cat([self._mel_cache, mel], dim=2)
        if plan.finalize and self.speed != 1.0:
            mel = F.interpolate(mel, size=int(mel.shape[2] / self.speed), mode="linear")
        return make_row(self.hift, mel, self._source_cache, self.generator)

    @torch.inference_mode()
    def emit(self, row: HiftRow, wav: Tensor, source: Tensor, plan: ChunkPlan) -> Tensor:
        """The samples to emit, [N] float32, from `row`'s HiFT output (wav [1, 480 T], source
        [1, 1, 480 T], maybe computed with other streams' rows); cross-fades and updates the caches."""
        mel = row.mel
        wav = wav.float()
        if self._speech_tail is not None:
            fade_in, fade_out = _crossfade_windows(self.streaming.crossfade, CROSSFADE_SAMPLES, wav.device)
            head = wav[:, :CROSSFADE_SAMPLES] * fade_in + self._speech_tail * fade_out
            wav = torch.cat([head, wav[:, CROSSFADE_SAMPLES:]], dim=1)
        if not plan.finalize:
            self._mel_cache = mel[:, :, -MEL_CACHE_FRAMES:]
            self._source_cache = source[:, :, -SOURCE_CACHE_SAMPLES:]
            self._speech_tail = wav[:, -CROSSFADE_SAMPLES:]
            wav = wav[:, :-CROSSFADE_SAMPLES]
        return wav[0]

    def advance(self, plan: ChunkPlan) -> None:
        """Move the schedule past `plan` (call after its audio was produced)."""
        if plan.finalize:
            self.done = True
            self.drop_flow_state()  # the incremental state is not needed after the final call
            return
        self.token_offset += self._this_hop()
        self.hop = min(self.streaming.max_hop_tokens, self.hop * self.streaming.hop_growth)

    def finish(self, mel: Tensor, plan: ChunkPlan) -> Tensor:
        """HiFT for `plan` on its flow output `mel` [1, 80, T], then advance; returns [samples] float32.
        (Timings are the request's, kept by its `Utterance`, not here.)"""
        wave = self.vocode(mel, plan)
        self.advance(plan)
        return wave

    def finish_vocoded(self, row: HiftRow, wav: Tensor, source: Tensor, plan: ChunkPlan) -> Tensor:
        """`finish` for a `row` (`hift_row`) whose HiFT ran in a batched call (`vocode_rows`): emit its
        samples [N] float32, then advance."""
        wave = self.emit(row, wav, source, plan)
        self.advance(plan)
        return wave
