"""Deadline-aware token->wave calls (app/engine/call_sizing.py), on a fake clock and a fake cost: a call ends
before the most urgent of its hops is due, first chunks ride in small calls ahead of the rest, and no call
holds the worker past the cap a first chunk may wait behind."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import pytest

from app.engine.call_sizing import CallBudget, CallCost, size_call
from app.engine.t2w_scheduler import Token2WavScheduler

OVERHEAD_S, PER_FRAME_S = 0.02, 0.001  # the fake GPU: 20 ms a call + 1 ms a mel frame


def learned(overhead_s: float = OVERHEAD_S, per_frame_s: float = PER_FRAME_S) -> CallCost:
    cost = CallCost()
    for frames in (50, 200, 800, 100):
        cost.observe(frames, overhead_s + per_frame_s * frames)
    return cost


class FixedCost(CallCost):
    """The fake GPU's cost, whatever the (instant) fake calls take."""

    def __init__(self) -> None:
        super().__init__()
        for frames in (50, 800):
            super().observe(frames, OVERHEAD_S + PER_FRAME_S * frames)

    def observe(self, frames: int, seconds: float) -> None:
        pass


@dataclass
class Job:
    name: str
    deadline: float
    frames: int = 50
    first: bool = False


def test_the_cost_is_learned_from_the_calls_run():
    cost = CallCost()
    assert cost.predict(100) is None  # nothing seen: calls are not sized
    cost.observe(100, 0.12)
    cost.observe(100, 0.12)
    assert cost.predict(100) is None  # one size says nothing of the slope
    cost = learned()
    assert cost.predict(300) == pytest.approx(OVERHEAD_S + 300 * PER_FRAME_S)
    for _ in range(100):  # the GPU got busier: recent calls outweigh old ones
        cost.observe(400, 2 * (OVERHEAD_S + PER_FRAME_S * 400))
        cost.observe(100, 2 * (OVERHEAD_S + PER_FRAME_S * 100))
    assert cost.predict(300) == pytest.approx(2 * (OVERHEAD_S + 300 * PER_FRAME_S), rel=1e-3)


def test_a_first_chunk_rides_in_a_small_call():
    """At t = 10 s a first chunk (50 frames, 70 ms alone) waits with 20 hops whose streams have 2 s of audio
    left: its call takes what ends within first_call_s (150 ms: one more hop of 50 frames), not all 21."""
    budget, now = CallBudget(first_call_s=0.15, max_call_s=0.4), 10.0
    head = Job("first", deadline=9.7, first=True)
    hops = [Job(f"hop{i}", deadline=12.0 + i / 100) for i in range(20)]
    taken = size_call(head, hops, now, learned(), budget, max_rows=64)
    assert [j.name for j in taken] == ["hop0"]  # 0.02 + 0.001 * 100 = 0.12 s; a second hop: 0.17 > 0.15
    # nothing learned yet (the first calls after start): every mate joins, up to the row cap
    assert len(size_call(head, hops, now, CallCost(), budget, max_rows=8)) == 7
    # sizing off (a CPU): every mate joins
    assert len(size_call(head, hops, now, learned(), CallBudget(0, 0), max_rows=64)) == 20


def test_a_call_ends_before_its_most_urgent_hop_is_due():
    budget, now = CallBudget(first_call_s=0.15, max_call_s=0.4), 10.0
    soon = Job("soon", deadline=10.125)  # 125 ms of audio left
    later = [Job(f"later{i}", deadline=11.0 + i) for i in range(10)]
    assert [j.name for j in size_call(soon, later, now, learned(), budget, 64)] == ["later0"]  # 0.12 s: 2 hops
    # already late (a stream that ran dry): throughput, up to the cap (0.02 + 0.001 * 350 = 0.37 <= 0.4)
    late = Job("late", deadline=9.0)
    assert len(size_call(late, later, now, learned(), budget, 64)) == 6
    # a big hop that cannot fit beside the head is skipped; the smaller ones after it still join
    mates = [Job("huge", 11.0, frames=1000), Job("small", 11.5, frames=50)]
    assert [j.name for j in size_call(late, mates, now, learned(), budget, 64)] == ["small"]


def test_the_scheduler_runs_first_chunks_first_in_calls_sized_by_deadline():
    """Queued behind a blocked worker on a fake clock (t = 100 s): 12 later hops of streams with 5 s buffered
    and two first chunks. The first chunks run first, together, in a call of at most first_call_s; the hops
    follow in calls that stay under max_call_s; every job's result comes back to its caller."""
    calls: list[list[str]] = []

    class Item:
        batch_key = "incremental"

        def __init__(self, name: str, frames: int) -> None:
            self.name, self.work_frames = name, frames

    def flow_fn(items: list[Item]) -> list[str]:
        calls.append([it.name for it in items])
        return [it.name for it in items]

    async def main() -> list[str]:
        s = Token2WavScheduler(1, flow_fn=flow_fn, max_batch=64, budget=CallBudget(0.15, 0.4), clock=lambda: 100.0)
        s.cost = FixedCost()
        gate = threading.Event()
        blocker = asyncio.ensure_future(s.run(gate.wait, deadline=float("-inf")))
        while s.queued():
            await asyncio.sleep(0.01)
        jobs = [asyncio.ensure_future(s.run_flow(Item(f"hop{i}", 100), lambda out, _s: out, deadline=105.0 + i / 10))
                for i in range(12)]
        jobs += [asyncio.ensure_future(s.run_flow(Item(name, 50), lambda out, _s: out, deadline=t0, first=True))
                 for name, t0 in (("first-a", 99.6), ("first-b", 99.8))]
        while s.queued() < 14:
            await asyncio.sleep(0.01)
        gate.set()
        out = await asyncio.gather(*jobs)
        await blocker
        s.shutdown()
        return out

    out = asyncio.run(main())
    assert out == [f"hop{i}" for i in range(12)] + ["first-a", "first-b"]
    # the first chunks (0.02 + 0.1 s) together; a hop would push their call to 0.22 s > 0.15
    assert calls[0] == ["first-a", "first-b"]
    # then the hops, earliest first, each call within 0.4 s: 3 hops = 0.32 s, a 4th would be 0.42 s
    assert calls[1:] == [[f"hop{i}" for i in range(k, k + 3)] for k in range(0, 12, 3)]
