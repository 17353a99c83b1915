"""`PagePool`: who owns each page of the unified pool.  Pure Python, no torch.

A page id names the same slot in every layer of the device tensor
``pool[num_layers, num_pages, page_elems]``.  Each page has one owner kind and
a reference count::

    kind        refcount   on the free stack   meaning
    FREE        0          yes (exactly once)  unused
    KV          >= 1       no                  a KV block used by >= 1 sequence
    CACHED_KV   0          no                  a full KV block kept for prefix reuse
    ADAPTER     1          no                  part of a resident adapter's buffer

    FREE --alloc--> KV | ADAPTER --free (last ref)--> FREE
    KV (last ref) --cache--> CACHED_KV --reuse--> KV
                              CACHED_KV --drop--> FREE

Invariant (``check``): ``free + kv + cached_kv + adapter == total``.
Every method validates its whole argument before changing anything, so a bad
call raises `PageError` and leaves the pool as it was; but for the two
``*_unchecked`` fast paths, which the KV manager calls with pages its own
bookkeeping vouches for.  Running out of pages is not an error: ``alloc``
returns ``None``.
"""

from __future__ import annotations

from enum import IntEnum

from unipage.errors import PageError


class PageKind(IntEnum):
    FREE = 0
    KV = 1
    CACHED_KV = 2
    ADAPTER = 3


_KV, _CACHED_KV, _ADAPTER = PageKind.KV.value, PageKind.CACHED_KV.value, PageKind.ADAPTER.value
_OWNED_CODES = frozenset((_KV, _ADAPTER))


