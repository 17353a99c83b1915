"""Sliding-window KV: blocks that leave the window go back to the pool; two KV groups share it.

`KVManager(window=W)` alone (every layer slides) and `GroupedKV` (full and
sliding layers, GPT-OSS): `slide`, prefix hits that need only the window's
blocks, atomic growth of both tables, eviction of either group's cached
blocks, and the pool's invariants after every operation.
"""

import pytest

from unipage.config import ModelConfig, PoolConfig, UnipageConfig
from unipage.eviction import LRU
from unipage.kv import (
    NO_PAGE,
    KVManager,
    block_hashes,
    first_visible_block,
    window_prefix,
)
from unipage.kv_groups import GroupedKV
from unipage.memory import UnifiedMemory
from unipage.pool import PageKind, PagePool
from unipage.reclaim import Reclaimer

B = 4  # tokens per block


def grouped(num_pages=64, window=6, prefix_caching=True) -> tuple[GroupedKV, PagePool]:
    pool = PagePool(num_pages)
    return GroupedKV(pool, Reclaimer(pool, LRU()), B, prefix_caching, window=window), pool


def windowed(num_pages=64, window=6) -> tuple[KVManager, PagePool]:
    pool = PagePool(num_pages)
    return KVManager(pool, Reclaimer(pool, LRU()), B, window=window), pool


def live(table):
    return [page for page in table if page != NO_PAGE]


@pytest.mark.parametrize("position, window, first", [(0, 6, 0), (6, 6, 0), (8, 6, 0), (9, 6, 1), (12, 6, 1),
                                                     (13, 6, 2), (20, 1, 5), (100, 0, 0)])
def test_first_visible_block(position, window, first):
    """A query at p sees keys p - W < j <= p: block i is visible once its last key (4i + 3) is > p - W."""
    assert first_visible_block(position, B, window) == first


def test_window_prefix_needs_only_the_blocks_inside_the_window():
    window = 6  # a query at 4k sees keys from 4k - 5: blocks k - 2 and k - 1
    assert window_prefix([10, 11, 12, 13], B, window) == 4
    assert window_prefix([None, None, 12, 13], B, window) == 4  # blocks 0 and 1 left: not needed at k = 4
    assert window_prefix([None, 11, None, 13], B, window) == 0  # k = 4 needs block 2, k = 2 block 0
    assert window_prefix([10, None, None, 13], B, window) == 1
    assert window_prefix([None, None, None, 13], B, window) == 0
    assert window_prefix([], B, window) == 0


def test_slide_returns_the_blocks_out_of_every_window():
    kv, pool = windowed(window=6)
    kv.open("s", (), "")
    assert kv.grow("s", 20)  # 5 blocks
    table = list(kv.block_table("s"))
    kv.slide("s", 8)  # a query at 8 sees keys from 3: block 0 still
    assert kv.block_table("s") == table
    kv.slide("s", 13)  # keys from 8: blocks 0 and 1 leave
    assert kv.block_table("s")[:2] == [NO_PAGE, NO_PAGE] and kv.block_table("s")[2:] == table[2:]
    assert pool.count(PageKind.KV) == 3 and pool.num_free == 64 - 3
    kv.slide("s", 10)  # never back
    assert kv.block_table("s")[:2] == [NO_PAGE, NO_PAGE]
    kv.check()
    kv.free("s")
    assert pool.num_free == 64
    kv.check()


def test_a_full_attention_manager_never_slides():
    pool = PagePool(16)
    kv = KVManager(pool, Reclaimer(pool, LRU()), B)
    kv.open("s")
    kv.grow("s", 40)
    kv.slide("s", 40)
    assert NO_PAGE not in kv.block_table("s")


def test_registered_blocks_that_leave_the_window_stay_cached_for_reuse():
    kv, pool = grouped(window=6)
    tokens = list(range(1, 25))  # 6 blocks
    kv.open("a", tokens, "")
    assert kv.grow("a", 24)
    kv.commit("a", tokens)
    kv.slide("a", 24)  # window blocks 0..3 leave; registered, so cached
    assert live(kv.window_table("a")) == kv.window_table("a")[4:]
    assert pool.count(PageKind.CACHED_KV) == 4
    kv.check()
    kv.free("a")
    # A second sequence with the same 5-block prefix (and one more token) takes them all back.
    assert kv.open("b", tokens + [99], "", max_cached_tokens=24) == 24
    assert kv.hits == 6
    kv.check()


