"""Repetition-aware sampling (RAS) for a batch of rows at once, as log-probabilities: pure torch.

Design notes: docs/model.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

EXTRA_ARGS_KEY = "cosyvoice_ras"
NEG_INF = float("-inf")


@dataclass(frozen=True)
class RASParams:
    """Per-request RAS settings (`extra_args["cosyvoice_ras"]`); defaults are the official yaml's."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    min_tokens: int = 0  # eos is banned while fewer output tokens exist (official min_len)
    eos: int = 6561
    n_valid: int = 6564  # ids >= n_valid are padding rows of the exported lm_head
    # outputs made before this request (incl. fills) that start its repetition window (bi-streaming
    # re-submits each block: the official window spans them); only the last win_size count
    history: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"cosyvoice_ras.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 1 or self.win_size < 1 or self.tau_r <= 0.0:
            raise ValueError(f"cosyvoice_ras needs top_k >= 1, win_size >= 1, tau_r > 0; got {self}")
        if self.min_tokens < 0 or not 0 <= self.eos < self.n_valid:
            raise ValueError(f"cosyvoice_ras needs min_tokens >= 0 and 0 <= eos < n_valid; got {self}")
        if not all(0 <= t < self.n_valid for t in self.history):
            raise ValueError(f"cosyvoice_ras.history needs ids in [0, {self.n_valid}), got {self.history[:8]}...")

    @property
    def min_count(self) -> int:
        """Smallest integer count c with c >= win_size * tau_r (the official repeat test)."""
        return max(0, math.ceil(self.win_size * self.tau_r))

    @classmethod
    def from_extra_args(cls, extra_args: Mapping[str, Any] | None) -> RASParams | None:
        """The request's settings, or None when it does not ask for RAS."""
        if not extra_args or EXTRA_ARGS_KEY not in extra_args:
            return None
        raw = extra_args[EXTRA_ARGS_KEY]
        if not isinstance(raw, Mapping):
            raise ValueError(f"extra_args[{EXTRA_ARGS_KEY!r}] must be a dict, got {type(raw).__name__}")
        known = {f.name: f.type for f in fields(cls)}
        if unknown := set(raw) - set(known):
            raise ValueError(f"unknown {EXTRA_ARGS_KEY} keys {sorted(unknown)}; known: {sorted(known)}")
        kw: dict[str, Any] = {}
        for key, value in raw.items():
            if key == "history":
                if not isinstance(value, Sequence) or isinstance(value, str) or not all(
                        isinstance(t, int) and not isinstance(t, bool) for t in value):
                    raise ValueError(f"{EXTRA_ARGS_KEY}.history must be a list of token ids, got {value!r:.60}")
                kw[key] = tuple(value)
                continue
            want_int = known[key] == "int"
            if isinstance(value, bool) or not isinstance(value, int | float) or (want_int and value != int(value)):
                raise ValueError(f"{EXTRA_ARGS_KEY}.{key} must be {'an integer' if want_int else 'a number'}, "
                                 f"got {value!r}")
            kw[key] = int(value) if want_int else float(value)
        return cls(**kw)


@dataclass(frozen=True)
class RASBatch:
    """Settings of R rows as device tensors (rebuilt only when the batch changes)."""

    top_p: Tensor  # [R, 1] float32 (the official compares a float32 running sum with top_p)
    rank_ok: Tensor  # [R, k_max] bool: rank < the row's top_k
    min_count: Tensor  # [R, 1] long
    eos: Tensor  # [R, 1] long
    n_valid: Tensor | None  # [R, 1] long; None when every row has n_valid == n_cols
    win_size: tuple[int, ...]
    min_tokens: tuple[int, ...]
    before: tuple[tuple[int, ...], ...]  # each row's last win_size history ids (RASParams.history)
    n_cols: int  # max n_valid: the columns that take part
    k_max: int  # max top_k (capped at n_cols)
    w_max: int  # max win_size
    pin: bool  # stage host->device copies in pinned memory
    tie_break: Tensor  # [n_cols] float64, see `_stable_top`

    @classmethod
    def build(cls, params: Sequence[RASParams], device: torch.device | str = "cpu", pin: bool = False) -> RASBatch:
        device = torch.device(device)
        pin = pin and device.type == "cuda"

        def col(values: list, dtype: torch.dtype) -> Tensor:
            t = torch.tensor(values, dtype=dtype, pin_memory=pin)
            return t.to(device, non_blocking=True).reshape(len(params), -1)

        n_cols = max(p.n_valid for p in params)
        k_max = min(max(p.top_k for p in params), n_cols)
        return cls(top_p=col([p.top_p for p in params], torch.float32),
                   rank_ok=col([[i < p.top_k for i in range(k_max)] for p in params], torch.bool),
                   min_count=col([p.min_count for p in params], torch.long),
                   eos=col([p.eos for p in params], torch.long),
                   n_valid=None if all(p.n_valid == n_cols for p in params)
                   else col([p.n_valid for p in params], torch.long),
                   win_size=tuple(p.win_size for p in params), min_tokens=tuple(p.min_tokens for p in params),
                   before=tuple(p.history[-p.win_size:] for p in params),
                   n_cols=n_cols, k_max=k_max, w_max=max(p.win_size for p in params), pin=pin,
                   tie_break=tie_break_scale(n_cols, device))

    def history(self, outputs: Sequence[Sequence[int]], device: torch.device | str) -> tuple[Tensor, Tensor]:
        """(last win_size tokens of history + outputs `[R, w_max]` left-padded with -1, eos-ban flags
        `[R, 1]` bool: fewer than min_tokens outputs, history not counted).

        One host->device copy: column w_max carries the ban flag.
        """
        rows = []
        for out, w, m, before in zip(outputs, self.win_size, self.min_tokens, self.before, strict=True):
            n = len(out)
            while n and out[n - 1] < 0:  # async-scheduling placeholders not yet filled in
                n -= 1
            tail = list(out[max(0, n - w):n])
            if len(tail) < w and before:  # the window reaches back into the history
                tail = (list(before) + tail)[-w:]
            rows.append([-1] * (self.w_max - len(tail)) + tail + [int(n < m)])
        both = torch.tensor(rows, dtype=torch.long, pin_memory=self.pin).to(device, non_blocking=True)
        return both[:, :-1], both[:, -1:].bool()


