"""The official bi-streaming LM decode (`Qwen2LM.inference_bistream`) on `SpeechLM`'s KV cache.

The interleaving is the served one (`app.engine.bistream.Interleave`); `test_llm.test_bistream_matches_official`
runs it here on `SpeechLM`'s pieces (`_feed`, `embed_lm_ids`, `llm_decoder`), so the goldens check the plan
the server runs (fed chunks, logits per call, tokens) in the interleaved feeding order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor

from app.engine.bistream import Interleave
from app.model.llm import EOS_TOKEN, FILL_TOKEN, SPEECH_TOKEN_SIZE, SpeechLM
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

    Each item of `text_pieces` is one arrival (upstream feeds one id at a time). `Interleave` says what to
    feed; each block speaks until the fill token 6563 (sampled, or forced every 16th output; never fed
    back), the final one until eos with no length limits. Fill tokens are not yielded.
    `max_len` (not upstream, which has no limit) stops after that many yielded tokens.
    """
    sampler = sampler or lm.ras_sampler()
    plan = Interleave(torch.as_tensor(prompt_text_ids).reshape(-1).tolist(),
                      torch.as_tensor(prompt_speech_tokens).reshape(-1).tolist(), lm.dims.mix_ratio)
    cache, out, n_yielded = lm.new_cache(), [], 0  # out: every output incl. fills (RAS window)

    def speak(feed: list[int], final: bool, max_new: int) -> Iterator[int]:
        """Feed `feed`, then each speech token made, until the fill (eos at the end) or `max_len`."""
        nonlocal n_yielded
        pending, made, end = lm.embed_lm_ids(feed), [], EOS_TOKEN if final else FILL_TOKEN
        while True:
            logp = lm._feed(pending, cache)
            if not final and len(made) == max_new:
                token = FILL_TOKEN  # forced: this call's logits go unused
            else:
                if not final:
                    logp[EOS_TOKEN] = -float("inf")
                token = sampler(logp, out, generator)
            out.append(token)
            if token == end:
                if not final:
                    plan.spoke(made)
                return
            if token >= SPEECH_TOKEN_SIZE:
                raise RuntimeError(f"bistream decode produced {token} where only speech or {end} may come")
            made.append(token)
            yield token
            n_yielded += 1
            if max_len is not None and n_yielded >= max_len:
                return
            pending = lm.embed_speech(token)

    for piece in text_pieces:
        if (block := plan.push(torch.as_tensor(piece).reshape(-1).tolist())) is not None:
            yield from speak(block.feed, False, block.max_new)
            if max_len is not None and n_yielded >= max_len:
                return
    block = plan.finish()
    yield from speak(block.feed, True, 0)
