"""The token->wave scheduler: earliest deadline first, request affinity, first chunks on the first free worker,
errors and cancellation."""

from __future__ import annotations

import asyncio
import threading

import pytest

from app.engine.t2w_scheduler import Token2WavScheduler


def test_earliest_deadline_first_and_results():
    async def main() -> list[str]:
        s = Token2WavScheduler(1)
        gate, started, order = threading.Event(), threading.Event(), []

        def hold() -> bool:
            started.set()
            return gate.wait()

        first = asyncio.ensure_future(s.run(hold, deadline=0.0))  # holds the only worker
        while not started.is_set():  # the worker runs it (queued() is 0 also before the job is queued)
            await asyncio.sleep(0.01)
        jobs = [asyncio.ensure_future(s.run(lambda n=n: order.append(n) or n, deadline=d))
                for n, d in (("later chunk", 5.0), ("first chunk", 1.0), ("middle", 3.0))]
        await asyncio.sleep(0.05)
        assert s.queued() == 3
        gate.set()
        got = await asyncio.gather(first, *jobs)
        s.shutdown()
        assert got[1:] == ["later chunk", "first chunk", "middle"]  # each caller gets its own result
        return order

    assert asyncio.run(main()) == ["first chunk", "middle", "later chunk"]


def test_affinity_errors_and_cancelled_jobs_are_skipped():
    async def main() -> None:
        s = Token2WavScheduler(2)
        names = await asyncio.gather(*(s.run(lambda: threading.current_thread().name, deadline=0, key=k)
                                       for k in (0, 1, 2, 3)))
        assert names == ["token2wav-0", "token2wav-1", "token2wav-0", "token2wav-1"]

        def boom() -> None:
            raise RuntimeError("out of memory")

        with pytest.raises(RuntimeError, match="out of memory"):
            await s.run(boom, deadline=0)
        gate, ran = threading.Event(), []
        blocker = asyncio.ensure_future(s.run(gate.wait, deadline=0, key=0))
        await asyncio.sleep(0.05)
        cancelled = asyncio.ensure_future(s.run(lambda: ran.append(1), deadline=1, key=0))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        gate.set()
        await blocker
        assert await s.run(lambda: "next", deadline=2, key=0) == "next"
        assert ran == []  # the cancelled job never ran
        s.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            await s.run(lambda: None, deadline=0)

    asyncio.run(main())


def test_a_first_chunk_runs_on_the_first_free_worker_and_its_request_stays_there():
    """Two workers, worker 0 busy: a flow job without a key (a request's first chunk: no state yet) runs on
    worker 1 at once instead of queuing behind worker 0's call, and `on_worker` pins its request there
    (`Utterance.pin`: the first worker sticks); a keyed job still waits for its own worker, and no other
    worker batches it."""
    from app.engine.requests import SynthesisRequest
    from app.engine.utterance import Utterance

    def flow_fn(items: list[_Item]) -> list[str]:
        return [threading.current_thread().name for _ in items]

    async def main() -> None:
        s = Token2WavScheduler(2, flow_fn=flow_fn, max_batch=4)
        gate, started = threading.Event(), threading.Event()

        def hold() -> bool:
            started.set()
            return gate.wait()

        blocker = asyncio.ensure_future(s.run(hold, deadline=0, key=0))  # worker 0 is busy
        while not started.is_set():
            await asyncio.sleep(0.01)
        u = Utterance(SynthesisRequest(text="x", voice=None), ["x"])
        assert u.worker is None
        ran_on = await asyncio.wait_for(s.run_flow(_Item("first", "k"), lambda out, _s: out, deadline=1.0,
                                                   key=u.worker, on_worker=u.pin), timeout=10)
        assert ran_on == "token2wav-1" and u.worker == 1
        u.pin(0)  # a later pin never moves a request
        assert u.worker == 1
        keyed = asyncio.ensure_future(s.run_flow(_Item("keyed", "k"), lambda out, _s: out, deadline=0.5, key=0))
        other = await asyncio.wait_for(s.run_flow(_Item("new", "k"), lambda out, _s: out, deadline=2.0, key=None),
                                       timeout=10)
        assert other == "token2wav-1" and not keyed.done()  # the free worker took the shared job, not the keyed
        assert s.queued() == 1
        gate.set()
        assert await keyed == "token2wav-0"
        await blocker
        s.shutdown()

    asyncio.run(main())


