"""Stop for the standard (Gradio) player: a per-session signal, and a chunk stream that ends on it.
Design notes: docs/design.md."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


class StopSignal:
    """One per browser session (`gr.State(StopSignal())`: Gradio deep-copies it for each session).

    The Stop button sets it (`Handlers.stop`, no queue, on the event loop: asyncio.Event is not
    thread-safe, so both handlers are coroutines); Generate clears it before the request joins the
    queue (`Handlers.begin`), so a Stop while the request waits there ends it as soon as it starts.
    """

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __deepcopy__(self, memo: dict) -> StopSignal:  # gr.State deep-copies its value: a fresh signal
        return StopSignal()

    @property
    def stopped(self) -> bool:
        return self.event.is_set()


async def until_stopped(items: AsyncIterator[T], stop: StopSignal) -> AsyncIterator[T]:
    """The items of `items` until `stop` is set (also while waiting for the next one: that wait is
    cancelled, which closes `items` and runs its `finally`, e.g. the vLLM abort)."""
    stopped = asyncio.ensure_future(stop.event.wait())
    nxt: asyncio.Future | None = None
    try:
        while not stop.stopped:
            nxt = asyncio.ensure_future(anext(items))
            await asyncio.wait({nxt, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                return  # stopped while waiting: `finally` cancels the wait
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            nxt = None
            yield item
    finally:
        stopped.cancel()
        if nxt is not None and not nxt.done():  # also when this task itself is cancelled (client gone)
            nxt.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await nxt
