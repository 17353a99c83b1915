"""`KVManager`: block tables per sequence and prefix caching.  Pure Python.

A sequence owns a block table — the page ids of its KV blocks, in token order;
token ``t`` lives in block ``t // block_tokens``.  Full blocks are registered
in the prefix cache under a chained hash::

    h[0] = H(salt, tokens[0:B])        h[i] = H(h[i-1], tokens[i*B:(i+1)*B])

where ``salt`` is the adapter's *content digest* (empty for the base model):
KV computed under one adapter is never reused under another, nor under a
replaced adapter that kept its name.  A block whose last user leaves stays in
the pool as CACHED_KV and is offered to the `Reclaimer`; a later sequence with
the same prefix and adapter picks it up again.  When freed, a sequence's
blocks are stamped tail-first, so under LRU the tail of a prefix is reclaimed
before its head (a chain is only useful from its start).

Hashing is lazy where no one can tell.  Every chain that commits a block 0
joins the *root* of its first hash ``h[0]``; equal hashes need equal roots,
so while a root has one chain (*lone*) none of its later blocks can equal
another's, and they are registered (their pages kept, cached, evicted as
above) without being hashed -- and, but block 0, only when someone could
tell (`_register_pending`: a query, a lookup, a second chain, a free or a
slide; an invalidation of the salt drops them instead), so a decode commit
under a lone root costs O(1).  The first lookup that reaches a lone root,
and every query of a hash, hashes the chain's committed blocks (`_hash_lone`,
from the chain's tokens: ``commit`` keeps a reference); a second chain
committing under the root hashes the first one and makes the root *eager*
(every block hashed at commit, as before) until no chain or registered
block is left under it.  So which blocks are registered, reused and evicted
is what eager hashing gives, and a workload without shared prefixes hashes
one block per sequence.  Freed, such a chain goes to the reclaimer's LRU lane
as one `PageRun` (its blocks tail first, block 0 last), registered block by
block only if a lookup, a query or an invalidation reaches it.

A manager with a ``window`` keeps the KV of sliding-window layers: once no
later query can see a block (``slide``), the block leaves the sequence — its
table entry becomes `NO_PAGE` and the page is cached or freed as on `free` —
and a prefix hit needs only the blocks inside the window before the first
token to compute (`window_prefix`).  Attention never reads entries before the
window, so those placeholders are never dereferenced.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from functools import cache, lru_cache
from hashlib import blake2b

from unipage.eviction import KV_BLOCK, Candidate
from unipage.pool import PageKind, PagePool
from unipage.reclaim import PageRun, Reclaimer

_KV = PageKind.KV
NO_PAGE = -1  # a block-table entry whose block left the window (sliding-window layers)


@lru_cache(maxsize=1 << 14)
def root_hash(salt: str) -> bytes:
    """The chain's seed for ``salt``: every adapter digest is hashed once, not once per request."""
    return blake2b(salt.encode(), digest_size=16).digest()


@cache
def _packer(block_tokens: int):
    """Packs one block's token ids as native int64s (the bytes of ``array("q", block)``)."""
    return struct.Struct(f"={block_tokens}q").pack


_new_hasher = blake2b(digest_size=16).copy  # a fresh 16-byte BLAKE2b state: cheaper than parsing its arguments


def chain_hash(prev: bytes, block: bytes) -> bytes:
    """The hash of a block (its packed token ids) after the block hashed ``prev``: BLAKE2b-128(prev + block)."""
    h = _new_hasher()
    h.update(prev + block)
    return h.digest()


def iter_block_hashes(tokens, block_tokens: int, salt: str = "", parent: bytes = b""):
    """Yield the chained hashes of the full blocks of ``tokens`` (a trailing partial block is ignored)."""
    prev, pack = parent or root_hash(salt), _packer(block_tokens)
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        prev = chain_hash(prev, pack(*tokens[start:start + block_tokens]))
        yield prev


def block_hashes(tokens, block_tokens: int, salt: str = "", parent: bytes = b"") -> list[bytes]:
    return list(iter_block_hashes(tokens, block_tokens, salt, parent))