class PagePool:
    """O(1)-per-page allocator over page ids ``0 .. num_pages - 1``."""

    __slots__ = ("num_pages", "_kind", "_ref", "_free", "_counts")

    def __init__(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be an integer >= 1, got {num_pages!r}")
        self.num_pages = num_pages
        self._kind = bytearray(num_pages)  # PageKind per page
        self._ref = [0] * num_pages
        # Stack of free ids; popping from the end hands out low ids first.
        self._free = list(range(num_pages - 1, -1, -1))
        self._counts = [num_pages, 0, 0, 0]  # indexed by PageKind

    # -- queries ---------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_stack(self) -> list[int]:
        """The free page ids, as the pool's own live list (the same object for the pool's life): read only."""
        return self._free

    def refcounts(self) -> list[int]:
        """Every page's reference count, as the pool's own live list (indexed by page id): read only."""
        return self._ref

    def count(self, kind: PageKind) -> int:
        return self._counts[kind]

    def occupancy(self) -> dict[str, int]:
        """Pages per owner kind, e.g. ``{"free": 10, "kv": 4, "cached_kv": 2, "adapter": 8}``."""
        return {kind.name.lower(): self._counts[kind] for kind in PageKind}

    def kind(self, page: int) -> PageKind:
        self._check_id(page)
        return PageKind(self._kind[page])

    def refcount(self, page: int) -> int:
        if not isinstance(page, int) or not 0 <= page < self.num_pages:
            self._check_id(page)
        return self._ref[page]

    # -- transitions -----------------------------------------------------
    def alloc(self, n: int, kind: PageKind = PageKind.KV) -> list[int] | None:
        """Take ``n`` free pages for ``kind`` (KV or ADAPTER), refcount 1; ``None`` if fewer are free."""
        if kind != _KV and kind != _ADAPTER:
            raise PageError(f"alloc kind must be KV or ADAPTER, got {kind!r}")
        free = self._free
        if n.__class__ is not int or n < 0:
            raise PageError(f"alloc count must be an integer >= 0, got {n!r}")
        if n > len(free):
            return None
        kinds, refs = self._kind, self._ref
        if n == 1:  # the common case: one more KV block for a growing sequence
            page = free.pop()
            kinds[page] = kind
            refs[page] = 1
            ids = [page]
        else:
            ids = free[-n:] if n else []
            del free[len(free) - n:]
            ids.reverse()
            for page in ids:
                kinds[page] = kind
                refs[page] = 1
        counts = self._counts
        counts[0] -= n
        counts[kind] += n
        return ids

    def free(self, ids) -> None:
        """Drop one reference to each page; a page whose last reference goes becomes FREE."""
        ids = ids if ids.__class__ is list else list(ids)
        kinds, refs, n = self._kind, self._ref, self.num_pages
        for page in ids:
            if page.__class__ is not int or not 0 <= page < n or kinds[page] not in _OWNED_CODES \
                    or refs[page] < 1:
                self._free_error(ids)
        if len(ids) > 1 and len(set(ids)) != len(ids):
            self._check_repeats(ids)
        free, counts = self._free, self._counts
        for page in ids:
            ref = refs[page] - 1
            refs[page] = ref
            if ref == 0:
                counts[kinds[page]] -= 1
                kinds[page] = 0
                free.append(page)
                counts[0] += 1

    def _free_error(self, ids) -> None:
        self._check_ids(ids)
        for page in ids:
            if self._kind[page] not in _OWNED_CODES or self._ref[page] < 1:
                raise PageError(f"page {page} is {PageKind(self._kind[page]).name} with refcount "
                                f"{self._ref[page]}; cannot free it")

    def _check_repeats(self, ids) -> None:
        drops: dict[int, int] = {}
        for page in ids:
            drops[page] = drops.get(page, 0) + 1
        for page, times in drops.items():
            if self._ref[page] < times:
                raise PageError(f"page {page} has refcount {self._ref[page]}; cannot free it {times} times")

    def share(self, page: int) -> None:
        """Add a reference to an in-use KV page (a prefix block shared by one more sequence)."""
        self._expect(page, PageKind.KV, "share")
        self._ref[page] += 1

    def cache(self, page: int) -> None:
        """The last user of a KV page leaves it as a reusable cached block."""
        self.cache_many((page,))

    def cache_many(self, pages) -> None:
        """`cache` each of ``pages`` (distinct), all validated before any changes."""
        kinds, refs, n = self._kind, self._ref, self.num_pages
        for page in pages:
            if not isinstance(page, int) or not 0 <= page < n or kinds[page] != _KV or refs[page] != 1:
                self._expect(page, PageKind.KV, "cache")
                raise PageError(f"page {page} has refcount {refs[page]}; only the last user can cache it")
        if len(pages) > 1 and len(set(pages)) != len(pages):
            raise PageError(f"cannot cache a page twice: {list(pages)}")
        for page in pages:
            kinds[page] = _CACHED_KV
            refs[page] = 0
        self._counts[_KV] -= len(pages)
        self._counts[_CACHED_KV] += len(pages)

    def reuse(self, page: int) -> None:
        """A cached block is hit by a new sequence: it is KV again with one reference."""
        self._expect(page, PageKind.CACHED_KV, "reuse")
        self._move(page, PageKind.KV)
        self._ref[page] = 1

    def drop(self, page: int) -> None:
        """Reclaim a cached block: it becomes FREE."""
        if not isinstance(page, int) or not 0 <= page < self.num_pages or self._kind[page] != _CACHED_KV:
            self._expect(page, PageKind.CACHED_KV, "drop")
        self._kind[page] = 0  # refcount is 0 already
        self._free.append(page)
        self._counts[_CACHED_KV] -= 1
        self._counts[0] += 1

    def drop_many(self, pages: list[int]) -> None:
        """`drop` each of ``pages`` (distinct) in order, all validated before any changes."""
        kinds, n = self._kind, self.num_pages
        for page in pages:
            if page.__class__ is not int or not 0 <= page < n or kinds[page] != _CACHED_KV:
                self._expect(page, PageKind.CACHED_KV, "drop")
        if len(pages) > 1 and len(set(pages)) != len(pages):
            raise PageError(f"cannot drop a page twice: {list(pages)}")
        for page in pages:
            kinds[page] = 0  # refcounts are 0 already
        self._free += pages
        self._counts[_CACHED_KV] -= len(pages)
        self._counts[0] += len(pages)

    # -- unchecked: the co-owners' hot paths -----------------------------
    # The KV manager calls these with pages its own bookkeeping vouches for: pages whose last reference its
    # block tables hold, and cached blocks the reclaimer's lane holds (evicted in order).  They skip the
    # per-page validation of `cache_many` and `drop_many` -- under memory pressure, a scheduler step caches
    # and drops dozens of pages -- and `check` still catches a misuse.

    def cache_many_unchecked(self, pages: list[int]) -> None:
        """`cache_many` of distinct KV pages of refcount 1, not validated."""
        kinds, refs = self._kind, self._ref
        for page in pages:
            kinds[page] = _CACHED_KV
            refs[page] = 0
        self._counts[_KV] -= len(pages)
        self._counts[_CACHED_KV] += len(pages)

    def drop_many_unchecked(self, pages: list[int]) -> None:
        """`drop_many` of distinct CACHED_KV pages, not validated."""
        kinds = self._kind
        for page in pages:
            kinds[page] = 0  # refcounts are 0 already
        self._free += pages
        self._counts[_CACHED_KV] -= len(pages)
        self._counts[0] += len(pages)

    # -- internals -------------------------------------------------------
    def _move(self, page: int, kind: PageKind) -> None:
        self._counts[self._kind[page]] -= 1
        self._counts[kind] += 1
        self._kind[page] = kind

    def _expect(self, page: int, kind: PageKind, op: str) -> None:
        if not isinstance(page, int) or not 0 <= page < self.num_pages or self._kind[page] != kind:
            self._check_id(page)
            raise PageError(f"cannot {op} page {page}: it is {PageKind(self._kind[page]).name}, "
                            f"not {kind.name}")

    def _check_ids(self, ids) -> None:
        for page in ids:
            self._check_id(page)

    def _check_id(self, page: int) -> None:
        if not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise PageError(f"page id {page!r} is not in [0, {self.num_pages})")

    def check(self) -> None:
        """Assert every invariant of the table above (O(num_pages); for tests and idle time)."""
        counts = [0, 0, 0, 0]
        for page in range(self.num_pages):
            kind, ref = self._kind[page], self._ref[page]
            counts[kind] += 1
            if kind in (PageKind.FREE, PageKind.CACHED_KV):
                assert ref == 0, f"page {page} is {PageKind(kind).name} with refcount {ref}"
            elif kind == PageKind.ADAPTER:
                assert ref == 1, f"adapter page {page} has refcount {ref}"
            else:
                assert ref >= 1, f"KV page {page} has refcount {ref}"
        assert counts == self._counts, f"counters {self._counts} != recount {counts}"
        assert sum(counts) == self.num_pages
        assert len(self._free) == counts[PageKind.FREE], "free stack length != FREE pages"
        assert len(set(self._free)) == len(self._free), "a page is on the free stack twice"
        assert all(self._kind[p] == PageKind.FREE for p in self._free), "non-free page on the free stack"
