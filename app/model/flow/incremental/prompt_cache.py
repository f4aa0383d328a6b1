"""`PromptCache`: per-voice flow prefixes (`VoicePrefix`), least recently used evicted first.

Design notes: docs/model.md.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

from torch import Tensor

from app.model.flow.flow import CausalFlow
from app.model.flow.incremental.paged import KVPool
from app.model.flow.incremental.state import VoicePrefix, build_voice_prefix

T = TypeVar("T")


@dataclass
class PromptCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class PromptCache:
    """At most `max_entries` voice prefixes and `max_bytes` of their state (an entry larger than
    `max_bytes` is built and returned but not kept)."""

    def __init__(self, *, pool: KVPool, max_bytes: int, max_entries: int = 64) -> None:
        if max_bytes < 0 or max_entries < 1:
            raise ValueError("PromptCache needs max_bytes >= 0 and max_entries >= 1")
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.pool = pool  # prefixes' estimator blocks live there (an evicted entry drops its references)
        self.stats = PromptCacheStats()
        self._entries: OrderedDict[Hashable, VoicePrefix] = OrderedDict()
        self._lock = threading.Lock()  # token2wav workers may share the cache

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(p.nbytes for p in self._entries.values())

    def get(self, key: Hashable, flow: CausalFlow, prompt_tokens: Tensor, prompt_mel: Tensor,
            embedding: Tensor) -> VoicePrefix:
        """The prefix of voice `key` (prompt_tokens [1, P], prompt_mel [1, 2P, 80], embedding
        [1, 192]), built on a miss (outside the lock: two streams of a new voice may both build). A stream
        must start from it through `start` (an eviction may release its pooled blocks once returned)."""
        return self.start(key, flow, prompt_tokens, prompt_mel, embedding, lambda entry: entry)

    def start(self, key: Hashable, flow: CausalFlow, prompt_tokens: Tensor, prompt_mel: Tensor,
              embedding: Tensor, begin: Callable[[VoicePrefix], T]) -> T:
        """`begin(prefix)` of voice `key` under the cache's lock: the stream's state takes its own block
        references there, so an eviction or `discard` racing this hit cannot give the prefix's blocks
        back to the pool first (they wait for the lock). Lock order: this cache, then the pool."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                state = entry.state
                if entry.matches(prompt_tokens.to(state.device).long(), prompt_mel.to(state.device),
                                 embedding.to(state.device)):
                    self._entries.move_to_end(key)
                    self.stats.hits += 1
                    return begin(entry)
                self._entries.pop(key).release()  # same key, another prompt: rebuild
            self.stats.misses += 1
        entry = build_voice_prefix(flow, prompt_tokens, prompt_mel, embedding, pool=self.pool)
        with self._lock:
            if entry.nbytes <= self.max_bytes:
                old = self._entries.pop(key, None)  # two streams of a new voice both built it
                if old is not None:
                    old.release()
                self._entries[key] = entry
                self._entries.move_to_end(key)
            started = begin(entry)
            self._evict()  # after `begin`: an entry evicted at once still has its stream's references
        return started

    def discard(self, key: Hashable) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
        if entry is not None:
            entry.release()

    def clear(self) -> None:
        with self._lock:
            entries, self._entries = list(self._entries.values()), OrderedDict()
        for entry in entries:
            entry.release()

    def _evict(self) -> None:
        total = sum(p.nbytes for p in self._entries.values())
        while self._entries and (len(self._entries) > self.max_entries or total > self.max_bytes):
            _, old = self._entries.popitem(last=False)
            old.release()  # pooled blocks go back once no stream started from it holds them
            total -= old.nbytes
            self.stats.evictions += 1