def test_a_prefix_hit_needs_the_window_blocks_before_its_end():
    kv, pool = grouped(num_pages=24, window=6)
    tokens = list(range(1, 21))  # 5 blocks
    kv.open("a", tokens, "")
    assert kv.grow("a", 20)
    kv.commit("a", tokens)
    kv.free("a")  # 5 full + 5 window blocks cached
    window_pages = kv.windowed.lookup(block_hashes(tokens, B, ""))
    # Evict the window group's block 3: a hit of 5 blocks needs blocks 3 and 4 of the window group,
    # a hit of 3 needs 1 and 2 — so 3 blocks are served, with the window table holding only 1 and 2.
    victim = next(c for c in kv.reclaimer.candidates() if c.key == window_pages[3])
    kv.reclaimer.evict(victim)  # through the grouped manager's owner callback
    assert not kv.windowed.registered(window_pages[3]) and pool.kind(window_pages[3]) == PageKind.FREE
    kv.check()
    assert kv.open("b", tokens + [7], "") == 12
    assert kv.window_table("b") == [NO_PAGE, window_pages[1], window_pages[2]]
    assert len(kv.block_table("b")) == 3
    kv.check()


def test_growth_takes_pages_for_both_tables_or_none():
    kv, pool = grouped(num_pages=5, window=4)
    kv.open("a")
    assert kv.grow("a", 8)  # 2 blocks: 4 pages
    assert not kv.grow("a", 12)  # 2 more pages needed, 1 free
    assert len(kv.block_table("a")) == len(kv.window_table("a")) == 2 and pool.num_free == 1
    kv.check()
    kv.slide("a", 8)  # a query at 8 sees keys from 5: block 0 of the window group leaves, its page is free
    assert pool.num_free == 2
    assert kv.grow("a", 12)
    assert len(kv.block_table("a")) == len(kv.window_table("a")) == 3 and pool.num_free == 0
    kv.check()


def test_a_long_sequence_holds_the_window_not_its_length_in_sliding_layers():
    kv, pool = grouped(num_pages=64, window=6, prefix_caching=False)
    kv.open("s")
    for length in range(1, 101):  # one token a step: slide to the query's position, grow, compute it
        kv.slide("s", length - 1)
        assert kv.grow("s", length)
        assert len(live(kv.window_table("s"))) <= 3  # the window's 6 keys span at most 3 blocks
        kv.check()
    assert len(kv.block_table("s")) == 25
    assert pool.count(PageKind.KV) <= 25 + 3


def test_invalidate_forgets_both_groups_blocks():
    kv, pool = grouped(window=6)
    tokens = list(range(1, 13))
    kv.open("a", tokens, "salt")
    kv.grow("a", 12)
    kv.commit("a", tokens)
    kv.free("a")
    assert kv.invalidate("salt") == 6 and pool.num_free == 64
    kv.check()


def test_memory_builds_grouped_kv_for_a_model_with_both_kinds_of_layer():
    model = ModelConfig(num_layers=4, hidden_size=64, num_heads=1, num_kv_heads=1, head_dim=64,
                        intermediate_size=128, sliding_layers=(0, 2), sliding_window=8, dtype="float32")
    memory = UnifiedMemory(UnipageConfig(model, PoolConfig(block_tokens=B, num_pages=32)))
    assert isinstance(memory.kv, GroupedKV) and memory.kv.window == 8
    assert model.kv_groups == ((1, 3), (0, 2)) and model.pool_rows == 2 and model.layer_rows == (0, 0, 1, 1)
    every = ModelConfig(num_layers=2, hidden_size=64, num_heads=1, num_kv_heads=1, head_dim=64,
                        intermediate_size=128, sliding_layers=(0, 1), sliding_window=8, dtype="float32")
    memory = UnifiedMemory(UnipageConfig(every, PoolConfig(block_tokens=B, num_pages=32)))
    assert isinstance(memory.kv, KVManager) and memory.kv.window == 8 and every.pool_rows == 2


def test_grouped_kv_refuses_a_missing_window():
    pool = PagePool(4)
    with pytest.raises(ValueError, match="window"):
        GroupedKV(pool, Reclaimer(pool, LRU()), B, window=0)