def first_visible_block(position: int, block_tokens: int, window: int) -> int:
    """The first block a query at ``position`` or later can see with a sliding ``window`` (0: full attention)."""
    return max(0, position - window + 1) // block_tokens if window else 0


def window_prefix(pages: list, block_tokens: int, window: int) -> int:
    """How many leading blocks a sequence can take from the cache when only those a query after them
    sees must be present: the largest ``k`` with ``pages[first_visible_block(k·B):k]`` all cached
    (``pages[i]`` is block ``i``'s cached page or None)."""
    best, run_start = 0, 0
    for i, page in enumerate(pages):
        if page is None:
            run_start = i + 1
        elif run_start <= first_visible_block((i + 1) * block_tokens, block_tokens, window):
            best = i + 1
    return best


@dataclass(slots=True)
class _Sequence:
    salt: str
    table: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # hashes of table[:len(hashes)]
    dropped: int = 0  # table[:dropped] left the window (NO_PAGE)
    committed: int = 0  # blocks committed; hashes[len(hashes):committed] are not computed yet (a lone root's)
    registered: int = 0  # blocks[registered:committed] are a lone root's, not registered yet (`_register_pending`)
    tokens: object = None  # the last committed tokens (kept to hash them later)
    root: "_Root | None" = None  # the root of hashes[0], once block 0 is committed
    run: PageRun | None = None  # closed: its blocks cached as one run, not registered yet (`_release_pending`)


@dataclass(slots=True, eq=False)
class _Root:
    """The chains whose block 0 hashes to one ``h[0]``.  ``refs``: open sequences and registered blocks
    under it (it is forgotten at 0).  ``lone``: the one chain whose blocks may be unhashed, or None (eager)."""

    key: bytes
    refs: int = 0
    lone: _Sequence | None = None


@dataclass(slots=True)
class _Block(Candidate):
    """A page registered in the prefix cache; while cached, it is its own reclaim candidate.

    ``inserted`` is when it was last cached, ``uses`` its prefix hits + 1; the fields a
    priority reads change only while it is in use, when it is no candidate.
    """

    hash: bytes | None  # None: not computed yet (its root is lone)
    salt: str
    root: _Root | None = None


