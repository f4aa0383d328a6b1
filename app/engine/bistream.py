"""Text that streams in: CosyVoice2's bi-streaming decode (`Qwen2LM.inference_bistream`) on any LM backend.
Design notes: docs/design.md."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from app.engine.lm_backend import LMRequest, SpeechTokenSource
from app.model.llm import FILL_TOKEN, SOS_ID, TASK_ID_ID, TEXT_ID_OFFSET

if TYPE_CHECKING:  # annotations only: the pipeline is built on the engine's modules, this one among them
    from app.engine.pipeline import Synthesizer
    from app.engine.requests import SynthesisRequest

_END = re.compile(r"[.!?;。！？；…]+[\"')\]]*\s+")  # a sentence ends at terminal punctuation before a space


@dataclass(frozen=True)
class Block:
    feed: list[int]  # ids appended to the sequence before this block decodes
    final: bool  # False: text still streams (eos banned, ends at the fill token); True: to eos
    max_new: int  # mid-text: speech tokens before the forced fill (whose step's logits go unused)


class Interleave:
    """The official interleaving (mix ratio 5 text : 15 speech, the fill token 6563), as table ids.

    Upstream quirks kept: the fill is never fed; after a fill the last fed item is fed again in front
    of the final text; prompt speech still pending when the text ends is dropped."""

    def __init__(self, prompt_text_ids: Sequence[int], prompt_speech: Sequence[int],
                 mix_ratio: tuple[int, int] = (5, 15)) -> None:
        self.n_text, self.n_speech = mix_ratio
        self.pending = [SOS_ID]  # the last item fed (or to feed); stays after it is fed (quirk)
        self.text = [TEXT_ID_OFFSET + int(t) for t in prompt_text_ids]  # text waiting to be fed
        self.speech = [int(s) for s in prompt_speech]  # prompt speech waiting to be mixed in
        self.n_out = 0  # outputs incl. fills
        n = len(self.speech)
        self.next_fill = (n // self.n_speech + 1) * self.n_speech - n  # output index of a forced fill

    def push(self, text_ids: Sequence[int]) -> Block | None:
        """One arrival of text ids (upstream: one id each); the block to decode now, if any."""
        self.text += [TEXT_ID_OFFSET + int(t) for t in text_ids]
        nt, ns = self.n_text, self.n_speech
        while self.speech and len(self.text) >= nt:
            self.pending = self.pending + self.text[:nt] + self.speech[:ns]
            self.text, self.speech = self.text[nt:], self.speech[ns:]
        if self.speech:
            return None
        after_fill = self.n_out > 0  # every mid-text block ends with a fill
        if after_fill or self.pending == [SOS_ID]:
            if len(self.text) < nt:
                return None  # wait for more text
            chunk, self.text = self.text[:nt], self.text[nt:]
            self.pending = chunk if after_fill else self.pending + chunk
        return Block(list(self.pending), False, self.next_fill - self.n_out)

    def spoke(self, tokens: Sequence[int]) -> None:
        """A mid-text block made `tokens` and then the fill (sampled or forced)."""
        self.n_out += len(tokens) + 1
        self.next_fill = self.n_out + self.n_speech
        if tokens:
            self.pending = [int(tokens[-1])]

    def finish(self) -> Block:
        """The text ended: the rest of it and task_id, decoded to eos."""
        return Block(self.pending + self.text + [TASK_ID_ID], True, 0)


async def decode(lm: SpeechTokenSource, text_ids: AsyncIterator[list[int]], base: LMRequest,
                 prompt_text_ids: Sequence[int], prompt_speech: Sequence[int],
                 mix_ratio: tuple[int, int] = (5, 15), max_final: int | None = None) -> AsyncIterator[list[int]]:
    """Speech tokens as the text ids arrive. Each block is one backend request on the whole sequence so
    far (prompt rows + every speech token fed back), `max_tokens` up to its fill, eos banned mid-text
    (`min_tokens`); the final block to eos, at most `max_final` (default `base.max_tokens`) tokens.
    Closing this iterator closes the running request (vLLM aborts it)."""
    plan, seq = Interleave(prompt_text_ids, prompt_speech, mix_ratio), []
    out: list[int] = []  # every output so far incl. fills: the official RAS window runs over it
    blocks, i = _blocks(plan, text_ids), -1
    try:
        async for block in blocks:
            i += 1
            seq += block.feed
            n = block.max_new if not block.final else (max_final or base.max_tokens)
            # the take's id on every block (the backend makes each stream's own, app/engine/vllm_backend.py)
            req = replace(base, prompt_ids=tuple(seq),
                          min_tokens=0 if block.final else n, max_tokens=n, seed=base.seed + i,
                          history=tuple(out))
            made: list[int] = []
            async with contextlib.aclosing(lm.stream(req)) as tokens:
                async for new in tokens:
                    made += new
                    yield new
            seq += made
            if not block.final:
                plan.spoke(made)
                out += [*made, FILL_TOKEN]  # the fill (sampled, or forced at max_new) ends the block
    finally:
        await blocks.aclose()


def take_tokens(synth: Synthesizer, req: SynthesisRequest, text_ids: AsyncIterator[list[int]],
                max_text_chars: int) -> AsyncIterator[list[int]]:
    """`decode` for one take: `req`'s prompt, mode and seed on `synth`'s LM. The final block ends at
    eos, at most the length limit of a text of `max_text_chars` tokens (a bound: a token is at least a
    character); with `req.fixed_tokens` (benchmarks on random weights) it is that long, eos ignored."""
    s = synth.sampling
    n_final = req.fixed_tokens or s.length_limits(max_text_chars)[1]
    base = LMRequest(req.request_id, (), 0, n_final, req.seed, s, ignore_eos=bool(req.fixed_tokens))
    prompt_text_ids, prompt_speech = (x.tolist() for x in synth.prompt(req))
    return decode(synth.lm, text_ids, base, prompt_text_ids, prompt_speech, mix_ratio=synth.model.llm.dims.mix_ratio)


async def _blocks(plan: Interleave, text_ids: AsyncIterator[list[int]]) -> AsyncIterator[Block]:
    # the plan's blocks as text arrives (a block is taken only after the previous one was spoken)
    async for ids in text_ids:
        for t in ids:
            if (block := plan.push([t])) is not None:  # one id per arrival, as upstream
                yield block
    yield plan.finish()


class TextFeed:
    """Arriving text -> token ids, a sentence at a time: a sentence is normalised and tokenised once it
    is complete (terminal punctuation then a space) or flushed, so the ids do not depend on how the
    text was cut into deltas."""

    def __init__(self, frontend) -> None:
        self.frontend, self.buf, self.n_chars = frontend, "", 0
        self.texts: list[str] = []  # each sentence's normalised text, one per ids list given out (word timings)

    def add(self, delta: str) -> list[list[int]]:
        self.buf += delta
        self.n_chars += len(delta)
        out = []
        while m := _END.search(self.buf):
            out.append(self._ids(self.buf[:m.end()]))
            self.buf = self.buf[m.end():]
        return [o for o in out if o]

    def flush(self) -> list[list[int]]:
        ids, self.buf = self._ids(self.buf), ""
        return [ids] if ids else []

    def _ids(self, sentence: str) -> list[int]:
        if not sentence.strip():
            return []
        text = self.frontend.normalize_prompt_text(sentence.strip())  # the official normaliser, split=False
        ids = self.frontend.text_ids(text).tolist()
        if ids:
            self.texts.append(text)
        return ids
