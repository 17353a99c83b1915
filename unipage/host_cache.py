"""Bookkeeping of the host tier: which adapters keep a copy in CPU memory.

A byte budget with least-recently-used replacement.  Pure Python: the
buffers themselves live in `unipage.storage.PoolStorage`; this index only
decides what is kept and what goes.
"""

from __future__ import annotations

from collections import OrderedDict


class HostCacheIndex:
    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"host cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[str, int] = OrderedDict()  # name -> bytes, oldest first
        self.hits = 0
        self.misses = 0

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        return list(self._entries)

    def lookup(self, name: str) -> bool:
        """Record a use: True (and refresh recency) if ``name`` is cached."""
        if name in self._entries:
            self._entries.move_to_end(name)
            self.hits += 1
            return True
        self.misses += 1
        return False

    def admit(self, name: str, nbytes: int) -> list[str] | None:
        """Cache ``name``; returns the names evicted to make room, or None if it can never fit."""
        if name in self._entries:
            self._entries.move_to_end(name)
            return []
        if nbytes > self.budget_bytes:
            return None
        evicted = []
        while self.used_bytes + nbytes > self.budget_bytes:
            old, size = self._entries.popitem(last=False)
            self.used_bytes -= size
            evicted.append(old)
        self._entries[name] = nbytes
        self.used_bytes += nbytes
        return evicted

    def remove(self, name: str) -> bool:
        size = self._entries.pop(name, None)
        if size is None:
            return False
        self.used_bytes -= size
        return True

    def check(self) -> None:
        assert self.used_bytes == sum(self._entries.values()) <= self.budget_bytes
