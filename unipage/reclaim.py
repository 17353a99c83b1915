"""`Reclaimer`: page allocation under pressure, through one eviction policy.

Both owners of reclaimable memory — the KV manager (cached blocks) and the
adapter manager (idle resident adapters) — offer their idle units here as
`Candidate`s.  When an allocation does not fit, the reclaimer evicts the
lowest-priority candidates of *either* kind until it does, calling back the
owner to release the pages.  If even evicting every allowed candidate would
not free enough, nothing is evicted and ``alloc`` returns ``None``.

Candidates sit in a heap keyed by the policy's priority, with lazy deletion:
``remove`` only forgets the key, and stale heap entries are skipped when
popped.  Victim choice is O(log n) amortised.  Pure Python, no torch.
"""

from __future__ import annotations

import heapq
from typing import Callable

from unipage.eviction import Candidate, EvictionPolicy
from unipage.pool import PageKind, PagePool


class Reclaimer:
    def __init__(self, pool: PagePool, policy: EvictionPolicy) -> None:
        self.pool = pool
        self.policy = policy
        self._clock = 0
        self._live: dict[tuple[str, object], tuple[int, Candidate]] = {}  # (kind, key) -> (seq, cand)
        self._heap: list[tuple[tuple, int, str, object]] = []
        self._seq = 0
        self._evictable_pages = 0
        self._owners: dict[str, Callable[[object], None]] = {}
        self.evictions: dict[str, int] = {}  # kind -> units evicted so far

    def tick(self) -> int:
        """Advance and return the logical clock used for recency."""
        self._clock += 1
        return self._clock

    def register_owner(self, kind: str, evict: Callable[[object], None]) -> None:
        """``evict(key)`` must release the candidate's pages back to the pool."""
        self._owners[kind] = evict
        self.evictions.setdefault(kind, 0)

    # -- the candidate set ----------------------------------------------
    def add(self, cand: Candidate) -> None:
        ident = (cand.kind, cand.key)
        if ident in self._live:
            raise ValueError(f"{cand.kind} {cand.key!r} is already evictable")
        self._seq += 1
        self._live[ident] = (self._seq, cand)
        self._evictable_pages += cand.pages
        heapq.heappush(self._heap, (self.policy.priority(cand), self._seq, cand.kind, cand.key))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._compact()

    def remove(self, kind: str, key: object) -> Candidate | None:
        entry = self._live.pop((kind, key), None)
        if entry is None:
            return None
        self._evictable_pages -= entry[1].pages
        return entry[1]

    def __contains__(self, ident: tuple[str, object]) -> bool:
        return ident in self._live

    @property
    def evictable_pages(self) -> int:
        return self._evictable_pages

    def candidates(self) -> list[Candidate]:
        return [cand for _, cand in self._live.values()]

    # -- decisions -------------------------------------------------------
    def choose_victim(self, protect: frozenset = frozenset()) -> Candidate | None:
        """The candidate the policy would evict next, skipping ``(kind, key)`` in ``protect``."""
        skipped, victim = [], None
        while self._heap:
            prio, seq, kind, key = self._heap[0]
            entry = self._live.get((kind, key))
            if entry is None or entry[0] != seq:
                heapq.heappop(self._heap)
                continue
            if (kind, key) in protect:
                skipped.append(heapq.heappop(self._heap))
                continue
            victim = entry[1]
            break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return victim

    def alloc(self, n: int, kind: PageKind = PageKind.KV, protect: frozenset = frozenset()) -> list[int] | None:
        """``pool.alloc(n, kind)``, evicting candidates first if needed; ``None`` if it cannot fit."""
        if n > self.pool.num_free and not self.reclaim(n - self.pool.num_free, protect):
            return None
        return self.pool.alloc(n, kind)

    def reclaim(self, pages: int, protect: frozenset = frozenset()) -> bool:
        """Evict until ``pages`` more pages are free; evict nothing and return False if impossible."""
        protected = sum(self._live[i][1].pages for i in protect if i in self._live)
        if self._evictable_pages - protected < pages:
            return False
        target = self.pool.num_free + pages
        while self.pool.num_free < target:
            victim = self.choose_victim(protect)
            assert victim is not None, "evictable page count out of step with the candidates"
            self.evict(victim)
        return True

    def evict(self, cand: Candidate) -> None:
        self.remove(cand.kind, cand.key)
        self.evictions[cand.kind] += 1
        self._owners[cand.kind](cand.key)

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if self._live.get((e[2], e[3]), (None,))[0] == e[1]]
        heapq.heapify(self._heap)

    def check(self) -> None:
        assert self._evictable_pages == sum(c.pages for _, c in self._live.values())
