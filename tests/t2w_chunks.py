"""One token->wave chunk through the functions the serving pipeline runs, for tests of one stream alone.

`Synthesizer._run_t2w` (app/engine/pipeline.py) builds the chunk's flow job (an `IncrementalItem` for an
incremental streaming hop, else `Token2WavStream.flow_item`), the scheduler calls its `flow_fn`
(`flow_batch`) and then the job's `ChunkFinish`, i.e. `Token2WavStream.finish` (HiFT, cross-fade, advance).
"""

from __future__ import annotations

from torch import Tensor

from app.model.flow_calls import IncrementalItem, flow_batch
from app.model.token2wav import ChunkPlan, Token2WavStream


def run_chunk(s: Token2WavStream, tokens: Tensor, plan: ChunkPlan) -> Tensor:
    """Flow + HiFT of `plan` on `tokens` [1, N >= plan.n_tokens]; returns [samples] float32 at 24 kHz."""
    if s.incremental and plan.streaming:  # as _run_t2w with room in the flow budget
        item = IncrementalItem(lambda: s.flow_state, tokens[:, : plan.n_tokens], plan.finalize, plan.token_offset)
    else:
        item = s.flow_item(tokens, plan)
    mel = flow_batch(s.flow, [item])[0]
    if isinstance(mel, ValueError):  # a refused incremental hop (the scheduler fails its job with it)
        raise mel
    return s.finish(mel, plan)
