"""`GroupedKV`: the KV of a model with full-attention and sliding-window layers.  Pure Python.

Each layer kind is a *KV group* (`ModelConfig.kv_groups`) with its own block
table per sequence, both tables drawing pages from the one pool: block ``i``
of a sequence has a page in the full group (K and V of every full layer) and,
while a later query can still see it, a page in the window group (every
sliding layer).  Once a block falls out of the window (`slide`), its window
page is returned to the pool — cached for prefix reuse if registered, else
free — so a long sequence holds the window's pages, not its length's, in
half of its layers.

The interface is `KVManager`'s, with `window_table` beside `block_table`.
Both tables always have the same length (a placeholder, `NO_PAGE`, stands
for a window block that left), and they grow together or not at all.  A
prefix hit takes the full group's run of cached blocks, as far as the
window group still holds the blocks inside the window before its end.
"""

from __future__ import annotations

from unipage.eviction import KV_BLOCK
from unipage.kv import KVManager
from unipage.pool import PageKind, PagePool
from unipage.reclaim import Reclaimer


class GroupedKV:
    num_groups = 2

    def __init__(self, pool: PagePool, reclaimer: Reclaimer, block_tokens: int, prefix_caching: bool = True,
                 recompute_s_per_token: float = 20e-6, *, window: int) -> None:
        if window < 1:
            raise ValueError(f"GroupedKV needs a sliding window >= 1, got {window!r}")
        args = (pool, reclaimer, block_tokens, prefix_caching, recompute_s_per_token)
        self.full = KVManager(*args, owner=False)
        self.windowed = KVManager(*args, window=window, owner=False)
        self.pool, self.reclaimer, self.block_tokens = pool, reclaimer, block_tokens
        self.prefix_caching, self.window = prefix_caching, window
        reclaimer.register_owner(KV_BLOCK, self._evict_cached)

    # -- queries ---------------------------------------------------------
    @property
    def hits(self) -> int:
        """Prefix blocks reused (counted once per block, in the full group)."""
        return self.full.hits

    def block_table(self, seq_id) -> list[int]:
        """The full group's live block table (read only)."""
        return self.full.block_table(seq_id)

    def window_table(self, seq_id) -> list[int]:
        """The window group's live block table (read only): `NO_PAGE` for blocks that left the window."""
        return self.windowed.block_table(seq_id)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self.full

    def blocks_needed(self, num_tokens: int) -> int:
        """Pages a sequence may hold at once: a full page per block, and a window page per block
        in the worst case (the whole sequence computed in one step)."""
        return 2 * self.full.blocks_needed(num_tokens)

    def match_prefix(self, tokens, salt: str = "") -> list[int]:
        """The full group's pages of the longest prefix both groups can serve; changes nothing."""
        full, _, window = self._match(tokens, salt)
        return full[:len(window)]

    # -- sequences -------------------------------------------------------
    def open(self, seq_id, tokens=(), salt: str = "", max_cached_tokens: int | None = None) -> int:
        """`KVManager.open`, in both groups."""
        if seq_id in self.full:
            raise ValueError(f"sequence {seq_id!r} is already open")
        if max_cached_tokens is not None:
            tokens = tokens[: max(max_cached_tokens, 0) // self.block_tokens * self.block_tokens]
        full, hashes, window = self._match(tokens, salt)
        count = len(window)
        self.full.adopt(seq_id, salt, full[:count], hashes[:count])
        self.windowed.adopt(seq_id, salt, window, hashes[:count])
        return count * self.block_tokens

    def grow(self, seq_id, num_tokens: int, protect: frozenset = frozenset()) -> bool:
        """Room for ``num_tokens`` tokens in both tables; False (nothing changed) if the pages are short."""
        missing = self.full.missing(seq_id, num_tokens)
        if not missing:
            return True
        pages = self.reclaimer.alloc(2 * missing, PageKind.KV, protect)
        if pages is None:
            return False
        self.full.extend(seq_id, pages[:missing])
        self.windowed.extend(seq_id, pages[missing:])
        return True

    def grow_each(self, seq_ids: list) -> bool:
        """One more block for each sequence (a page in each table), as `grow` one by one would give them;
        False (nothing changed) unless they all fit (evicting keeps free + evictable pages as they are)."""
        if 2 * len(seq_ids) > self.pool.num_free + self.reclaimer.evictable_pages:
            return False
        for seq_id in seq_ids:
            if not self.grow(seq_id, (len(self.full.block_table(seq_id)) + 1) * self.block_tokens):
                raise RuntimeError(f"sequence {seq_id!r}: a block did not fit after all")  # a bookkeeping bug
        return True

    def slide(self, seq_id, position: int) -> None:
        """Return the window pages of blocks no query at ``position`` or later can see."""
        self.windowed.slide(seq_id, position)

    def commit(self, seq_id, tokens, num_tokens: int | None = None) -> None:
        self.full.commit(seq_id, tokens, num_tokens)
        self.windowed.commit(seq_id, tokens, num_tokens)

    def free(self, seq_id) -> None:
        self.full.free(seq_id)
        self.windowed.free(seq_id)

    def invalidate(self, salt: str) -> int:
        return self.full.invalidate(salt) + self.windowed.invalidate(salt)

    def check(self) -> None:
        held = self.full.check_tables() + self.windowed.check_tables()
        assert held == self.pool.count(PageKind.KV), "a KV page is held by no block table"
        for seq_id in self.full.sequences():
            assert len(self.full.block_table(seq_id)) == len(self.window_table(seq_id)), "tables differ in length"

    # -- internals -------------------------------------------------------
    def _match(self, tokens, salt: str) -> tuple[list[int], list[bytes], list[int]]:
        """The full group's cached run, its hashes, and the window group's pages of the longest
        prefix it can serve within that run."""
        full = self.full.match_prefix(tokens, salt)
        hashes = [self.full.block_hash(page) for page in full]
        return full, hashes, self.windowed.window_pages(self.windowed.lookup(hashes))

    def _evict_cached(self, page: int) -> None:
        """Reclaimer callback: drop a cached block of either group (page ids are disjoint)."""
        group = self.full if self.full.is_cached(page) else self.windowed
        group._evict_cached(page)


def make_kv(pool: PagePool, reclaimer: Reclaimer, config) -> KVManager | GroupedKV:
    """The KV manager for ``config`` (a `UnipageConfig`): grouped when full and sliding layers mix."""
    model = config.model
    args = (pool, reclaimer, config.pool.block_tokens, config.pool.prefix_caching,
            config.lora.recompute_s_per_token)
    if model.hybrid_kv:
        return GroupedKV(*args, window=model.sliding_window)
    return KVManager(*args, window=model.sliding_window)  # every layer slides, or none
