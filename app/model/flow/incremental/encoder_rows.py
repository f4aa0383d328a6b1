"""The incremental encoder's keys/values in the flow state pool's blocks (app/model/flow/incremental/paged.py),
and its position tables (positions.py): what the encoder stages of all streams share. Design notes:
docs/model.md.

The token stage runs in chunks of 25 tokens, the frame stage and the estimator in chunks of 50 frames, and all
three commit the same whole chunks. So a stream's one block table addresses all three: pool block k holds
tokens k·25.. of the token stage and frames k·50.. of the frame stage beside the estimator's frames k·50..
A voice prefix's blocks are shared as they are for the estimator, and a batched pass reads and writes every
stream's keys/values with one index op per layer instead of copies per stream.
"""

from __future__ import annotations

import torch
from torch import Tensor

from app.model.flow.flow import CausalFlow
from app.model.flow.incremental.positions import stage_tables


def stage_shapes(flow: CausalFlow) -> list[tuple[int, int, int, int]]:
    """(layers, positions per block, heads, d_head) of the token and the frame stage."""
    enc, up = flow.dims.encoder, flow.encoder.up_layer.stride
    frames = flow.dims.estimator.static_chunk_size
    assert frames % up == 0, "a pool block holds whole tokens"
    H = enc.attention_heads
    return [(enc.num_blocks, frames // up, H, enc.output_size // H),
            (enc.num_up_blocks, frames, H, enc.output_size // H)]


def encoder_block_bytes(flow: CausalFlow, size: int) -> int:
    """Bytes of one block's encoder keys/values (size: bytes per element)."""
    return sum(2 * layers * rows * H * d * size for layers, rows, H, d in stage_shapes(flow))


def flat_rows(blocks: list[int], rows: int, end: int) -> Tensor:
    """Positions 0..end-1 of a stream -> their rows in a stage's [blocks·rows] axis: long [end], on the host
    (callers move index tensors to the device in one non-blocking copy: no device sync)."""
    p = torch.arange(end)
    return torch.tensor(blocks, dtype=torch.long)[p // rows] * rows + p % rows


class EncoderRows:
    """Both encoder stages' keys/values for `n_blocks` pool blocks (reserved ones included): per stage
    [2 (K, V), layers, n_blocks·rows, heads, d_head], row block·rows + offset; the pad block is zeros (never
    written). Only positions a call wrote are ever read, so the rest stays uninitialised (on the CPU,
    untouched memory is not committed)."""

    def __init__(self, flow: CausalFlow, n_blocks: int, pad_block: int, sink_block: int) -> None:
        w = next(flow.parameters())
        shapes = stage_shapes(flow)
        self.rows = tuple(rows for _, rows, _, _ in shapes)
        self.kv = tuple(w.new_empty(2, layers, n_blocks * rows, H, d) for layers, rows, H, d in shapes)
        self.block_bytes = encoder_block_bytes(flow, w.element_size())  # one block's share of `kv`
        self.pad_block = pad_block  # read by a batched pass's padded keys
        self.sink_block = sink_block  # written by a batched pass's padded positions, never read
        for kv, rows in zip(self.kv, self.rows, strict=True):
            kv[:, :, pad_block * rows : (pad_block + 1) * rows].zero_()
        self.positions = stage_tables(flow.encoder)

    @property
    def pad_rows(self) -> tuple[int, ...]:
        """A zero row of each stage's tensor (the pad block's first)."""
        return tuple(self.pad_block * rows for rows in self.rows)

    @property
    def sink_rows(self) -> tuple[int, ...]:
        """A row of each stage's tensor that padding positions write (the sink block's first)."""
        return tuple(self.sink_block * rows for rows in self.rows)

    def call_rows(self, stage: int, blocks: list[int], end: int) -> Tensor:
        """The rows of a stream's positions 0..end-1 of `stage` (its block table reserved up to them), host."""
        return flat_rows(blocks, self.rows[stage], end)

    @property
    def nbytes(self) -> int:
        return sum(kv.numel() * kv.element_size() for kv in self.kv)

    def committed(self, stage: int, blocks: list[int], length: int) -> Tensor:
        """A stream's keys/values of positions 0..length-1 of `stage` (0 tokens, 1 frames): a copy
        [2, layers, length, heads, d_head]."""
        kv = self.kv[stage]
        return kv.index_select(2, self.call_rows(stage, blocks, length).to(kv.device))