class KVManager:
    lazy_hashing = True  # False: every committed block is hashed at once (the reference the tests compare with)

    def __init__(self, pool: PagePool, reclaimer: Reclaimer, block_tokens: int,
                 prefix_caching: bool = True, recompute_s_per_token: float = 20e-6, window: int = 0,
                 owner: bool = True) -> None:
        """``window``: the layers' sliding window (0: full attention).  ``owner``: register as the
        reclaimer's owner of cached KV blocks (False when a `GroupedKV` dispatches for several)."""
        self.pool = pool
        self.reclaimer = reclaimer
        self.block_tokens = block_tokens
        self.prefix_caching = prefix_caching
        self.window = window
        self.block_cost_s = block_tokens * recompute_s_per_token
        self._pack = _packer(block_tokens)
        self._seqs: dict[object, _Sequence] = {}
        self._by_hash: dict[bytes, int] = {}  # hash -> page
        self._blocks: list[_Block | None] = [None] * pool.num_pages  # page -> its registration (None: none)
        self._block_at: list[_Block | None] = [None] * pool.num_pages  # page -> its last registration, to reuse
        self._by_salt: dict[str, set[int]] = {}  # salt -> registered pages
        self._roots: dict[bytes, _Root] = {}  # h[0] -> its root
        self._runs: dict[int, PageRun] = {}  # id -> a closed lone chain's blocks cached as one run
        self._salt_runs: dict[str, dict[int, PageRun]] = {}  # salt -> its runs, by id
        if owner:
            reclaimer.register_owner(KV_BLOCK, self._evict_cached, self._evict_cached_many, self._evict_run,
                                     self._split_run)
        self._use_runs = owner and not window and reclaimer.takes_runs
        self.hits = 0  # prefix blocks reused

    # -- queries ---------------------------------------------------------
    def block_table(self, seq_id) -> list[int]:
        """The sequence's live block table (the manager's own list: read it, never change it)."""
        return self._seq(seq_id).table

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def sequences(self):
        """The open sequences' ids (a live view)."""
        return self._seqs.keys()

    num_groups = 1  # block tables per sequence (`GroupedKV` has two)

    def blocks_needed(self, num_tokens: int) -> int:
        """Pages a sequence of ``num_tokens`` tokens may hold at once (at most)."""
        return -(-num_tokens // self.block_tokens)

    def registered(self, page: int) -> bool:
        """Whether ``page`` is a block of the prefix cache (in use or cached)."""
        if not (page.__class__ is int and 0 <= page < len(self._blocks)):
            return False
        return self._blocks[page] is not None or self._pending_owner(page) is not None \
            or self._run_of(page) is not None

    def is_cached(self, page: int) -> bool:
        """Whether ``page`` is a cached block of this manager (registered, no user)."""
        return (self._blocks[page] is not None or self._run_of(page) is not None) \
            and self.pool.refcounts()[page] == 0

    def block_hash(self, page: int) -> bytes:
        block = self._blocks[page] if 0 <= page < len(self._blocks) else None
        if block is None and (seq := self._pending_owner(page) or self._closed_owner(page)) is not None:
            self._hash_lone(seq.root)
            block = self._blocks[page]
        if block is None:
            raise KeyError(f"page {page!r} is not registered")
        if block.hash is None:
            self._hash_lone(block.root)
        return block.hash

    def match_prefix(self, tokens, salt: str = "") -> list[int]:
        """Pages of the longest run of cached full blocks that starts ``tokens``; changes nothing.

        With a window, the most blocks `window_prefix` allows, `NO_PAGE` for those before the window.
        """
        if not self.prefix_caching:
            return []
        if self.window:
            hashes = block_hashes(tokens, self.block_tokens, salt)
            return self.window_pages(self.lookup(hashes))
        pages = []
        for h in iter_block_hashes(tokens, self.block_tokens, salt):  # stops hashing at the first miss
            if not pages:
                self._sync_root(h)
            page = self._by_hash.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def lookup(self, hashes) -> list[int | None]:
        """The cached page of each block hash, or None."""
        if hashes:
            self._sync_root(hashes[0])
        get = self._by_hash.get
        return [get(h) for h in hashes]

    def window_pages(self, found: list[int | None]) -> list[int]:
        """The blocks to take from ``found`` (`lookup`'s answer) under the window: `NO_PAGE` before it."""
        count = window_prefix(found, self.block_tokens, self.window)
        first = first_visible_block(count * self.block_tokens, self.block_tokens, self.window)
        return [NO_PAGE] * first + found[first:count]

    # -- sequences -------------------------------------------------------
    def open(self, seq_id, tokens=(), salt: str = "", max_cached_tokens: int | None = None) -> int:
        """Start a sequence, taking the cached prefix of ``tokens``; returns the tokens it covers.

        ``max_cached_tokens`` caps the reuse (a scheduler keeps at least one prompt
        token to compute).
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already open")
        if max_cached_tokens is not None:
            tokens = tokens[: max(max_cached_tokens, 0) // self.block_tokens * self.block_tokens]
        if len(tokens) < self.block_tokens:  # not a full block: nothing to look up
            pages, hashes = [], []
        elif self.window and self.prefix_caching:  # `match_prefix`, keeping the hashes it computes
            hashes = block_hashes(tokens, self.block_tokens, salt)
            pages = self.window_pages(self.lookup(hashes))
            hashes = hashes[:len(pages)]
        else:
            pages = self.match_prefix(tokens, salt)
            hashes = [self._blocks[page].hash for page in pages]
        self.adopt(seq_id, salt, pages, hashes)
        return len(pages) * self.block_tokens

    def adopt(self, seq_id, salt: str, pages: list[int], hashes: list[bytes]) -> None:
        """Start a sequence on cached ``pages`` (the blocks with ``hashes``; `NO_PAGE` before a window)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already open")
        seq = _Sequence(salt, list(pages), list(hashes), committed=len(hashes), registered=len(hashes))
        if hashes:
            self._join_root(seq, hashes[0])
        now = self.reclaimer.tick()
        for page in pages:
            if page == NO_PAGE:
                seq.dropped += 1
            else:
                self._take(page, now)
                self.hits += 1
        self._seqs[seq_id] = seq

    def grow(self, seq_id, num_tokens: int, protect: frozenset = frozenset()) -> bool:
        """Make room for ``num_tokens`` tokens in total; False (nothing changed) if it cannot fit."""
        seq = self._seqs.get(seq_id) or self._seq(seq_id)
        missing = -(-num_tokens // self.block_tokens) - len(seq.table)
        if missing <= 0:
            return True
        pages = self.reclaimer.alloc(missing, _KV, protect)
        if pages is None:
            return False
        seq.table += pages
        return True

    def grow_each(self, seq_ids: list) -> bool:
        """One more block for each sequence, as `grow` one by one would give them; False (nothing changed)
        unless they all fit."""
        pages = self.reclaimer.alloc_each(len(seq_ids), _KV)
        if pages is None:
            return False
        seqs = self._seqs
        for seq_id, page in zip(seq_ids, pages):
            seqs[seq_id].table.append(page)
        return True

    def missing(self, seq_id, num_tokens: int) -> int:
        """Pages `grow` would add for ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_tokens) - len(self._seq(seq_id).table))

    def extend(self, seq_id, pages: list[int]) -> None:
        """Append freshly allocated KV ``pages`` to the sequence's table (a `GroupedKV` allocates them)."""
        self._seq(seq_id).table.extend(pages)

    def commit(self, seq_id, tokens, num_tokens: int | None = None) -> None:
        """Register the full blocks of ``tokens[:num_tokens]`` (the sequence's computed tokens) for prefix reuse.

        ``num_tokens`` (default: all of ``tokens``) spares the caller a copy of a prefix.  The manager keeps
        a reference to ``tokens`` and may hash the committed blocks later: their tokens must not change.
        """
        seq = self._seqs.get(seq_id) or self._seq(seq_id)
        if not self.prefix_caching:
            return
        if num_tokens is None or num_tokens > len(tokens):
            num_tokens = len(tokens)
        full, done, table = num_tokens // self.block_tokens, seq.committed, seq.table
        if full > len(table):
            full = len(table)
        if full <= done:
            return
        seq.tokens, seq.committed, now = tokens, full, self.reclaimer.tick()
        root = seq.root
        if root is not None and root.lone is seq and seq.registered:  # a decode commit under a lone root
            return
        self._commit_blocks(seq, done, now)

    def _commit_blocks(self, seq: _Sequence, done: int, now: int) -> None:
        """`commit` past its checks: register blocks ``done`` to ``seq.committed`` (``now``: the commit's tick)."""
        block, hashes, table, tokens, full, root = \
            self.block_tokens, seq.hashes, seq.table, seq.tokens, seq.committed, seq.root
        if root is None:  # block 0: its hash names the root
            h = _new_hasher()
            h.update(root_hash(seq.salt) + self._pack(*tokens[:block]))
            root = self._join_root(seq, h.digest())
        if root.lone is seq:  # no other chain shares the root: register and hash later, when one could tell
            if not seq.registered:  # but block 0 at once: its hash is known
                self._register_pending(seq, 1)
            return
        seq.registered = full
        prev, pack = hashes[-1] if hashes else root_hash(seq.salt), self._pack
        by_hash, blocks, salt_pages, hasher = self._by_hash, self._blocks, None, _new_hasher
        for index in range(done, full):  # as `iter_block_hashes` with `chain_hash` inlined, block by block
            if index < len(hashes):  # block 0, hashed to find its root
                prev = hashes[index]
            else:
                h = hasher()
                h.update(prev + pack(*tokens[index * block:index * block + block]))
                prev = h.digest()
                hashes.append(prev)
            page = table[index]
            if prev not in by_hash and page != NO_PAGE and blocks[page] is None:  # else an equal block was
                #   registered first (or the block already left the window)
                by_hash[prev] = page
                self._new_blocks((page,), now, prev, seq.salt, root)
                root.refs += 1
                if salt_pages is None:
                    salt_pages = self._salt_pages(seq.salt)
                salt_pages.add(page)

    def _register_pending(self, seq: _Sequence, end: int | None = None) -> None:
        """Register the blocks a lone root's chain committed since it last did (up to block ``end``), unhashed
        but block 0: what eager hashing registers at commit, done when someone could tell."""
        start, end = seq.registered, seq.committed if end is None else end
        seq.registered = end
        blocks, table, hashes, salt, root, now = self._blocks, seq.table, seq.hashes, seq.salt, seq.root, \
            self.reclaimer.now
        hashed = min(end, max(start, len(hashes)))
        pages = []
        for index in range(start, hashed):  # block 0 is hashed: it named the root
            page = table[index]
            if page != NO_PAGE and blocks[page] is None:
                self._new_blocks((page,), now, hashes[index], salt, root)
                self._by_hash[hashes[index]] = page
                pages.append(page)
        unhashed = [page for page in table[hashed:end] if page != NO_PAGE and blocks[page] is None]
        self._new_blocks(unhashed, now, None, salt, root)
        pages += unhashed
        if pages:
            self._salt_pages(salt).update(pages)
            root.refs += len(pages)

    def _pending_owner(self, page: int) -> _Sequence | None:
        """The open sequence whose committed, not yet registered blocks hold ``page`` (O(sequences))."""
        for seq in self._seqs.values():
            if seq.registered < seq.committed and page in seq.table[seq.registered:seq.committed]:
                return seq
        return None

    def _run_of(self, page: int) -> PageRun | None:
        """The run holding ``page`` (O(pages in runs); queries only, never a step's path)."""
        for run in self._runs.values():
            if page in run.run:
                return run
        return None

    def _closed_owner(self, page: int) -> _Sequence | None:
        """The closed sequence whose run holds ``page``."""
        run = self._run_of(page)
        return run.owner_data if run is not None else None

    def _join_root(self, seq: _Sequence, first: bytes) -> _Root:
        """``seq``, whose block 0 hashes to ``first``, joins that root: lone if it is the first there,
        else the root turns eager (its lone chain hashed first, as eager commits would have)."""
        if not seq.hashes:
            seq.hashes.append(first)
        root = self._roots.get(first)
        if root is None:
            root = self._roots[first] = _Root(first, 0, seq if self.lazy_hashing else None)
        elif root.lone is not None:
            self._hash_lone(root)
            root.lone = None
        root.refs += 1
        seq.root = root
        return root

    def _leave_root(self, root: _Root, refs: int = 1) -> None:
        root.refs -= refs
        if not root.refs:
            del self._roots[root.key]

    def _sync_root(self, first: bytes) -> None:
        """Before a lookup that starts with ``first``: every registered block under its root is hashed."""
        root = self._roots.get(first)
        if root is not None and root.lone is not None:
            self._hash_lone(root)

    def _hash_lone(self, root: _Root) -> None:
        """Hash the committed blocks of ``root``'s lone chain not hashed yet, and index those registered."""
        seq = root.lone
        if seq.registered < seq.committed:
            self._register_pending(seq)
        if seq.run is not None:  # closed, its blocks cached as a run: registered one by one first
            self._split_run(seq.run)
        hashes, tokens, block, pack = seq.hashes, seq.tokens, self.block_tokens, self._pack
        prev, table, blocks, by_hash = hashes[-1], seq.table, self._blocks, self._by_hash
        for index in range(len(hashes), seq.committed):
            h = _new_hasher()
            h.update(prev + pack(*tokens[index * block:index * block + block]))
            prev = h.digest()
            hashes.append(prev)
            page = table[index]
            registered = blocks[page] if page != NO_PAGE else None  # only this chain registers under a lone root
            if registered is not None and registered.root is root and registered.hash is None:
                registered.hash = prev
                by_hash[prev] = page

    def free(self, seq_id) -> None:
        """Release a sequence's blocks: registered ones whose last user it was become cached, the rest free."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id!r}")
        pending = seq.table[seq.registered:seq.committed]
        if pending and len(seq.hashes) <= seq.registered and not seq.dropped \
                and not any(map(self._blocks.__getitem__, pending)):  # unhashed and unregistered (as a rule)
            self._release_pending(seq, pending)
        else:
            if seq.registered < seq.committed:
                self._register_pending(seq)
            self._release(seq.table[seq.dropped:] if seq.dropped else seq.table)
        if seq.root is not None:  # its registered blocks keep the root (and a lone chain) while they last
            self._leave_root(seq.root)

    def slide(self, seq_id, position: int) -> None:
        """Window layers: release the blocks no query at ``position`` or later can see (a no-op without a window)."""
        if not self.window:
            return
        seq = self._seqs.get(seq_id) or self._seq(seq_id)
        first = min(first_visible_block(position, self.block_tokens, self.window), len(seq.table))
        if first <= seq.dropped:
            return
        if seq.root is not None and seq.root.lone is seq and len(seq.hashes) < seq.committed:
            self._hash_lone(seq.root)  # the blocks leaving keep their registrations: hash them while it can
        elif seq.registered < seq.committed:
            self._register_pending(seq)
        gone = seq.table[seq.dropped:first]
        seq.table[seq.dropped:first] = [NO_PAGE] * len(gone)
        seq.dropped = first
        self._release(gone)

    def _release(self, pages: list[int]) -> None:
        """Drop one use of each of a sequence's ``pages`` (in token order), as `free` describes."""
        cached, cached_blocks, unshared = [], [], []
        self._sort_out(pages, cached, cached_blocks, unshared)
        self._let_go(cached, cached_blocks, unshared)

    def _release_pending(self, seq: _Sequence, pending: list[int]) -> None:
        """`_register_pending` then `_release` of a whole closed sequence whose ``pending`` blocks are all
        unhashed, unregistered, and in the window: registered without the per-page checks, then sorted out
        with the rest (a cached block's stamp is `_let_go`'s)."""
        table, start, end, salt, root = seq.table, seq.registered, seq.committed, seq.salt, seq.root
        seq.registered = end
        cached, cached_blocks, unshared = [], [], []
        self._sort_out(table[end:], cached, cached_blocks, unshared)  # tail first: blocks never committed
        root.refs += len(pending)
        if self._use_runs and start == 1 and self.pool.refcounts()[table[0]] == 1 \
                and self._blocks[table[0]] is not None:
            # one candidate for them all, block 0 (registered) last; the others registered only if need be
            run = seq.run = PageRun(KV_BLOCK, pending[-1], len(pending) + 1, 0, 0, 1, self.block_cost_s,
                                    pending[::-1] + table[:1], seq)
            self._runs[id(run)] = self._salt_runs.setdefault(salt, {})[id(run)] = run
            cached += run.run
            cached_blocks.append(run)
        else:
            self._new_blocks(pending, self.reclaimer.now, None, salt, root)
            self._salt_pages(salt).update(pending)
            self._sort_out(pending, cached, cached_blocks, unshared)
            self._sort_out(table[:start], cached, cached_blocks, unshared)
        self._let_go(cached, cached_blocks, unshared)

    def _sort_out(self, pages: list[int], cached: list[int], cached_blocks: list[_Block], unshared: list[int]) -> None:
        """Append ``pages`` tail first (the tail is older under LRU) to ``cached`` (registered, and their last
        user leaves: with their blocks) or ``unshared`` (to free)."""
        blocks, refs = self._blocks, self.pool.refcounts()
        for page in reversed(pages):
            block = blocks[page]
            if refs[page] == 1 and block is not None:
                cached.append(page)
                cached_blocks.append(block)
            else:
                unshared.append(page)

    def _let_go(self, cached: list[int], cached_blocks: list[_Block], unshared: list[int]) -> None:
        """`_release`'s end: what `_sort_out` sorted is cached or freed."""
        if cached:  # registered pages whose last user left: cached blocks, stamped in order, and offered
            self.pool.cache_many_unchecked(cached)  # (its tables held their last reference)
            self.reclaimer.add_used_now(cached_blocks)
        self.pool.free(unshared)

    def invalidate(self, salt: str) -> int:
        """Forget every cached block computed under ``salt`` (its adapter was evicted); returns pages freed."""
        freed = 0
        for run in list(self._salt_runs.get(salt, {}).values()):
            self._split_run(run)  # (dropped below with the others, in page order)
        for seq in self._seqs.values():  # its committed blocks not registered yet never will be
            if seq.salt == salt:
                seq.registered = max(seq.registered, seq.committed)
        refs = self.pool.refcounts()  # a registered page is CACHED_KV exactly when no one holds it
        for page in sorted(self._by_salt.get(salt, ())):  # page order: how the set was built cannot matter
            if not refs[page]:
                self.reclaimer.remove(KV_BLOCK, page)
                self.pool.drop(page)
                freed += 1
            self._unregister(page)
        return freed

    # -- internals -------------------------------------------------------
    def _seq(self, seq_id) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def _take(self, page: int, now: int) -> None:
        if not self.pool.refcounts()[page]:  # a registered page no one holds is CACHED_KV (`kind` makes an Enum)
            self.reclaimer.remove(KV_BLOCK, page)  # before its fields change: it is the candidate
            self.pool.reuse(page)
        else:
            self.pool.share(page)
        block = self._blocks[page]
        block.uses += 1
        block.last_used = now

    def _new_blocks(self, pages, now: int, block_hash: bytes | None, salt: str, root: _Root) -> None:
        """Register ``pages``: each one's last registration reset (no one holds an unregistered block), or a new
        one."""
        blocks, block_at = self._blocks, self._block_at
        for page in pages:
            block = block_at[page]
            if block is None:
                block = block_at[page] = _Block(KV_BLOCK, page, 1, now, now, 1, self.block_cost_s, block_hash,
                                                salt, root)
            else:
                block.inserted = block.last_used = now
                block.uses = 1
                block.hash = block_hash
                block.salt = salt
                block.root = root
            blocks[page] = block

    def _salt_pages(self, salt: str) -> set[int]:
        """The registered pages computed under ``salt``, created empty if none are."""
        pages = self._by_salt.get(salt)
        if pages is None:
            pages = self._by_salt[salt] = set()
        return pages

    def _unregister(self, page: int) -> None:
        self._unregister_many((page,))

    def _unregister_many(self, pages) -> None:
        """Unregister ``pages``; a run of them under one salt and root (a chain's, as a rule) leaves its salt's
        set and its root's count at once."""
        blocks, by_hash = self._blocks, self._by_hash
        run, salt, root = [], None, None
        for page in pages:
            block, blocks[page] = blocks[page], None
            if block.hash is not None:
                del by_hash[block.hash]
            if block.salt is not salt or block.root is not root:
                if run:
                    self._forget(run, salt, root)
                run, salt, root = [], block.salt, block.root
            run.append(page)
        if run:
            self._forget(run, salt, root)

    def _forget(self, pages: list[int], salt: str, root: _Root) -> None:
        """Take unregistered ``pages`` off ``salt``'s set and ``root``'s count (forgotten when empty)."""
        salt_pages = self._by_salt[salt]
        salt_pages.difference_update(pages)
        if not salt_pages:
            del self._by_salt[salt]
        root.refs -= len(pages)
        if not root.refs:
            del self._roots[root.key]

    def _evict_cached(self, page: int) -> None:
        """Reclaimer callback: drop a cached block."""
        self._unregister(page)
        self.pool.drop(page)

    def _evict_cached_many(self, pages: list[int]) -> None:
        """Reclaimer callback: drop several cached blocks, in order."""
        self._unregister_many(pages)
        self.pool.drop_many_unchecked(pages)  # (registered and in the reclaimer's lane: cached)

    def _evict_run(self, run: PageRun, pages: list[int]) -> None:
        """Reclaimer callback: ``pages`` left the front of a run (gone with its last page, block 0, the one
        registered)."""
        if run.run:
            run.owner_data.root.refs -= len(pages)  # (block 0 still counts)
        else:
            run.owner_data.root.refs -= len(pages) - 1
            self._unregister_many(pages[-1:])
            self._forget_run(run)
        self.pool.drop_many_unchecked(pages)  # (a run's pages are cached)

    def _forget_run(self, run: PageRun) -> None:
        seq = run.owner_data
        del self._runs[id(run)]
        runs = self._salt_runs[seq.salt]
        del runs[id(run)]
        if not runs:
            del self._salt_runs[seq.salt]
        seq.run = None

    def _split_run(self, run: PageRun) -> None:
        """Register a run's blocks one by one (unhashed, as `_release_pending` would have) and put them in
        its place in the reclaimer's lane."""
        seq, pending = run.owner_data, run.run[:-1]  # (block 0, last, is registered)
        self._new_blocks(pending, 0, None, seq.salt, seq.root)  # (stamped by `replace_run`)
        self._salt_pages(seq.salt).update(pending)
        self._forget_run(run)
        self.reclaimer.replace_run(run, [self._blocks[page] for page in run.run])

    def check(self) -> None:
        """Refcounts equal the block tables that hold each page; registrations are consistent."""
        assert self.check_tables() == self.pool.count(PageKind.KV), "a KV page is held by no block table"

    def check_tables(self) -> int:
        """`check` but for the pool's KV count (shared with other managers); returns the pages held."""
        refs: dict[int, int] = {}
        for seq in self._seqs.values():
            assert len(seq.hashes) <= len(seq.table)
            assert all(page == NO_PAGE for page in seq.table[:seq.dropped])
            assert self.window or not seq.dropped, "a block left a full-attention table"
            for page in seq.table[seq.dropped:]:
                assert page != NO_PAGE, "a block inside the window has no page"
                refs[page] = refs.get(page, 0) + 1
        for page, count in refs.items():
            assert self.pool.kind(page) == PageKind.KV, f"page {page} in a block table is not KV"
            assert self.pool.refcount(page) == count, f"page {page}: refcount != block tables holding it"
        under: dict[bytes, int] = {}  # root -> registered blocks and open sequences under it
        for seq in self._seqs.values():
            assert len(seq.hashes) <= seq.committed <= len(seq.table) and seq.registered <= seq.committed
            assert seq.registered == seq.committed or seq.root.lone is seq, "an eager chain left blocks pending"
            if seq.root is not None:
                assert seq.root.key == seq.hashes[0] and self._roots[seq.root.key] is seq.root
                assert seq.root.lone is seq or seq.root.lone is None
                assert seq.root.lone is seq or len(seq.hashes) == seq.committed, "an eager chain is unhashed"
                under[seq.root.key] = under.get(seq.root.key, 0) + 1
        registered = {page: block for page, block in enumerate(self._blocks) if block is not None}
        in_runs: set[int] = set()
        assert {id(run) for run in self.reclaimer.runs()} == set(self._runs), "runs the reclaimer does not hold"
        assert sorted(self._runs) == sorted(i for runs in self._salt_runs.values() for i in runs)
        for run in self._runs.values():
            seq = run.owner_data
            assert seq.run is run and seq.root.lone is seq and self._roots[seq.root.key] is seq.root
            assert self._salt_runs[seq.salt][id(run)] is run
            assert run.run and (KV_BLOCK, run.key) in self.reclaimer and run.run[-1] == seq.table[0]
            for page in run.run:
                assert self.pool.kind(page) == PageKind.CACHED_KV
                assert (self._blocks[page] is None) == (page != seq.table[0]), "only block 0 is registered"
            under[seq.root.key] = under.get(seq.root.key, 0) + len(run.run) - 1
            in_runs.update(run.run)
        for page, block in registered.items():
            assert self._roots[block.root.key] is block.root
            under[block.root.key] = under.get(block.root.key, 0) + 1
            if block.hash is None:
                assert block.root.lone is not None, "a block under an eager root is unhashed"
            else:
                assert self._by_hash[block.hash] == page
            kind = self.pool.kind(page)
            assert kind in (PageKind.KV, PageKind.CACHED_KV), f"registered page {page} is {kind.name}"
            assert (kind == PageKind.CACHED_KV) == ((KV_BLOCK, page) in self.reclaimer or page in in_runs)
            assert (kind == PageKind.CACHED_KV) == (page not in refs)
        assert len(self._by_hash) == sum(block.hash is not None for block in registered.values())
        assert len(registered) == sum(len(s) for s in self._by_salt.values())
        assert under == {key: root.refs for key, root in self._roots.items()}, "root counts"
        return len(refs)
