"""How a take ends early: the page's Stop (the take's stream ends when it arrives), or a failure that is the
GPU's memory running out (refused, and the server keeps serving: app/service/service.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import torch

from app.engine.requests import AudioChunk


async def until_stopped(chunks: AsyncIterator[AudioChunk], stop: asyncio.Event | None
                        ) -> AsyncIterator[AudioChunk]:
    """`chunks` until `stop` is set: the page's Stop ends a take (the chunk being made cancelled, so its LM
    request is aborted) when it arrives, not when the client hangs up, which a loaded box may delay. Each chunk is
    awaited in a task of its own: leaving (Stop, a cancelled or closed consumer) cancels it, so `chunks` is
    never left running."""
    if stop is None:
        async for chunk in chunks:
            yield chunk
        return
    stopped, following = asyncio.ensure_future(stop.wait()), None
    try:
        while not stop.is_set():
            following = asyncio.ensure_future(anext(chunks))
            await asyncio.wait((following, stopped), return_when=asyncio.FIRST_COMPLETED)
            if not following.done():
                return  # Stop: `following` is cancelled below
            try:
                chunk = following.result()
            except StopAsyncIteration:
                return
            yield chunk
    finally:
        stopped.cancel()
        if following is not None and not following.done():
            following.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await following


def is_out_of_memory(e: BaseException) -> bool:
    """`torch.OutOfMemoryError`, or an error whose text (or whose cause's, e.g. vLLM's) says out of memory."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False
