"""Repetition-aware sampling (RAS, VALL-E 2) exactly as the official CosyVoice2 decoder draws.

Design notes: docs/model.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

# sampler(logp [V], decoded tokens so far, generator) -> token id
Sampler = Callable[[Tensor, Sequence[int], torch.Generator], int]


def _nucleus(probs: Tensor, top_p: float, top_k: int) -> tuple[Tensor, Tensor]:
    """Kept probabilities and ids `[n]` of the official top-p/top-k loop over `probs [V]`."""
    if top_p <= 0 or top_k < 1:
        raise ValueError(f"need top_p > 0 and top_k >= 1, got top_p={top_p}, top_k={top_k}")
    sorted_p, sorted_ids = probs.sort(descending=True, stable=True)
    limit = min(top_k, sorted_p.numel())
    cum = torch.zeros((), dtype=sorted_p.dtype, device=sorted_p.device)
    n = 0
    # float32 running sum compared with top_p after each add, like the official Python loop
    # (torch.cumsum may accumulate in double on CPU, which could move the cut by one item)
    while n < limit and bool(cum < top_p):
        cum = cum + sorted_p[n]
        n += 1
    return sorted_p[:n], sorted_ids[:n]


def _is_repeat(token: int, decoded: Sequence[int], win_size: int, tau_r: float) -> bool:
    window = list(decoded)[-win_size:]  # Python slicing, as upstream (win_size 0 = whole list)
    return window.count(token) >= win_size * tau_r


def ras_sample(logp: Tensor, decoded: Sequence[int], generator: torch.Generator, *,
               top_p: float = 0.8, top_k: int = 25, win_size: int = 10, tau_r: float = 0.1) -> int:
    """Draw one token id from `logp [V]` (log-probabilities, -inf = banned) like the official RAS.

    `decoded` is the list of tokens emitted so far (the repetition window is its tail). The
    generator's device decides where the draws happen (CPU for the parity goldens).
    """
    scores = logp.detach().to(device=generator.device, dtype=torch.float32).clone()
    kept_p, kept_ids = _nucleus(scores.softmax(dim=0), top_p, top_k)
    token = int(kept_ids[kept_p.multinomial(1, replacement=True, generator=generator)])
    if _is_repeat(token, decoded, win_size, tau_r):
        scores[token] = -float("inf")
        token = int(scores.softmax(dim=0).multinomial(1, replacement=True, generator=generator))
    return token


def ras_distribution(logp: Tensor, decoded: Sequence[int], *, top_p: float = 0.8, top_k: int = 25,
                     win_size: int = 10, tau_r: float = 0.1) -> Tensor:
    """Exact output distribution `[V]` (float64) of one `ras_sample` call.

    With p = softmax(logp), K the kept nucleus and q_x = p_x / sum_K p the first draw:
        P(y) = q_y [y in K, y not repeated]
             + sum_{x in K, x repeated} q_x * p_y / (1 - p_x) * [y != x]
    (a repeated first draw is replaced by a draw from the full softmax with x removed).
    """
    probs = logp.detach().float().cpu().softmax(dim=0)  # the float32 values the sampler sees
    kept_p, kept_ids = _nucleus(probs, top_p, top_k)
    p = probs.double()
    q = kept_p.double() / kept_p.double().sum()
    out = torch.zeros_like(p)
    for qx, x in zip(q.tolist(), kept_ids.tolist(), strict=True):
        if _is_repeat(x, decoded, win_size, tau_r):
            rest = p.clone()
            rest[x] = 0.0
            out += qx * rest / rest.sum()
        else:
            out[x] += qx
    return out
