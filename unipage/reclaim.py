"""`Reclaimer`: page allocation under pressure, through one eviction policy.

Both owners of reclaimable memory — the KV manager (cached blocks) and the
adapter manager (idle resident adapters) — offer their idle units here as
`Candidate`s.  When an allocation does not fit, the reclaimer evicts the
lowest-priority candidates of *either* kind until it does, calling back the
owner to release the pages.  If even evicting every allowed candidate would
not free enough, nothing is evicted and ``alloc`` returns ``None``.

Candidates are ordered by the policy's priority, with lazy deletion:
``remove`` only forgets the key, and stale entries are skipped when popped.
Victim choice is O(log n) amortised.  Pure Python, no torch.

The order lives in two places that are popped as one: a heap, and a *run*
(a deque in ascending order) that takes every entry not below its last one.
Under recency policies almost every candidate arrives with the newest
priority, so it is appended to the run and later popped from its front in
O(1); under pressure that happens once per page.  An entry is
``(priority[0], priority, seq, kind, key)``: the order of ``(priority,
seq)``, but most comparisons are settled by the leading number alone.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Callable

from unipage.eviction import Candidate, EvictionPolicy
from unipage.pool import PageKind, PagePool

_SEQ, _KIND, _KEY = 2, 3, 4  # fields of an entry
_NONE: dict = {}  # no candidates of a kind (never written)


class Reclaimer:
    def __init__(self, pool: PagePool, policy: EvictionPolicy) -> None:
        self.pool = pool
        self._pool_free = pool.free_stack()  # read for its length: the number of free pages
        self.policy = policy
        self._clock = 0
        self._live: dict[str, dict[object, tuple[int, Candidate]]] = {}  # kind -> key -> (seq, cand)
        self._num_live = 0
        self._heap: list[tuple] = []  # entries (priority[0], priority, seq, kind, key)
        self._run: deque[tuple] = deque()  # entries in ascending order
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
        lives, priority, run, heap, seq = self._live, self.policy.priority, self._run, self._heap, self._seq
        try:
            for cand in cands:  # a cached sequence offers a block per page
                kind, key = cand.kind, cand.key
                live = lives.get(kind) or lives.setdefault(kind, {})
                if key in live:
                    raise ValueError(f"{kind} {key!r} is already evictable")
                seq += 1
                live[key] = (seq, cand)
                self._evictable_pages += cand.pages
                prio = priority(cand)
                entry = (prio[0], prio, seq, kind, key)
                if not run or entry > run[-1]:  # `_push`, inlined
                    run.append(entry)
                else:
                    heapq.heappush(heap, entry)
        finally:  # the counters of those added, even if one was refused
            self._num_live += seq - self._seq
            self._seq = seq
        if len(self._heap) + len(self._run) > 2 * self._num_live + 64:
            self._compact()

    def remove(self, kind: str, key: object) -> Candidate | None:
        entry = self._live.get(kind, _NONE).pop(key, None)
        if entry is None:
            return None
        self._num_live -= 1
        self._evictable_pages -= entry[1].pages
        return entry[1]

    def __contains__(self, ident: tuple[str, object]) -> bool:
        return ident[1] in self._live.get(ident[0], _NONE)

    @property
    def evictable_pages(self) -> int:
        return self._evictable_pages

    def candidates(self) -> list[Candidate]:
        return [cand for live in self._live.values() for _, cand in live.values()]

    # -- decisions -------------------------------------------------------
    def choose_victim(self, protect: frozenset = frozenset()) -> Candidate | None:
        """The candidate the policy would evict next, skipping ``(kind, key)`` in ``protect``."""
        skipped, victim = [], None
        while (entry := self._pop()) is not None:
            held = self._held(entry)
            if held is None:
                continue
            skipped.append(entry)
            if (entry[_KIND], entry[_KEY]) not in protect:
                victim = held
                break
        for entry in skipped:
            self._push(entry)
        return victim

    def alloc(self, n: int, kind: PageKind = PageKind.KV, protect: frozenset = frozenset()) -> list[int] | None:
        """``pool.alloc(n, kind)``, evicting candidates first if needed; ``None`` if it cannot fit."""
        short = n - len(self._pool_free)
        if short > 0 and not self.reclaim(short, protect):
            return None
        return self.pool.alloc(n, kind)

    def reclaim(self, pages: int, protect: frozenset = frozenset()) -> bool:
        """Evict until ``pages`` more pages are free; evict nothing and return False if impossible."""
        lives = self._live
        protected = sum(lives[kind][key][1].pages for kind, key in protect if key in lives.get(kind, _NONE)) \
            if protect else 0
        if self._evictable_pages - protected < pages:
            return False
        free, heap, run, owners = self._pool_free, self._heap, self._run, self._owners
        target = len(free) + pages
        skipped = []  # protected entries popped on the way: pushed back at the end
        while len(free) < target:  # `choose_victim` + `evict`, inlined: under pressure this runs per page
            # `_pop`, inlined; never empty: the count above says enough is evictable
            entry = run.popleft() if run and (not heap or run[0] < heap[0]) else heapq.heappop(heap)
            kind, key = entry[_KIND], entry[_KEY]
            live = lives[kind]
            held = live.get(key)
            if held is None or held[0] != entry[_SEQ]:
                continue  # stale: removed, or re-added since
            if protect and (kind, key) in protect:
                skipped.append(entry)
                continue
            del live[key]
            self._num_live -= 1
            self._evictable_pages -= held[1].pages
            self.evictions[kind] += 1
            owners[kind](key)
        for entry in skipped:
            self._push(entry)
        return True

    def evict(self, cand: Candidate) -> None:
        self.remove(cand.kind, cand.key)
        self.evictions[cand.kind] += 1
        self._owners[cand.kind](cand.key)

    # -- the order -------------------------------------------------------
    def _push(self, entry: tuple) -> None:
        run = self._run
        if not run or entry > run[-1]:
            run.append(entry)
        else:
            heapq.heappush(self._heap, entry)

    def _pop(self) -> tuple | None:
        """The smallest entry of the heap and the run together, taken out; None if both are empty."""
        heap, run = self._heap, self._run
        if run and (not heap or run[0] < heap[0]):
            return run.popleft()
        return heapq.heappop(heap) if heap else None

    def _held(self, entry: tuple) -> Candidate | None:
        """The live candidate an entry stands for; None if it is stale (removed or re-added since)."""
        held = self._live[entry[_KIND]].get(entry[_KEY])
        return held[1] if held is not None and held[0] == entry[_SEQ] else None

    def _compact(self) -> None:
        """Drop stale entries, in place (``reclaim`` holds them while owners run)."""
        self._heap[:] = [e for e in self._heap if self._held(e) is not None]
        heapq.heapify(self._heap)
        fresh = [e for e in self._run if self._held(e) is not None]
        self._run.clear()
        self._run.extend(fresh)

    def check(self) -> None:
        assert self._evictable_pages == sum(c.pages for c in self.candidates())
        assert self._num_live == sum(map(len, self._live.values()))
        assert all(a < b for a, b in zip(self._run, list(self._run)[1:])), "run out of order"
