"""How many due hops one token->wave call takes: as many as finish before the most urgent of them is due.

A listener hears a gap when a stream's next piece arrives after the audio it has already received ends
playing (its deadline, `Utterance.deadline`). One large flow call serves many streams at once but holds the
worker for its whole length: a first chunk that arrives meanwhile waits behind it, and a hop due sooner than
the call ends is late. So a call is sized by its jobs' deadlines, with the seconds a call takes learned from
the calls so far (`CallCost`):
- a first chunk allows its call `first_call_s` (someone waits in silence: small calls, first chunks first);
- a later hop allows the time left until its stream runs dry;
- a hop already late, or due later than `max_call_s`, allows `max_call_s`: the most any call may hold the
  worker, so a first chunk arriving during it waits at most that long.
The most urgent job always runs, alone if nothing fits beside it; mates join in deadline order while the
predicted call still ends within every member's allowance. Which hops go together never changes a stream's
hops (the preset's), only when they run: the same seed gives the same audio alone and under load.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class SizedJob(Protocol):
    deadline: float  # time.perf_counter() seconds its stream's audio runs out (a first chunk: its start)
    first: bool  # the request's first chunk (nobody hears anything yet)
    frames: int  # mel frames the call computes for it (its cost)


class CallCost:
    """Seconds of one call as overhead + per-frame cost, fitted by least squares over the recent calls (each
    older call weighs `forget` times less); None until two calls of different sizes were seen. Thread-safe."""

    def __init__(self, forget: float = 0.95) -> None:
        self.forget = forget
        self._s = [0.0] * 5  # weighted sums of 1, x, x^2, y, x*y (x = frames, y = seconds)
        self._sizes: set[int] = set()
        self._lock = threading.Lock()

    def observe(self, frames: int, seconds: float) -> None:
        with self._lock:
            self._s = [self.forget * v for v in self._s]
            for i, v in enumerate((1.0, frames, frames * frames, seconds, frames * seconds)):
                self._s[i] += v
            if len(self._sizes) < 2:
                self._sizes.add(frames)

    def predict(self, frames: int) -> float | None:
        with self._lock:
            if len(self._sizes) < 2:
                return None
            n, sx, sxx, sy, sxy = self._s
        det = n * sxx - sx * sx
        if det > 1e-9 * n * sxx:
            slope = (n * sxy - sx * sy) / det
            overhead = (sy - slope * sx) / n
            if slope >= 0 and overhead >= 0:
                return overhead + slope * frames
        return max(sxy / sxx, 0.0) * frames  # a line through the origin where the two-term fit is unphysical


@dataclass(frozen=True)
class CallBudget:
    """The allowances of `size_call` in seconds; 0 turns sizing off (a call takes every due mate)."""

    first_call_s: float = 0.15
    max_call_s: float = 0.4

    @property
    def on(self) -> bool:
        return self.first_call_s > 0 and self.max_call_s > 0

    def allowance(self, job: SizedJob, now: float) -> float:
        if job.first:
            return min(self.first_call_s, self.max_call_s)
        left = job.deadline - now
        return left if 0 < left < self.max_call_s else self.max_call_s


def size_call(head: SizedJob, mates: Sequence[SizedJob], now: float, cost: CallCost | None,
              budget: CallBudget, max_rows: int) -> list[SizedJob]:
    """The mates (in deadline order, `head` excluded) that join `head`'s call; at most `max_rows` - 1."""
    room = max_rows - 1
    predict = cost.predict if cost is not None and budget.on else lambda frames: None
    if predict(head.frames) is None:  # sizing off, or nothing learned yet: every mate joins
        return list(mates[:room])
    allowed, frames, taken = budget.allowance(head, now), head.frames, []
    for m in mates:
        if len(taken) == room:
            break
        limit = min(allowed, budget.allowance(m, now))
        if predict(frames + m.frames) <= limit:
            taken.append(m)
            allowed, frames = limit, frames + m.frames
    return taken
