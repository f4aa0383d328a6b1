"""Per-client fair share of the running syntheses: at most `[server] max_streams_per_client` at once.
Design notes: docs/design.md."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

from app.service.metrics import Metrics

RETRY_AFTER_S = 5  # a synthesis of this client's usually ends within seconds


class ShareError(RuntimeError):
    """The client already runs its share of syntheses."""

    retry_after_s = RETRY_AFTER_S


class FairShare:
    def __init__(self, max_streams: int, metrics: Metrics) -> None:
        self.max_streams, self.metrics = max_streams, metrics
        self._running: Counter[str] = Counter()

    @contextlib.contextmanager
    def hold(self, client: str) -> Iterator[None]:
        """One of `client`'s places for the block; `ShareError` when all are taken (0 = no limit)."""
        if self.max_streams and client and self._running[client] >= self.max_streams:
            self.metrics.share_refused("client_streams")
            raise ShareError(f"you already run {self.max_streams} syntheses at once (the share of one client); "
                             "wait for one to finish, then try again")
        self._running[client] += 1
        try:
            yield
        finally:
            self._running[client] -= 1
            if not self._running[client]:
                del self._running[client]
