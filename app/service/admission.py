"""One admission for the whole process: at most `server.concurrency_limit` syntheses at once, whatever
the door. `admit()` waits in line; with `server.queue_max_size` already waiting it raises `BusyError`
at once (counted as "rejected"). The semaphore may be made off the serving loop: asyncio binds it to the loop
that first waits on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from app.config import ServerConfig
from app.message import Message
from app.service.metrics import Metrics


class BusyError(RuntimeError):
    """Every slot is running and the waiting line is full: try again later."""


class Admission:
    def __init__(self, cfg: ServerConfig, metrics: Metrics) -> None:
        self.cfg, self.metrics = cfg, metrics
        self._slots = asyncio.Semaphore(cfg.concurrency_limit)
        self.waiting = 0  # requests waiting for a slot

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[float]:
        """Hold one slot for the block; yields the seconds it waited."""
        srv = self.cfg
        if self._slots.locked() and self.waiting >= srv.queue_max_size:
            self.metrics.request_finished(None, 0.0, "rejected")
            raise BusyError(Message("busy", "the server is busy ({running} requests running, {waiting} waiting); try "
                                    "again in a few seconds", running=srv.concurrency_limit, waiting=self.waiting))
        t0 = time.monotonic()
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        try:
            yield time.monotonic() - t0
        finally:
            self._slots.release()
