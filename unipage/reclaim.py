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

A heap entry is ``(priority[0], priority, seq, kind, key)``: the same order
as ``(priority, seq)``, but most comparisons are decided by the leading
number alone, without descending into the priority tuple — under pressure
this heap is popped once per page.
"""

from __future__ import annotations

import heapq
from typing import Callable

from unipage.eviction import Candidate, EvictionPolicy
from unipage.pool import PageKind, PagePool

_SEQ, _KIND, _KEY = 2, 3, 4  # fields of a heap entry


class Reclaimer:
    def __init__(self, pool: PagePool, policy: EvictionPolicy) -> None:
        self.pool = pool
        self.policy = policy
        self._clock = 0
        self._live: dict[tuple[str, object], tuple[int, Candidate]] = {}  # (kind, key) -> (seq, cand)
        self._heap: list[tuple] = []  # (priority[0], priority, seq, kind, key)
        self._seq = 0
        self._evictable_pages = 0
        self._owners: dict[str, Callable[[object], None]] = {}
        self.evictions: dict[str, int] = {}  # kind -> units evicted so far

    def tick(self) -> int:
        """Advance and return the logical clock used for recency."""
        self._clock += 1
        return self._clock

    def ticks(self, n: int) -> range:
        """Advance the clock ``n`` times at once; the ``n`` ticks, in order (as ``n`` calls of `tick`)."""
        start = self._clock + 1
        self._clock += n
        return range(start, start + n)

    def register_owner(self, kind: str, evict: Callable[[object], None]) -> None:
        """``evict(key)`` must release the candidate's pages back to the pool."""
        self._owners[kind] = evict
        self.evictions.setdefault(kind, 0)

    # -- the candidate set ----------------------------------------------
    def add(self, cand: Candidate) -> None:
        self.add_many((cand,))

    def add_many(self, cands) -> None:
        """`add` each candidate in order (distinct, and none evictable yet)."""
        live, heap, priority = self._live, self._heap, self.policy.priority
        for cand in cands:
            ident = (cand.kind, cand.key)
            if ident in live:
                raise ValueError(f"{cand.kind} {cand.key!r} is already evictable")
            self._seq += 1
            live[ident] = (self._seq, cand)
            self._evictable_pages += cand.pages
            prio = priority(cand)
            heapq.heappush(heap, (prio[0], prio, self._seq, cand.kind, cand.key))
        if len(heap) > 2 * len(live) + 64:
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
        heap, skipped, victim = self._heap, [], None
        while heap:
            entry = heap[0]
            held = self._held(entry)
            if held is None:
                heapq.heappop(heap)
                continue
            if (entry[_KIND], entry[_KEY]) in protect:
                skipped.append(heapq.heappop(heap))
                continue
            victim = held
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return victim

    def alloc(self, n: int, kind: PageKind = PageKind.KV, protect: frozenset = frozenset()) -> list[int] | None:
        """``pool.alloc(n, kind)``, evicting candidates first if needed; ``None`` if it cannot fit."""
        if n > self.pool.num_free and not self.reclaim(n - self.pool.num_free, protect):
            return None
        return self.pool.alloc(n, kind)

    def reclaim(self, pages: int, protect: frozenset = frozenset()) -> bool:
        """Evict until ``pages`` more pages are free; evict nothing and return False if impossible."""
        protected = sum(self._live[i][1].pages for i in protect if i in self._live) if protect else 0
        if self._evictable_pages - protected < pages:
            return False
        pool, heap = self.pool, self._heap
        target = pool.num_free + pages
        skipped = []  # protected entries popped on the way: pushed back at the end
        while pool.num_free < target:  # `choose_victim` + `evict`, inlined: under pressure this runs per page
            entry = heapq.heappop(heap)  # never empty: the count above says enough is evictable
            held = self._held(entry)
            if held is None:
                continue
            if (entry[_KIND], entry[_KEY]) in protect:
                skipped.append(entry)
                continue
            self.evict(held)
        for entry in skipped:
            heapq.heappush(heap, entry)
        return True

    def evict(self, cand: Candidate) -> None:
        self.remove(cand.kind, cand.key)
        self.evictions[cand.kind] += 1
        self._owners[cand.kind](cand.key)

    def _held(self, entry: tuple) -> Candidate | None:
        """The live candidate a heap entry stands for; None if it is stale (removed or re-added since)."""
        held = self._live.get((entry[_KIND], entry[_KEY]))
        return held[1] if held is not None and held[0] == entry[_SEQ] else None

    def _compact(self) -> None:
        """Drop stale entries, in place (``reclaim`` holds the list while owners run)."""
        self._heap[:] = [e for e in self._heap if self._held(e) is not None]
        heapq.heapify(self._heap)

    def check(self) -> None:
        assert self._evictable_pages == sum(c.pages for _, c in self._live.values())
