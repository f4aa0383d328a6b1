"""The CosyVoice2 speech LM (official `Qwen2LM`): prompt building, one decode step, decode loops.

Design notes: docs/model.md.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from app.model.hparams import LLMDims
from app.model.qwen2 import KVCache, Qwen2ForCausalLM
from app.model.sampling import Sampler, ras_sample

SPEECH_TOKEN_SIZE = 6561  # real speech tokens 0..6560 (3^8 FSQ codebook)
EOS_TOKEN = SPEECH_TOKEN_SIZE  # 6561: end of speech; banned while fewer than min_len tokens
UNUSED_STOP_TOKEN = SPEECH_TOKEN_SIZE + 1  # 6562: no role at inference, only a stop id
FILL_TOKEN = SPEECH_TOKEN_SIZE + 2  # 6563: bistream "need more text" marker
STOP_TOKENS = frozenset({EOS_TOKEN, UNUSED_STOP_TOKEN, FILL_TOKEN})
N_SPEECH_ROWS = SPEECH_TOKEN_SIZE + 3  # rows of speech_embedding / outputs of llm_decoder
SOS_ROW, TASK_ID_ROW = 0, 1  # rows of llm_embedding
# The prompt's id space, one table: speech tokens [0, 6564) padded to SPEECH_ID_ROWS (a multiple of 64),
# then sos and task_id, then the text vocabulary from TEXT_ID_OFFSET. Sampled ids stay speech tokens.
SPEECH_ID_ROWS = 6592
ENDOFPROMPT = "<|endofprompt|>"  # ends an instruction (CosyVoice2 instruct mode); the pipeline appends it
SOS_ID, TASK_ID_ID = SPEECH_ID_ROWS + SOS_ROW, SPEECH_ID_ROWS + TASK_ID_ROW
TEXT_ID_OFFSET = SPEECH_ID_ROWS + 2


class _Qwen2Encoder(nn.Module):
    """The official `Qwen2Encoder` level: no weights of its own, it gives keys `llm.model.*`."""

    def __init__(self, dims: LLMDims) -> None:
        super().__init__()
        self.model = Qwen2ForCausalLM(dims.qwen)


@dataclass
class DecodeState:
    """One request's decode loop state; it dies with the request."""

    cache: KVCache
    generator: torch.Generator
    pending: Tensor  # [1, T, D] embeddings not yet fed: the prefix, then the last token
    min_len: int
    max_len: int
    out_tokens: list[int] = field(default_factory=list)
    finished: bool = False


def _ids(x: Tensor | Sequence[int], device: torch.device) -> Tensor:
    """Token ids as a long tensor `[1, L]` (accepts `[L]`, `[1, L]` or a list)."""
    t = torch.as_tensor(x, dtype=torch.long, device=device)
    return t.reshape(1, -1)