def tie_break_scale(n_cols: int, device: torch.device | str = "cpu") -> Tensor:
    """`[C]` float64 factors 1 - id * 2^-(25 + bits): see `_stable_top`."""
    eps = 2.0 ** -(25 + max(1, (n_cols - 1).bit_length()))
    return 1.0 - torch.arange(n_cols, dtype=torch.float64, device=device) * eps


def _stable_top(p: Tensor, k: int, scale: Tensor) -> tuple[Tensor, Tensor]:
    """The first k of a stable descending sort of `p [R, C] >= 0`: (values, ids) `[R, k]`.

    topk of p * (1 - id * eps) in float64 without sorting all C columns: distinct float32 values
    differ by >= 2^-24 relative and the factor moves them by < 2^-25, so their order stays; equal
    values end up ordered by id, lowest first, as a stable sort leaves them (float64 resolves the
    eps steps exactly). Zero probabilities may come in any order; they carry no mass.
    """
    ids_top = (p.double() * scale).topk(k, dim=-1).indices
    return p.gather(1, ids_top), ids_top


def _running_sum_before(p_top: Tensor) -> Tensor:
    """`[R, k]` float32 sums of the items before each rank, as the official loop adds them.

    On CPU the same float32 adds in the same order (bit-identical to the reference); elsewhere one
    cumsum, whose rounding may differ by a few ulp (moves the cut only for a sum within ~1e-7 of top_p).
    """
    if p_top.device.type == "cpu":
        before = torch.zeros_like(p_top)
        running = before[:, 0]
        for i in range(1, p_top.shape[1]):
            running = running + p_top[:, i - 1]
            before[:, i] = running
        return before
    return torch.nn.functional.pad(p_top[:, :-1].cumsum(dim=-1), (1, 0))


def ras_log_probs(logits: Tensor, batch: RASBatch, history: Tensor, ban_eos: Tensor,
                  compute_dtype: torch.dtype = torch.float32) -> Tensor:
    """log P of the official RAS draw for each row: `[R, V]` logits -> `[R, V]` (-inf where P = 0).

    `history [R, W]` holds each row's last output tokens (-1 = none), `ban_eos [R, 1]` whether eos
    is masked. Probabilities are float32 like the official sampler's; the mixture is formed in
    `compute_dtype` (float32 on the engine, float64 for exact comparisons). About 40 tensor ops,
    none per token id, no host sync.
    """
    n_rows, vocab = logits.shape
    n_cols = min(batch.n_cols, vocab)
    x = logits[:, :n_cols].float()
    if batch.n_valid is not None:  # rows with fewer valid ids than others
        x = x.masked_fill(torch.arange(n_cols, device=x.device) >= batch.n_valid, NEG_INF)
    x = x.scatter(1, batch.eos, x.gather(1, batch.eos).masked_fill(ban_eos, NEG_INF))
    p = x.softmax(dim=-1)  # [R, C] float32, as the official sampler computes it

    # nucleus: rank i is kept while the running sum before it is < top_p, and i < top_k
    k = min(batch.k_max, n_cols)
    p_top, ids_top = _stable_top(p, k, batch.tie_break[:n_cols])  # [R, k]
    kept = (_running_sum_before(p_top) < batch.top_p) & batch.rank_ok[:, :k]
    # a kept id is repeated if it occurs >= win_size * tau_r times in the window
    counts = (history[:, None, :] == ids_top[:, :, None]).sum(dim=-1)  # [R, k]
    repeated = kept & (counts >= batch.min_count)

    pd, top = p.to(compute_dtype), p_top.to(compute_dtype)
    kept_p = top * kept
    q = kept_p / kept_p.sum(dim=-1, keepdim=True)  # first draw [R, k]
    rest = pd.sum(dim=-1, keepdim=True) - top  # mass left once x is removed [R, k]
    # if every other probability underflowed, "draw again without x" is undefined: keep x
    repeated = repeated & (rest > 0)
    w = torch.where(repeated, q / rest, 0.0)  # weight of "redraw without x" [R, k]
    c = w.sum(dim=-1, keepdim=True)  # P(y) = c p_y for every id outside the corrections below
    out = c.log() + pd.log()  # [R, C]; -inf everywhere for rows without redraws
    fixed = c * top + torch.where(repeated, -w * top, q)  # P at the top-k ids [R, k]
    out = out.scatter(1, ids_top, fixed.clamp_min(0.0).log())
    if n_cols < vocab:
        out = torch.cat([out, out.new_full((n_rows, vocab - n_cols), NEG_INF)], dim=1)
    return out
