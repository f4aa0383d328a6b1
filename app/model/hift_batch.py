"""HiFT for several streams' chunks at once: equal-length rows in one call, each row as it is alone.

Design notes: docs/model.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from app.model.hift import HiFTGenerator


@dataclass(frozen=True)
class HiftRow:
    """One stream's HiFT input for one chunk."""

    mel: Tensor  # [1, 80, T] float32: mel cache + new frames (speed-resampled on a final)
    cache_source: Tensor | None  # [1, 1, S <= 480 T] the previous chunk's source tail, or None
    eps: Tensor | None  # [1, 9, 480 T] float32 NSF noise from the stream's generator (None: noise off)

    @property
    def n_frames(self) -> int:
        return int(self.mel.shape[2])

    @property
    def n_cache(self) -> int:
        return 0 if self.cache_source is None else int(self.cache_source.shape[-1])


def make_row(hift: HiFTGenerator, mel: Tensor, cache_source: Tensor | None,
             generator: torch.Generator | None) -> HiftRow:
    """A row for `vocode_rows`; draws its NSF noise now (from `generator`, as `hift.inference` would)."""
    hift._check_mel(mel)
    if mel.shape[0] != 1:
        raise ValueError(f"a HiFT row is one stream's mel [1, 80, T], got {tuple(mel.shape)}")
    n = 0 if cache_source is None else cache_source.shape[-1]
    if n and (cache_source.ndim != 3 or cache_source.shape[:2] != (1, 1) or n > mel.shape[2] * hift.upsample_factor):
        raise ValueError(f"cache_source must be [1, 1, S] with S <= {mel.shape[2] * hift.upsample_factor}, "
                         f"got {tuple(cache_source.shape)}")
    eps = hift.m_source.draw_noise(1, mel.shape[2], generator, mel.device) if hift.nsf_noise else None
    return HiftRow(mel, cache_source if n else None, eps)


def length_buckets(rows: list[HiftRow]) -> list[list[int]]:
    """Indices of `rows` grouped by mel length, in order of each length's first row (rows come most
    urgent first, so the most urgent row's bucket runs first)."""
    buckets: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        buckets.setdefault(r.n_frames, []).append(i)
    return list(buckets.values())


def stack_rows(rows: list[HiftRow], n_rows: int | None = None) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """Equal-length rows -> step inputs (mel [R, 80, T], eps [R, 9, 480 T] | None, cache [R, 1, S],
    cache_len [R] int64), R = n_rows >= len(rows): extra rows copy the last one (their output is dropped)."""
    n_rows = len(rows) if n_rows is None else n_rows
    if len({r.n_frames for r in rows}) != 1:
        raise ValueError("stack_rows needs rows of one mel length (see length_buckets)")
    rows = rows + [rows[-1]] * (n_rows - len(rows))
    device = rows[0].mel.device
    mel = torch.cat([r.mel for r in rows])
    eps = torch.cat([r.eps for r in rows]) if rows[0].eps is not None else None
    width = max(r.n_cache for r in rows)
    cache = torch.zeros(n_rows, 1, width, device=device, dtype=torch.float32)
    for i, r in enumerate(rows):
        if r.cache_source is not None:
            cache[i, :, : r.n_cache] = r.cache_source[0].to(cache)
    cache_len = torch.tensor([r.n_cache for r in rows], device=device, dtype=torch.int64)
    return mel, eps, cache, cache_len


def vocode_step(hift: HiFTGenerator, mel: Tensor, eps: Tensor | None, cache: Tensor,
                cache_len: Tensor) -> tuple[Tensor, Tensor]:
    """HiFT up to the iSTFT for R equal-length rows; static shapes, no host sync (graph-capturable).

    mel [R, 80, T], eps [R, 9, 480 T] (None iff nsf_noise is off), cache [R, 1, S] (row i's first
    cache_len[i] samples overwrite its excitation head; S <= 480 T) ->
    (conv_post output [R, 18, 120 T + 1], excitation [R, 1, 480 T] with the overwrite)."""
    # f0 row by row: it feeds a phase integral (~1e5 rad), which turns the 1-ulp rounding of a batched
    # conv (measured 2.4e-4 Hz of 534) into ~3e-4 of audio; per row the excitation is the row's alone
    f0 = torch.cat([hift.f0(mel[i:i + 1]) for i in range(mel.shape[0])])  # [R, T] Hz
    s = hift.source(f0, eps=eps)  # [R, 1, 480 T]
    width = cache.shape[-1]
    if width:
        head = torch.arange(width, device=mel.device)[None, None, :] < cache_len[:, None, None]  # [R, 1, S]
        s = torch.cat([torch.where(head, cache.to(s), s[:, :, :width]), s[:, :, width:]], dim=2)
    return hift.decode_spec(mel, s), s


@torch.inference_mode()
def vocode_rows(hift: HiFTGenerator, rows: list[HiftRow], graphs=None) -> list[tuple[Tensor, Tensor]]:
    """HiFT of equal-length rows in one call: per row (waveform [1, 480 T], excitation [1, 1, 480 T]),
    what `hift.inference(row.mel, row.cache_source)` gives with the row's noise, up to float rounding.

    `graphs`: a `HiftGraphs` (CUDA; rows padded to a power of two) or None (eager, rows as given)."""
    if graphs is not None:
        spec, source = graphs(hift, rows)
    else:
        spec, source = vocode_step(hift, *stack_rows(rows))
    wav = hift.spec_to_wave(spec[: len(rows)])
    return [(wav[i:i + 1], source[i:i + 1].clone()) for i in range(len(rows))]
