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

Under LRU (a policy whose ``priority`` is `LRU.priority`) cached KV blocks
skip the heap: they live in a *lane*, a doubly linked list over page ids in
flat per-page lists, in ``(last_used, seq)`` order -- the order the heap
would give them.  Blocks are cached with fresh ticks, so each is linked at
the tail; one that arrives older walks back to its place.  Removal is an
unlink, so a block costs no entry tuples, no dict entry and no stale
entries.  Victims come from the lane head or the heap and run (adapters),
whichever is smaller in ``(priority, seq)``: exactly the order without the
lane (``kv_lane=False``, kept as the reference the tests compare with).

A lane node may also be a `PageRun`: the blocks of a whole freed chain,
stamped one tick apart, as one node.  It is evicted from its front page by
page, exactly as its blocks would be, and its owner turns it back into
blocks before anything else touches one of its pages; so the order and the
observable candidates (`candidates` lists a run's blocks) are unchanged,
while caching and evicting a chain costs O(1) Python work per chain rather
than per block.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Callable

from unipage.eviction import KV_BLOCK, LRU, Candidate, EvictionPolicy
from unipage.pool import PageKind, PagePool

_SEQ, _KIND, _KEY = 2, 3, 4  # fields of an entry
_NONE: dict = {}  # no candidates of a kind (never written)
_NO_PAGES: frozenset = frozenset()
_LATEST = 1 << 62  # a clock tick never reached: the stamp of no heap entry


@dataclass(slots=True, eq=False)
class PageRun(Candidate):
    """Several one-page KV blocks cached at once, as one node of the lane: ``run[i]`` stands for the block
    stamped ``last_used + i`` (and ``inserted + i``), arrived ``i`` after the first, exactly as separate
    blocks given to `add_used_now` in that order would be.  ``key`` is ``run[0]``, ``pages`` its length.

    It is evicted from the front, page by page in that order, through the owner's ``evict_run``; before
    anything else touches one of its pages (the owner's lookups, `remove`, ``in``, a ``protect`` set), the
    owner turns it into separate blocks (``split_run`` and `replace_run`).  ``owner_data``: the owner's
    own record.
    """

    run: list[int] = field(default_factory=list)
    owner_data: object = None


class Reclaimer:
    def __init__(self, pool: PagePool, policy: EvictionPolicy, kv_lane: bool = True) -> None:
        """``kv_lane``: False keeps every candidate in the heap, even under LRU (the tests' reference)."""
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
        self._evict_many: dict[str, Callable[[list], None]] = {}  # kind -> evicts several keys in order
        self._evict_run: Callable[[PageRun, list[int]], None] | None = None  # KV: a run's front pages left
        self._split_run: Callable[[PageRun], None] | None = None  # KV: turn a run into blocks (`replace_run`)
        self.evictions: dict[str, int] = {}  # kind -> units evicted so far
        # The KV lane (LRU only): page -> next / previous page in the lane, its arrival (seq) and candidate.
        # Index ``num_pages`` is the list's head and tail (a sentinel); a page not in the lane has no candidate.
        n = self._end = pool.num_pages
        self._next, self._prev = [n] * (n + 1), [n] * (n + 1)
        self._lane_seq = [0] * n  # (a block's key, ``last_used``, is read from its candidate)
        self._lane_cand: list[Candidate | None] = [None] * n
        self._lane_len = 0
        self._lane_runs: dict[int, PageRun] = {}  # id -> a `PageRun` in the lane
        self._removed = 0  # heap candidates removed so far (a peeked entry is live while this and _seq hold)
        self._lane_on = kv_lane and type(policy).priority is LRU.priority

    def tick(self) -> int:
        """Advance and return the logical clock used for recency."""
        self._clock += 1
        return self._clock

    @property
    def now(self) -> int:
        """The clock's last tick (not advanced)."""
        return self._clock

    def ticks(self, n: int) -> range:
        """Advance the clock ``n`` times at once; the ``n`` ticks, in order (as ``n`` calls of `tick`)."""
        start = self._clock + 1
        self._clock += n
        return range(start, start + n)

    def register_owner(self, kind: str, evict: Callable[[object], None],
                       evict_many: Callable[[list], None] | None = None,
                       evict_run: Callable[[PageRun, list[int]], None] | None = None,
                       split_run: Callable[[PageRun], None] | None = None) -> None:
        """``evict(key)`` must release the candidate's pages back to the pool.  ``evict_many(keys)``, if
        given, does the same for several KV blocks at once, in order (it must not change the candidates).
        ``evict_run(run, pages)`` and ``split_run(run)``: a KV owner that offers `PageRun` candidates (see there);
        ``pages`` have just left the front of ``run``, and must be released in order."""
        def evict_each(keys: list) -> None:
            for key in keys:
                evict(key)

        self._owners[kind] = evict
        self._evict_many[kind] = evict_many or evict_each
        if evict_run is not None:
            self._evict_run, self._split_run = evict_run, split_run
        self.evictions.setdefault(kind, 0)

    @property
    def takes_runs(self) -> bool:
        """Whether `add_used_now` takes `PageRun` candidates (the lane is on and the KV owner handles them)."""
        return self._lane_on and self._evict_run is not None

    # -- the candidate set ----------------------------------------------
    def add(self, cand: Candidate) -> None:
        self.add_many((cand,))

    def add_many(self, cands) -> None:
        """`add` each candidate in order (distinct, and none evictable yet)."""
        lives, priority, run, heap, seq = self._live, self.policy.priority, self._run, self._heap, self._seq
        lane, end, lane_cand, heaped = self._lane_on, self._end, self._lane_cand, 0
        nxt, prev, lane_seq = self._next, self._prev, self._lane_seq
        try:
            for cand in cands:  # a cached sequence offers a block per page
                kind, key = cand.kind, cand.key
                if cand.__class__ is PageRun:
                    raise ValueError(f"a run of pages {cand.run} is offered through add_used_now, not add_many")
                if lane and kind == KV_BLOCK and key.__class__ is int and 0 <= key < end:
                    if lane_cand[key] is not None:
                        raise ValueError(f"{kind} {key!r} is already evictable")
                    seq += 1
                    tail = prev[end]
                    if tail != end and self._last_stamp(lane_cand[tail]) > cand.last_used:  # older: walk back
                        self._link(key, cand, seq)
                        continue
                    nxt[tail], prev[key], nxt[key], prev[end] = key, tail, end, key  # `_link` at the tail, inlined
                    lane_seq[key], lane_cand[key] = seq, cand
                    self._lane_len += 1
                    self._evictable_pages += cand.pages
                    continue
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
                heaped += 1
        finally:  # the counters of those added, even if one was refused
            self._num_live += heaped
            self._seq = seq
        if len(self._heap) + len(self._run) > 2 * self._num_live + 64:
            self._compact()

    def add_used_now(self, cands: list) -> None:
        """`add_many` of candidates last used just now: each is first stamped with the next clock tick, in
        order (``inserted`` and ``last_used``), as `ticks` then `add_many` would.  Under the lane they must be
        KV blocks keyed by page: so stamped, each is the newest and is linked at the tail, uncompared.
        A `PageRun` (if `takes_runs`) stands for its blocks, in order: a tick each, one node."""
        if not self._lane_on:
            for cand, now in zip(cands, self.ticks(len(cands))):
                cand.last_used = cand.inserted = now
            self.add_many(cands)
            return
        nxt, prev, lane_seq, lane_cand, end = self._next, self._prev, self._lane_seq, self._lane_cand, self._end
        now, seq, tail, pages, nodes = self._clock, self._seq, prev[end], 0, 0
        try:
            for cand in cands:
                key = cand.key
                if cand.kind != KV_BLOCK or key.__class__ is not int or not 0 <= key < end \
                        or lane_cand[key] is not None:
                    raise ValueError(f"{cand.kind} {key!r} is already evictable, or not a KV block of the pool")
                first, first_seq = now + 1, seq + 1
                if cand.__class__ is PageRun:  # its blocks take a tick and an arrival each
                    if not self.takes_runs or not cand.run or cand.run[0] != key or cand.pages != len(cand.run):
                        raise ValueError(f"a run of pages {cand.run} is not offered as a run here")
                    now += cand.pages
                    seq += cand.pages
                    self._lane_runs[id(cand)] = cand
                else:
                    now, seq = first, first_seq
                cand.last_used = cand.inserted = first
                nxt[tail], prev[key], lane_seq[key], lane_cand[key] = key, tail, first_seq, cand
                tail = key
                pages += cand.pages
                nodes += 1
        finally:  # those linked stay, as `add_many` keeps those added before a refusal
            nxt[tail], prev[end] = end, tail
            self._lane_len += nodes
            self._clock, self._seq = now, seq
            self._evictable_pages += pages

    def remove(self, kind: str, key: object) -> Candidate | None:
        if self._in_lane(kind, key):
            cand = self._lane_cand[key]
            if self._lane_runs and (cand is None or cand.__class__ is PageRun):  # in a run? blocks first
                self._split_holding(key)
                cand = self._lane_cand[key]
            if cand is not None:
                self._unlink(key)
            return cand
        entry = self._live.get(kind, _NONE).pop(key, None)
        if entry is None:
            return None
        self._num_live -= 1
        self._removed += 1
        self._evictable_pages -= entry[1].pages
        return entry[1]

    def __contains__(self, ident: tuple[str, object]) -> bool:
        if self._in_lane(*ident):
            return self._lane_cand[ident[1]] is not None or self._run_holding(ident[1]) is not None
        return ident[1] in self._live.get(ident[0], _NONE)

    @property
    def evictable_pages(self) -> int:
        return self._evictable_pages

    def candidates(self) -> list[Candidate]:
        """Every candidate; a `PageRun` as the blocks it stands for (new `Candidate` objects)."""
        lane = []
        for page in self._lane_pages():
            cand = self._lane_cand[page]
            lane += self._run_blocks(cand) if cand.__class__ is PageRun else (cand,)
        return [cand for live in self._live.values() for _, cand in live.values()] + lane

    @staticmethod
    def _run_blocks(run: PageRun) -> list[Candidate]:
        """The blocks ``run`` stands for, as plain candidates."""
        return [Candidate(KV_BLOCK, page, 1, run.inserted + i, run.last_used + i, run.uses, run.cost_s)
                for i, page in enumerate(run.run)]

    # -- decisions -------------------------------------------------------
    def choose_victim(self, protect: frozenset = frozenset()) -> Candidate | None:
        """The candidate the policy would evict next, skipping ``(kind, key)`` in ``protect``."""
        self._split_protected(protect)
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
        page = self._lane_head(protect)
        if page != self._end and (victim is None or self._lane_first(page, entry)):
            cand = self._lane_cand[page]
            if cand.__class__ is PageRun:  # its first block
                return Candidate(KV_BLOCK, page, 1, cand.inserted, cand.last_used, cand.uses, cand.cost_s)
            return cand
        return victim

    def alloc(self, n: int, kind: PageKind = PageKind.KV, protect: frozenset = frozenset()) -> list[int] | None:
        """``pool.alloc(n, kind)``, evicting candidates first if needed; ``None`` if it cannot fit."""
        short = n - len(self._pool_free)
        if short > 0 and not self.reclaim(short, protect):
            return None
        return self.pool.alloc(n, kind)

    def alloc_each(self, n: int, kind: PageKind = PageKind.KV) -> list[int] | None:
        """The pages of ``n`` calls of ``alloc(1, kind)``, in the order they would hand them out; ``None``,
        with nothing changed, unless all ``n`` fit.  (Evicting never changes free + evictable pages, so
        that sum says whether they all fit.)"""
        free, pool = self._pool_free, self.pool
        if n > len(free) + self._evictable_pages:
            return None
        pages = pool.alloc(min(n, len(free)), kind)
        while len(pages) < n:  # the free stack is empty: each alloc(1) would reclaim a page first
            evicted = self._evict_lane_run(self._next[self._end], n - len(pages), self._peek(frozenset(), []))
            if evicted:  # one page each, freed in turn: handed out in that order, not the stack's
                run = pool.alloc(evicted, kind)
                run.reverse()
                pages += run
            else:
                self.reclaim(1)
                pages += pool.alloc(min(n - len(pages), len(free)), kind)
        return pages

    def reclaim(self, pages: int, protect: frozenset = frozenset()) -> bool:
        """Evict until ``pages`` more pages are free; evict nothing and return False if impossible."""
        lives = self._live
        if protect:
            self._split_protected(protect)
        protected = sum(self._pages_of(kind, key) for kind, key in protect) if protect else 0
        if self._evictable_pages - protected < pages:
            return False
        if self._lane_len:
            self._reclaim_with_lane(pages, protect)
            return True
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

    def _reclaim_with_lane(self, pages: int, protect: frozenset) -> None:
        """`reclaim` (enough is evictable) when the lane holds blocks: each victim is the lane's head or the
        heap and run's smallest entry, whichever comes first."""
        free, end, nxt, prev, seqs = self._pool_free, self._end, self._next, self._prev, self._lane_seq
        cands, evict_kv = self._lane_cand, self._owners[KV_BLOCK]
        target = len(free) + pages
        skipped: list[tuple] = []  # protected heap entries popped on the way: pushed back at the end
        entry, seen = self._peek(protect, skipped), (self._seq, self._removed)
        kv_protected = {key for kind, key in protect if kind == KV_BLOCK} if protect else _NO_PAGES
        page = self._lane_head(protect)
        while len(free) < target:
            if page != end and self._evict_lane_run(page, target - len(free), entry, kv_protected):
                pass  # a run of one-page blocks left the lane
            elif page != end and cands[page].__class__ is not PageRun and (
                    entry is None or (stamp := cands[page].last_used) < entry[0]
                    or (stamp == entry[0] and seqs[page] < entry[_SEQ])):
                before, after = prev[page], nxt[page]  # `_unlink`, inlined (a block of several pages)
                nxt[before], prev[after] = after, before
                self._evictable_pages -= cands[page].pages
                cands[page] = None
                self._lane_len -= 1
                self.evictions[KV_BLOCK] += 1
                evict_kv(page)
            else:  # an adapter (the heap's entry), or a KV block in the heap
                kind, key = entry[_KIND], entry[_KEY]
                self._pop()
                self.evict(self._live[kind][key][1])
            # an owner may have changed the candidates (an adapter's eviction drops its cached blocks): look again
            if (self._seq, self._removed) != seen:
                entry = self._peek(protect, skipped)
                seen = self._seq, self._removed
            page = nxt[end] if not kv_protected else self._lane_head(protect)
        for held in skipped:
            self._push(held)

    def _evict_lane_run(self, first: int, limit: int, entry: tuple | None, protected: frozenset = frozenset()) -> int:
        """Evict up to ``limit`` one-page KV blocks of the lane from ``first`` on, while each is not among the
        ``protected`` pages and comes before the heap's ``entry``, exactly as one at a time; returns how many.
        (The blocks of a `PageRun` count as one-page blocks.)"""
        nxt, cands, seqs, end = self._next, self._lane_cand, self._lane_seq, self._end
        stamp = entry[0] if entry is not None else _LATEST  # blocks last used before the entry's go first
        victims, page, evicted = [], first, 0
        while limit > 0 and page != end:
            cand = cands[page]
            if cand.pages != 1 or cand.__class__ is PageRun:
                if cand.__class__ is not PageRun:
                    break
                count = min(limit, self._run_first(cand, seqs[page], entry))
                if not count:
                    break
                if victims:  # the blocks before it leave first
                    self._drop_victims(first, page, victims)
                    evicted, victims = evicted + len(victims), []
                page = first = self._evict_from_run(page, cand, count)
                evicted += count
                limit -= count
                continue
            if (protected and page in protected) or (cand.last_used >= stamp and (
                    cand.last_used > stamp or seqs[page] > entry[_SEQ])):
                break
            victims.append(page)
            cands[page] = None  # out of the lane (unlinked as a run below)
            page = nxt[page]
            limit -= 1
        if victims:
            self._drop_victims(first, page, victims)
        return evicted + len(victims)

    def _drop_victims(self, first: int, after: int, victims: list[int]) -> None:
        """`_evict_lane_run`'s end: unlink the one-page blocks ``victims`` (``first`` up to ``after``) at once."""
        before = self._prev[first]
        self._next[before], self._prev[after] = after, before
        count = len(victims)
        self._lane_len -= count
        self._evictable_pages -= count
        self.evictions[KV_BLOCK] += count
        self._evict_many[KV_BLOCK](victims)

    @staticmethod
    def _run_first(run: PageRun, seq: int, entry: tuple | None) -> int:
        """How many of ``run``'s blocks (the first arrived ``seq``) come before the heap's ``entry``."""
        if entry is None:
            return run.pages
        count = min(max(entry[0] - run.last_used, 0), run.pages)  # stamped before the entry's
        if count < run.pages and run.last_used + count == entry[0] and seq + count < entry[_SEQ]:
            count += 1  # (a tie on the stamp: the arrival decides)
        return count

    def _evict_from_run(self, page: int, run: PageRun, count: int) -> int:
        """Evict the first ``count`` blocks of the lane's ``run`` (at ``page``); returns the lane node that
        follows them: the run, keyed by its new first page, or the node after it."""
        nxt, prev, cands, seqs = self._next, self._prev, self._lane_cand, self._lane_seq
        gone, rest = run.run[:count], run.run[count:]
        before, after = prev[page], nxt[page]
        cands[page] = None
        if rest:  # the run stays where it was, keyed by its new first page
            key = rest[0]
            nxt[before], prev[key], nxt[key], prev[after] = key, before, after, key
            cands[key], seqs[key] = run, seqs[page] + count
            run.key, run.run, run.pages = key, rest, len(rest)
            run.last_used += count
            run.inserted += count
            after = key
        else:
            nxt[before], prev[after] = after, before
            run.run, run.pages = rest, 0
            self._lane_len -= 1
            del self._lane_runs[id(run)]
        self._evictable_pages -= count
        self.evictions[KV_BLOCK] += count
        self._evict_run(run, gone)
        return after

    def replace_run(self, run: PageRun, blocks: list[Candidate]) -> None:
        """Put ``blocks`` -- one-page candidates for ``run``'s pages, in order -- in its place in the lane,
        with the stamps and arrivals they stand for (the owner's ``split_run`` calls this)."""
        nxt, prev, cands, seqs = self._next, self._prev, self._lane_cand, self._lane_seq
        page = run.key
        if cands[page] is not run or [block.key for block in blocks] != run.run:
            raise ValueError(f"blocks {[b.key for b in blocks]} do not stand for the run of pages {run.run}")
        before, after, seq = prev[page], nxt[page], seqs[page]
        for i, block in enumerate(blocks):
            key = block.key
            block.inserted, block.last_used = run.inserted + i, run.last_used + i
            nxt[before], prev[key], cands[key], seqs[key] = key, before, block, seq + i
            before = key
        nxt[before], prev[after] = after, before
        self._lane_len += len(blocks) - 1
        del self._lane_runs[id(run)]

    def runs(self) -> list[PageRun]:
        """The runs in the lane."""
        return list(self._lane_runs.values())

    def _run_holding(self, page: int) -> PageRun | None:
        """The run in the lane that holds ``page`` (O(pages in runs), in C)."""
        for run in self._lane_runs.values():
            if page in run.run:
                return run
        return None

    def _split_holding(self, page: int) -> None:
        """If a run holds ``page``, its owner turns it into blocks."""
        run = self._run_holding(page)
        if run is not None:
            self._split_run(run)

    def _split_protected(self, protect: frozenset) -> None:
        """Runs that hold a protected KV block become blocks (a run's pages are evicted in order only)."""
        if protect and self._lane_runs:
            for kind, key in protect:
                if kind == KV_BLOCK and key.__class__ is int and 0 <= key < self._end:
                    self._split_holding(key)

    @staticmethod
    def _last_stamp(cand: Candidate) -> int:
        """The stamp of the last block a lane node stands for."""
        return cand.last_used + cand.pages - 1 if cand.__class__ is PageRun else cand.last_used

    def _peek(self, protect: frozenset, skipped: list) -> tuple | None:
        """The smallest live entry of the heap and run not in ``protect``, left in place; None if none.
        Stale entries on the way are dropped, protected ones moved to ``skipped``."""
        heap, run = self._heap, self._run
        while run or heap:
            entry = run[0] if run and (not heap or run[0] < heap[0]) else heap[0]
            if self._held(entry) is not None and not (protect and (entry[_KIND], entry[_KEY]) in protect):
                return entry
            self._pop()
            if self._held(entry) is not None:
                skipped.append(entry)
        return None

    def evict(self, cand: Candidate) -> None:
        self.remove(cand.kind, cand.key)
        self.evictions[cand.kind] += 1
        self._owners[cand.kind](cand.key)

    # -- the order -------------------------------------------------------
    def _in_lane(self, kind: str, key: object) -> bool:
        return self._lane_on and kind == KV_BLOCK and key.__class__ is int and 0 <= key < self._end

    def _link(self, page: int, cand: Candidate, seq: int) -> None:
        """Put a KV block into the lane at its place in ``(last_used, seq)`` order: the tail, unless it is older."""
        nxt, prev, cands, end, key = self._next, self._prev, self._lane_cand, self._end, cand.last_used
        after = prev[end]
        while after != end and cands[after].last_used > key:  # (seq is the newest: equal keys stay before it)
            after = prev[after]
        if after != end and cands[after].__class__ is PageRun and self._last_stamp(cands[after]) > key:
            self._split_run(cands[after])  # it would go between the run's blocks
            self._link(page, cand, seq)
            return
        before = nxt[after]
        nxt[after], prev[page], nxt[page], prev[before] = page, after, before, page
        self._lane_seq[page], cands[page] = seq, cand
        self._lane_len += 1
        self._evictable_pages += cand.pages

    def _unlink(self, page: int) -> Candidate:
        """Take a KV block out of the lane; returns its candidate."""
        nxt, prev = self._next, self._prev
        before, after = prev[page], nxt[page]
        nxt[before], prev[after] = after, before
        cand, self._lane_cand[page] = self._lane_cand[page], None
        self._lane_len -= 1
        self._evictable_pages -= cand.pages
        return cand

    def _lane_head(self, protect: frozenset) -> int:
        """The lane's first page not in ``protect`` (``_end`` if none)."""
        page, nxt, end = self._next[self._end], self._next, self._end
        while protect and page != end and (KV_BLOCK, page) in protect:
            page = nxt[page]
        return page

    def _lane_first(self, page: int, entry: tuple) -> bool:
        """Whether the lane's ``page`` comes before the heap's ``entry`` in ``(priority, seq)`` order."""
        return (self.policy.priority(self._lane_cand[page]), self._lane_seq[page]) < (entry[1], entry[_SEQ])

    def _pages_of(self, kind: str, key: object) -> int:
        """Pages of the candidate ``(kind, key)``; 0 if it is none."""
        if self._in_lane(kind, key):
            cand = self._lane_cand[key]
            if cand is None:
                return 1 if self._run_holding(key) is not None else 0
            return 1 if cand.__class__ is PageRun else cand.pages
        held = self._live.get(kind, _NONE).get(key)
        return held[1].pages if held is not None else 0

    def _lane_pages(self) -> list[int]:
        pages, page, nxt, end = [], self._next[self._end], self._next, self._end
        while page != end:
            pages.append(page)
            page = nxt[page]
        return pages

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
        lane = self._lane_pages()
        assert len(lane) == self._lane_len == sum(c is not None for c in self._lane_cand), "lane length"
        assert all(self._prev[b] == a for a, b in zip([self._end] + lane, lane + [self._end])), "lane links"
        spans = [(c.last_used, self._lane_seq[p], c.pages - 1 if c.__class__ is PageRun else 0)
                 for p, c in zip(lane, map(self._lane_cand.__getitem__, lane))]
        assert all((a[0] + a[2], a[1] + a[2]) < b[:2] for a, b in pairwise(spans)), "lane out of order"
        runs = [self._lane_cand[page] for page in lane if self._lane_cand[page].__class__ is PageRun]
        assert {id(run) for run in runs} == set(self._lane_runs), "the runs' registry"
        assert all(run.run[0] == run.key and run.pages == len(run.run) for run in runs)
        held = lane + [page for run in runs for page in run.run[1:]]
        assert len(held) == len(set(held)), "a page twice in the lane"
        assert self._lane_on or not lane
