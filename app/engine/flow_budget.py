"""The memory all streams' incremental flow states may hold together (the paged pool's size, `pool_bytes`).
Design notes: docs/design.md."""

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


# The paged state pool's size (blocks of one 50-frame chunk x 10 Euler evaluations x 2 CFG rows x 56
# layers x K/V x 512 values: 229 MB fp32 / 115 MB fp16 on CosyVoice2-0.5B; app/model/flow/incremental/paged.py).
# - FLOOR_BLOCKS: one 250-token (10 s) stream with its voice's prompt: 238 prompt + 500 new frames = 15
#   chunks, rounded up to 16 blocks = 3.7 GB fp32 / 1.8 GB fp16, so one stream fits whatever the fraction.
# - HEADROOM_BYTES stay free whatever the floor asks: the flow's activations (a batched exact final's
#   re-solve) and the paged graphs' memory pool are allocated after the pool.
# - H200 (139 GiB): the model, vLLM's share (weights + 2 GiB KV) and the HiFT graphs leave ~110-120 GiB;
#   0.7 of that is ~80 GiB = ~350 blocks fp32 (~40 streams of 250 tokens: 8 own blocks each beside the
#   voice's shared 4) / ~700 blocks fp16 (~80 streams). Streams past it re-solve.
# - A small card (8 GB): what is left after the rest is ~1-3 GB, so the pool is the floor if it fits
#   beside HEADROOM_BYTES (fp16: 1.8 GB), else what does; flow_state_max_gib caps it on a shared card.
FLOOR_BLOCKS = 16
HEADROOM_BYTES = 1 << 30


def pool_bytes(*, fraction: float, max_gib: float, cpu_gib: float, block_bytes: int,
               free_bytes: int | None) -> int:
    """Bytes of the incremental flow's state pool. CUDA (`free_bytes`: device memory free after warm-up):
    `fraction` of it, at least FLOOR_BLOCKS blocks while HEADROOM_BYTES stay free, at most `max_gib` (> 0).
    No device memory to measure (`free_bytes` None, the CPU): `cpu_gib`."""
    if free_bytes is None:
        return int(cpu_gib * 2**30)
    n = max(int(fraction * free_bytes), min(FLOOR_BLOCKS * block_bytes, free_bytes - HEADROOM_BYTES))
    if max_gib > 0:
        n = min(n, int(max_gib * 2**30))
    return max(0, n)
