"""The official bi-streaming LM decode (`Qwen2LM.inference_bistream`), kept as a test reference.

The studio does not serve bi-streaming text input; `test_llm.test_bistream_matches_official` runs this
loop on `SpeechLM`'s pieces (`_feed`, `embed_text`, `embed_speech`, `llm_embedding`, `llm_decoder`), so
the goldens still check those pieces in the interleaved feeding order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor

from app.model.llm import EOS_TOKEN, FILL_TOKEN, SOS_ROW, SPEECH_TOKEN_SIZE, TASK_ID_ROW, SpeechLM
from app.model.sampling import Sampler


def greedy_sample(logp: Tensor, decoded: Sequence[int], generator: torch.Generator) -> int:
    """Deterministic sampler (argmax); the bistream goldens were made with it."""
    del decoded, generator
    return int(logp.argmax())


@torch.inference_mode()
def decode_bistream(lm: SpeechLM, text_pieces: Iterable[Tensor | Sequence[int]],
                    prompt_text_ids: Tensor | Sequence[int], prompt_speech_tokens: Tensor | Sequence[int],
                    generator: torch.Generator, sampler: Sampler | None = None,
                    max_len: int | None = None) -> Iterator[int]:
    """Official bi-streaming decode: text arrives piece by piece, speech tokens leave as made.

    Each item of `text_pieces` is handled as one arrival (upstream feeds one id at a time).
    Prompt text/speech are interleaved 5 text : 15 speech (`mix_ratio`); then each 5 new
    text tokens let the LM speak until it emits (or is forced to emit, every 16th output)
    the fill token 6563, which is never fed back. After the last piece, leftover text +
    task_id are fed and decoding runs to eos with no length limits. Upstream quirks kept:
    after a fill, the last fed chunk is fed again in front of the final text; prompt speech
    still pending when the text ends is dropped. Fill tokens are not yielded.
    `max_len` (not upstream, which has no limit) stops after that many yielded tokens.
    """
    sampler = sampler or lm.ras_sampler()
    n_text, n_speech = lm.dims.mix_ratio
    cache, out, n_yielded = lm.new_cache(), [], 0  # out: every output incl. fills (RAS window)
    pending = lm._special(SOS_ROW)  # [1, T, D]; stays as-is after it is fed (see quirks)
    text_cache = lm.embed_text(prompt_text_ids)  # [1, Lt, D] text waiting to be fed
    speech_prompt = lm.embed_speech(prompt_speech_tokens)  # [1, Ls, D]
    n_prompt = speech_prompt.shape[1]
    next_fill = (n_prompt // n_speech + 1) * n_speech - n_prompt  # output index of a forced fill

    def step(logp: Tensor) -> int:
        if len(out) == next_fill:
            return FILL_TOKEN
        logp[EOS_TOKEN] = -float("inf")
        return sampler(logp, out, generator)

    def speak(pick, end: int) -> Iterator[int]:
        """Feed `pending` and `pick` tokens until `end` (the fill token mid-text, eos at the end) or `max_len`;
        yields the speech tokens (each fed back), raises on any other token."""
        nonlocal pending, n_yielded, next_fill
        while True:
            token = pick(lm._feed(pending, cache))
            out.append(token)
            if token == end:
                if end == FILL_TOKEN:
                    next_fill = len(out) + n_speech  # the next forced fill, counted in outputs
                return
            if token >= SPEECH_TOKEN_SIZE:
                raise RuntimeError(f"bistream decode produced {token} where only speech or {end} may come")
            yield token
            n_yielded += 1
            if max_len is not None and n_yielded >= max_len:
                return
            pending = lm.embed_speech(token)

    for piece in text_pieces:
        text_cache = torch.cat([text_cache, lm.embed_text(piece)], dim=1)
        while speech_prompt.shape[1] and text_cache.shape[1] >= n_text:
            pending = torch.cat([pending, text_cache[:, :n_text], speech_prompt[:, :n_speech]], dim=1)
            text_cache, speech_prompt = text_cache[:, n_text:], speech_prompt[:, n_speech:]
        if speech_prompt.shape[1]:
            continue
        after_fill = bool(out) and out[-1] == FILL_TOKEN
        if after_fill or (not out and pending.shape[1] == 1):
            if text_cache.shape[1] < n_text:
                continue  # wait for more text
            chunk, text_cache = text_cache[:, :n_text], text_cache[:, n_text:]
            pending = chunk if after_fill else torch.cat([pending, chunk], dim=1)
        yield from speak(step, FILL_TOKEN)
        if max_len is not None and n_yielded >= max_len:
            return

    pending = torch.cat([pending, text_cache, lm._special(TASK_ID_ROW)], dim=1)
    yield from speak(lambda logp: sampler(logp, out, generator), EOS_TOKEN)
