"""The memory all streams' incremental flow states may hold together (`engine.flow_state_gib`).

A stream asks before each incremental hop with what its state holds now; the hop may at most double
that (the state's buffers grow by doubling), so it is admitted only if the total stays within the
budget after such a doubling. A stream refused once drops its state and re-solves from then on: the
same mel, at the re-solve's cost (app/model/token2wav.py). Thread-safe: token->wave workers ask.
"""

from __future__ import annotations

import threading


class FlowBudget:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._held: dict[int, int] = {}  # id(stream) -> bytes its state holds
        self._lock = threading.Lock()
        self.refused = 0  # streams that fell back to the re-solve

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(self._held.values())

    def admit(self, stream: object, now_bytes: int, first_bytes: int) -> bool:
        """May `stream` (holding `now_bytes`; a first hop needs about `first_bytes`) run its next hop?"""
        with self._lock:
            others = sum(v for k, v in self._held.items() if k != id(stream))
            ok = others + max(2 * now_bytes, first_bytes) <= self.max_bytes
            if ok:
                self._held[id(stream)] = now_bytes
            else:
                self._held.pop(id(stream), None)
                self.refused += 1
            return ok

    def update(self, stream: object, now_bytes: int) -> None:
        with self._lock:
            if id(stream) in self._held:
                self._held[id(stream)] = now_bytes

    def release(self, stream: object) -> None:
        with self._lock:
            self._held.pop(id(stream), None)
