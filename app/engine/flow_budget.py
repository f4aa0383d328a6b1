"""The memory all streams' incremental flow states may hold together (`engine.flow_state_gib`).

Before each incremental hop a stream asks with the bytes its state may hold after it
(app/model/flow/incremental.py `bytes_after`) and counts for that much until `update`; a stream
refused once re-solves from then on (app/engine/pipeline.py). Thread-safe (loop asks, workers update).
"""

from __future__ import annotations

import threading


class FlowBudget:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._held: dict[int, int] = {}  # id(stream) -> bytes its state holds (or was admitted to hold)
        self._lock = threading.Lock()
        self.refused = 0  # streams that fell back to the re-solve

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(self._held.values())

    def admit(self, stream: object, need_bytes: int) -> bool:
        """May `stream` run a hop after which its state holds at most `need_bytes`?"""
        with self._lock:
            others = sum(v for k, v in self._held.items() if k != id(stream))
            ok = others + need_bytes <= self.max_bytes
            if ok:
                self._held[id(stream)] = need_bytes
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