class _Item:
    def __init__(self, name: str, key: str) -> None:
        self.name, self.batch_key = name, key


def test_flow_jobs_waiting_together_share_one_call_most_urgent_first():
    calls: list[list[str]] = []

    def flow_fn(items: list[_Item]) -> list[str]:
        calls.append([it.name for it in items])
        return [f"mel:{it.name}" for it in items]

    async def main() -> list:
        s = Token2WavScheduler(1, flow_fn=flow_fn, max_batch=3)
        gate = threading.Event()
        blocker = asyncio.ensure_future(s.run(gate.wait, deadline=0))
        while s.queued():
            await asyncio.sleep(0.01)
        finished: list[str] = []

        def finish(out: str, flow_s: float) -> str:
            assert flow_s >= 0
            finished.append(out)
            return out.upper()

        jobs = [asyncio.ensure_future(s.run_flow(_Item(n, k), finish, deadline=d))
                for n, k, d in (("a", "stream", 4.0), ("b", "final", 1.0), ("c", "stream", 2.0),
                                ("d", "stream", 3.0), ("e", "stream", 0.5))]
        await asyncio.sleep(0.05)
        gate.set()
        results = await asyncio.gather(blocker, *jobs)
        s.shutdown()
        assert finished == ["mel:e", "mel:c", "mel:d", "mel:b", "mel:a"]  # HiFT in deadline order
        assert s.batch_sizes == {3: 1, 1: 2}
        return results[1:]

    assert asyncio.run(main()) == ["MEL:A", "MEL:B", "MEL:C", "MEL:D", "MEL:E"]
    # e (0.5) takes the two most urgent jobs of its key (c, d); then b (1.0) alone; then a
    assert calls == [["e", "c", "d"], ["b"], ["a"]]


def test_first_chunks_and_streams_about_to_run_dry_go_first():
    """Fake jobs with the deadlines real requests give (`Utterance.deadline`): a first chunk is due when
    its request started (someone waits in silence), a later chunk when the audio already sent has played
    out. Queued at t = 100 s: the stream that already ran dry goes first, then the two first chunks (the
    older request first), then the stream with 0.2 s of audio left, and last the one with 7 s buffered."""
    from app.audio import OUTPUT_SAMPLE_RATE_HZ
    from app.engine.requests import SynthesisRequest
    from app.engine.utterance import Utterance

    def utterance(name: str, t0: float, first_audio: float | None = None, audio_s: float = 0.0) -> Utterance:
        u = Utterance(SynthesisRequest(text=name, voice=None, request_id=name), [name])
        u.t0, u.first_audio, u.n_samples = t0, first_audio, int(audio_s * OUTPUT_SAMPLE_RATE_HZ)
        return u

    queued = [utterance("buffered 7 s", 95.0, 97.0, 10.0),  # plays until 107.0
              utterance("0.2 s left", 98.5, 99.0, 1.2),  # until 100.2
              utterance("first chunk, new", 99.99),
              utterance("ran dry", 94.0, 96.0, 3.5),  # until 99.5: already late
              utterance("first chunk, older", 99.9)]

    async def main() -> list[str]:
        s = Token2WavScheduler(1)
        gate, order = threading.Event(), []
        blocker = asyncio.ensure_future(s.run(gate.wait, deadline=float("-inf")))
        while s.queued():
            await asyncio.sleep(0.01)
        jobs = [asyncio.ensure_future(s.run(lambda n=u.request.text: order.append(n), deadline=u.deadline()))
                for u in queued]
        while s.queued() < len(queued):
            await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(blocker, *jobs)
        s.shutdown()
        return order

    assert asyncio.run(main()) == ["ran dry", "first chunk, older", "first chunk, new", "0.2 s left", "buffered 7 s"]
