"""Requests in, chunks out: small frozen dataclasses, never dicts of tensors."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from app.model.frontend import VoiceFeatures

Mode = Literal["zero_shot", "cross_lingual", "instruct"]
MODES: tuple[Mode, ...] = ("zero_shot", "cross_lingual", "instruct")


@dataclass(frozen=True)
class Turn:
    """One speaker's part of a dialogue (app/service/dialogue.py): `text` spoken in `voice`."""

    text: str
    voice: VoiceFeatures
    speaker: str = ""  # the script's tag: a saved voice's name ("" = the request's own voice)


@dataclass(frozen=True)
class SynthesisRequest:
    """One synthesis: speak `text` in `voice`.

    zero_shot: the LM continues the reference (transcript + speech tokens); cross_lingual: the LM
    sees only the text (use when the reference language differs); instruct: the LM sees
    `instruct_text` (e.g. "Speak happily<|endofprompt|>") instead of the transcript. The flow
    always uses the reference's tokens, mel and x-vector. The fields are checked once, where a door builds the
    request (app/service/prepare.py): a mode of MODES, an instruction in instruct mode, speed only unstreamed.
    """

    text: str
    voice: VoiceFeatures
    mode: Mode = "zero_shot"
    instruct_text: str = ""
    seed: int = 0
    speed: float = 1.0  # non-streaming only, as upstream
    stream: bool = True
    fixed_tokens: int = 0  # benchmarks on random weights: exactly this many speech tokens per segment (0 = off)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # a dialogue: its turns in order, each in its own voice (then `text` is the whole script and `voice` the
    # first turn's); () = all of `text` in `voice`
    turns: tuple[Turn, ...] = ()

    @property
    def parts(self) -> tuple[Turn, ...]:
        """What to speak in which voice, in order: the turns, or the one text in the one voice."""
        return self.turns or (Turn(self.text, self.voice),)


@dataclass(frozen=True)
class RequestStats:
    """Timings of one finished request (seconds unless named *_ms)."""

    ttfa_ms: float  # request start -> first non-empty audio chunk ready
    wall_s: float
    audio_s: float
    n_tokens: int  # speech tokens produced by the LM (all segments)
    n_segments: int
    n_chunks: int
    lm_s: float  # time spent waiting on the LM stream
    flow_s: float
    hift_s: float
    # per chunk, in order: wall ms of its flow call (the whole call when batched) and mel frames it emitted
    chunk_flow_ms: tuple[float, ...] = ()
    chunk_frames: tuple[int, ...] = ()
    # the first-audio path: request start -> the LM's first token, -> the first chunk's tokens all in
    # (ttfa_ms - first_hop_ms is the token->wave queue wait + the first flow call + its HiFT)
    first_token_ms: float | None = None
    first_hop_ms: float | None = None
    # the first chunk on its token->wave worker: request start -> its wave ready (flow call and HiFT done), and
    # its HiFT's ms; so ttfa_ms = first_hop_ms + the queue wait + chunk_flow_ms[0] + first_hift_ms + the hand-off
    first_wave_ms: float | None = None
    first_hift_ms: float | None = None
    # the LM's pace inside the pipeline: ms per token from the first token's arrival to the first hop's
    # tokens all in (only tokens are awaited then), over the tokens after the first delta; None if < 2 deltas
    lm_ms_per_token: float | None = None

    @property
    def rtf(self) -> float:
        return self.wall_s / self.audio_s if self.audio_s > 0 else float("inf")

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(frozen=True)
class AudioChunk:
    """A piece of the output, in order. Exactly one chunk per request has `is_final=True`."""

    samples: np.ndarray  # [N] float32 at 24 kHz in [-1, 1]
    index: int
    segment: int  # which normalised text segment it belongs to
    is_final: bool
    stats: RequestStats | None = None  # set on the final chunk only
