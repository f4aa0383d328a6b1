"""The flow's calls for many streams at once: one row per stream (a re-solve of prompt + tokens), or one
incremental hop per stream from its own state; the rows of one call share its masks.

Design notes: docs/model.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from app.audio import MEL_FRAMES_PER_TOKEN
from app.model.flow.incremental.batch import incremental_batch
from app.model.flow.incremental.state import FlowState


@dataclass(frozen=True)
class FlowPrompt:
    """The voice as the flow sees it (mel frames == 2 x tokens, aligned by the frontend)."""

    tokens: Tensor  # [1, P] int32/int64 speech tokens of the prompt
    mel: Tensor  # [1, 2P, 80] float32 log-mel of the 24 kHz prompt
    embedding: Tensor  # [1, 192] float32 CAM++ x-vector


@dataclass(frozen=True)
class FlowItem:
    """One request's flow call: what `flow_batch` needs (and the plan's cut)."""

    tokens: Tensor  # [1, n] generated tokens of the chunk's prefix (any device: moved to the flow's)
    prompt: FlowPrompt
    streaming: bool
    finalize: bool
    token_offset: int  # mel is kept from this token on

    @property
    def batch_key(self) -> tuple[bool, bool]:
        """Calls can share a batch only with the same attention masks and look-ahead rule."""
        return self.streaming, self.finalize

    @property
    def work_frames(self) -> int:
        """Mel frames the call computes for this row: the prompt's and every token's (a re-solve)."""
        return (self.prompt.mel.shape[1] + self.tokens.shape[1] * MEL_FRAMES_PER_TOKEN)


@dataclass(frozen=True)
class IncrementalItem:
    """One stream's streaming hop through the incremental flow, for `flow_batch`: hops of any
    streams share a call (one batch key), each from its own state."""

    state: Callable[[], FlowState]  # the stream's state, made on first use (on the worker thread)
    tokens: Tensor  # [1, n] generated tokens of the hop's prefix
    finalize: bool  # a chunk-causal final call
    token_offset: int  # mel is kept from this token on
    batch_key: ClassVar[str] = "incremental"

    @property
    def work_frames(self) -> int:
        """Mel frames the hop computes: its new tokens' (the prefix's are in its state)."""
        return (self.tokens.shape[1] - self.token_offset) * MEL_FRAMES_PER_TOKEN


@torch.inference_mode()
def flow_batch(flow, items: list[FlowItem] | list[IncrementalItem], graphs=None,
               paged_graphs=None, work=None) -> list[Tensor | ValueError]:
    """New mel frames [1, 80, T_i] (float32) for each item, computed in one batched flow call.

    Rows are right-padded to the longest (prompt + tokens); every mask in the encoder and the
    estimator marks the padding, so a row's frames equal its batch-1 result up to float rounding
    (tests/test_token2wav.py). One item runs the batch-1 path (`flow.inference`) unchanged.
    `graphs`: an `EstimatorGraphs` for the ODE solve (app/model/flow/graphs.py), or None (eager);
    a batch's rows are padded to a power of two there, so 5 row counts cover a batch of 16.
    `IncrementalItem`s (all of them, or none) run `incremental_batch` (app/model/flow/incremental/batch.py, eager):
    an item whose call is refused gets its ValueError as its output, the others still run
    (`paged_graphs`: the pooled states' captured solves, app/model/flow/incremental/paged_graphs.py).
    `work`: a `FlowWork` (app/model/flow/work.py) told each solve's computed shape.
    """
    if isinstance(items[0], IncrementalItem):
        if not all(isinstance(it, IncrementalItem) for it in items):
            raise ValueError("flow_batch cannot mix incremental hops and re-solve calls")
        return incremental_batch(flow, [it.state() for it in items], [it.tokens for it in items],
                                 finalize=[it.finalize for it in items],
                                 token_offsets=[it.token_offset for it in items], graphs=paged_graphs, work=work)
    device = items[0].prompt.tokens.device  # the flow's (FlowPrompt lives there); tokens may come from the CPU
    if len(items) == 1:
        it = items[0]
        mel = flow.inference(it.tokens.to(device), it.prompt.tokens, it.prompt.mel, it.prompt.embedding,
                             streaming=it.streaming, finalize=it.finalize, graphs=graphs)
        if work is not None:  # the prompt's frames and the new ones, one row (dense attention over them)
            T = it.prompt.mel.shape[1] + mel.shape[2]
            T_pad = graphs.padded_length(T) if graphs is not None else T
            work.add(1, T_pad, T_pad, T)
        return [mel[:, :, it.token_offset * MEL_FRAMES_PER_TOKEN:].float()]
    if len({it.batch_key for it in items}) != 1:
        raise ValueError("flow_batch needs items with the same (streaming, finalize)")
    streaming, finalize = items[0].batch_key
    rows = [torch.cat([it.prompt.tokens.to(device), it.tokens.to(device)], dim=1)[0].long() for it in items]
    lengths = torch.tensor([r.shape[0] for r in rows], device=device)
    tokens = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # [B, L_max], 0-padded
    spks = flow.speaker_embedding(torch.cat([it.prompt.embedding.to(device) for it in items]))  # [B, 80]
    h, frames = flow.encode(tokens, lengths, streaming=streaming, finalize=finalize)
    mu = flow.encoder_proj(h).transpose(1, 2)  # [B, 80, T_max]
    T = mu.shape[2]
    cond = torch.zeros_like(mu)
    n_prompt = []
    for i, it in enumerate(items):
        n = it.prompt.mel.shape[1]
        if n > int(frames[i]):
            raise ValueError(f"prompt mel has {n} frames but the tokens give only {int(frames[i])}")
        cond[i, :, :n] = it.prompt.mel[0].to(device=device, dtype=mu.dtype).T
        n_prompt.append(n)
    mask = (torch.arange(T, device=device)[None] < frames[:, None]).to(mu.dtype)[:, None]  # [B, 1, T]
    x = flow.solve(mu, mask, spks, cond, streaming, graphs)
    if work is not None:  # rows padded to the graphs' row bucket, frames to the longest row (and the bucket)
        B, T_pad = len(items), graphs.padded_length(T) if graphs is not None else T
        work.add(graphs.padded_rows(B) if graphs is not None else B, T_pad, T_pad, int(frames.sum()))
    return [x[i:i + 1, :, n_prompt[i] + it.token_offset * MEL_FRAMES_PER_TOKEN:int(frames[i])].float()
            for i, it in enumerate(items)]