class SpeechLM(nn.Module):
    """Text + prompt speech tokens -> speech tokens (25 Hz), official `Qwen2LM` weights."""

    def __init__(self, dims: LLMDims) -> None:
        super().__init__()
        if dims.speech_token_size != SPEECH_TOKEN_SIZE:
            raise ValueError(f"speech_token_size {dims.speech_token_size} != {SPEECH_TOKEN_SIZE}: "
                             "not a CosyVoice2 LLM")
        if dims.llm_input_size != dims.qwen.hidden_size or dims.llm_output_size != dims.qwen.hidden_size:
            raise ValueError(f"llm_input/output_size {dims.llm_input_size}/{dims.llm_output_size} "
                             f"!= Qwen2 hidden_size {dims.qwen.hidden_size}")
        self.dims = dims
        self.llm_embedding = nn.Embedding(2, dims.llm_input_size)
        self.llm = _Qwen2Encoder(dims)
        self.llm_decoder = nn.Linear(dims.llm_output_size, N_SPEECH_ROWS)
        self.speech_embedding = nn.Embedding(N_SPEECH_ROWS, dims.llm_input_size)

    # --- pieces --------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.llm_decoder.weight.device

    def embed_speech(self, token_ids: Tensor | Sequence[int] | int) -> Tensor:
        """Speech-token embeddings `[1, L, D]` (an int gives `[1, 1, D]`)."""
        return self.speech_embedding(_ids(token_ids, self.device))

    @torch.inference_mode()
    def build_lm_input(self, text_ids: Tensor | Sequence[int], prompt_text_ids: Tensor | Sequence[int] = (),
                       prompt_speech_tokens: Tensor | Sequence[int] = ()) -> Tensor:
        """LM prefix `[1, 1 + Lp + Lt + 1 + Ls, D]`.

        zero_shot: prompt text + prompt speech; cross_lingual: neither; instruct: the instruct
        text (ending in `<|endofprompt|>`) as `prompt_text_ids` and no prompt speech.
        """
        return self.embed_lm_ids(build_lm_ids(text_ids, prompt_text_ids, prompt_speech_tokens))

    @torch.inference_mode()
    def embed_lm_ids(self, ids: Sequence[int]) -> Tensor:
        """`[1, T, D]` embeddings of a `build_lm_ids` prompt (speech, sos/task_id and text rows)."""
        t = _ids(ids, self.device)[0]
        out = torch.empty(len(t), self.dims.llm_input_size, dtype=self.speech_embedding.weight.dtype,
                          device=self.device)
        speech, text = t < SPEECH_ID_ROWS, t >= TEXT_ID_OFFSET
        special = ~(speech | text)
        out[speech] = self.speech_embedding(t[speech])
        out[special] = self.llm_embedding(t[special] - SPEECH_ID_ROWS)
        out[text] = self.llm.model.model.embed_tokens(t[text] - TEXT_ID_OFFSET)
        return out.unsqueeze(0)


    @torch.inference_mode()
    def hidden(self, inputs_embeds: Tensor, cache: KVCache | None = None) -> Tensor:
        """Final-norm Qwen2 hidden states `[B, T, D]` (see `Qwen2Model.forward`)."""
        return self.llm.model(inputs_embeds, cache)

    @torch.inference_mode()
    def logp(self, hidden_last: Tensor) -> Tensor:
        """log_softmax(llm_decoder(h)): `[D] -> [6564]` (or `[B, D] -> [B, 6564]`)."""
        return self.llm_decoder(hidden_last).log_softmax(dim=-1)

    def release_backbone(self) -> None:
        """Free the Qwen2 layers when another engine (vLLM) decodes: prompts need only the tables.

        Keeps `llm_embedding`, the text `embed_tokens` and `speech_embedding` (build_lm_input);
        decoding with this module afterwards is an error.
        """
        qwen = self.llm.model.model
        qwen.layers = nn.ModuleList()
        self.backbone_released = True

    def new_cache(self) -> KVCache:
        return self.llm.model.model.new_cache()

    def ras_sampler(self) -> Sampler:
        """The official sampler with this checkpoint's yaml settings (top_p, top_k, window, tau_r)."""
        d = self.dims
        return functools.partial(ras_sample, top_p=d.top_p, top_k=d.top_k, win_size=d.win_size, tau_r=d.tau_r)

    @torch.inference_mode()
    def _feed(self, inputs_embeds: Tensor, cache: KVCache) -> Tensor:
        """Feed `[1, T, D]` through the backbone; log-probs `[6564]` of the next token."""
        return self.logp(self.hidden(inputs_embeds, cache)[0, -1])

    # --- decoding ------------------------------------------------------------------------------

    def start(self, lm_input: Tensor, min_len: int, max_len: int, generator: torch.Generator) -> DecodeState:
        """A fresh per-request state for `lm_input [1, T, D]` (see `build_lm_input`)."""
        return DecodeState(self.new_cache(), generator, lm_input, min_len, max_len)

    @torch.inference_mode()
    def next_token(self, state: DecodeState, sampler: Sampler | None = None) -> int | None:
        """One official decode step: the next speech token, or None once the request ended.

        eos (6561) is set to -inf while fewer than `min_len` tokens were emitted; any stop id
        (6561/6562/6563) or reaching `max_len` tokens ends the request.
        """
        if state.finished or len(state.out_tokens) >= state.max_len:
            state.finished = True
            return None
        logp = self._feed(state.pending, state.cache)
        if len(state.out_tokens) < state.min_len:
            logp[EOS_TOKEN] = -float("inf")
        token = (sampler or self.ras_sampler())(logp, state.out_tokens, state.generator)
        if token in STOP_TOKENS:
            state.finished = True
            return None
        state.out_tokens.append(token)
        state.pending = self.embed_speech(token)
        return token

    def decode(self, lm_input: Tensor, min_len: int, max_len: int, generator: torch.Generator,
               sampler: Sampler | None = None) -> Iterator[int]:
        """Yield speech tokens one at a time (KV-cached) until a stop id or `max_len` tokens."""
        state = self.start(lm_input, min_len, max_len, generator)
        sampler = sampler or self.ras_sampler()
        while (token := self.next_token(state, sampler)) is not None:
            yield token


def build_lm_ids(text_ids: Tensor | Sequence[int], prompt_text_ids: Tensor | Sequence[int] = (),
                 prompt_speech_tokens: Tensor | Sequence[int] = ()) -> list[int]:
    """`build_lm_input`'s sequence as ids of the one table (see TEXT_ID_OFFSET)."""
    def flat(x: Tensor | Sequence[int]) -> list[int]:
        return torch.as_tensor(x, dtype=torch.long).reshape(-1).tolist()

    return [SOS_ID, *(TEXT_ID_OFFSET + t for t in flat(prompt_text_ids) + flat(text_ids)), TASK_ID_ID,
            *flat(prompt_speech_tokens)]
