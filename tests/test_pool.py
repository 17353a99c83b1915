"""PagePool: exact ids, refcounts, state transitions and bad input."""

import pytest

from unipage.errors import PageError
from unipage.pool import PageKind, PagePool


def test_alloc_hands_out_low_ids_first_and_counts_by_kind():
    pool = PagePool(8)
    assert pool.alloc(3) == [0, 1, 2]
    assert pool.alloc(2, PageKind.ADAPTER) == [3, 4]
    assert pool.occupancy() == {"free": 3, "kv": 3, "cached_kv": 0, "adapter": 2}
    assert [pool.refcount(p) for p in range(5)] == [1] * 5
    pool.check()


def test_free_then_alloc_reuses_the_most_recently_freed_pages():
    pool = PagePool(6)
    first = pool.alloc(4)
    pool.free([1, 3])
    assert pool.num_free == 4
    assert pool.alloc(2) == [3, 1]  # LIFO: last freed first
    assert pool.alloc(2) == [4, 5]
    assert pool.alloc(1) is None  # does not fit: a return value, not an error
    assert first == [0, 1, 2, 3]
    pool.check()


def test_alloc_more_than_free_returns_none_and_changes_nothing():
    pool = PagePool(4)
    pool.alloc(3)
    assert pool.alloc(2) is None
    assert pool.num_free == 1
    assert pool.alloc(0) == []
    pool.check()


def test_shared_page_is_freed_only_by_its_last_reference():
    pool = PagePool(4)
    [page] = pool.alloc(1)
    pool.share(page)
    pool.share(page)
    assert pool.refcount(page) == 3
    pool.free([page, page])
    assert pool.kind(page) == PageKind.KV and pool.refcount(page) == 1
    pool.free([page])
    assert pool.kind(page) == PageKind.FREE
    pool.check()


def test_cache_reuse_drop_cycle():
    pool = PagePool(4)
    [page] = pool.alloc(1)
    pool.cache(page)
    assert pool.kind(page) == PageKind.CACHED_KV and pool.refcount(page) == 0
    assert pool.occupancy()["cached_kv"] == 1
    pool.reuse(page)
    assert pool.kind(page) == PageKind.KV and pool.refcount(page) == 1
    pool.cache(page)
    pool.drop(page)
    assert pool.kind(page) == PageKind.FREE and pool.num_free == 4
    pool.check()


@pytest.mark.parametrize("ids", [[0, 0], [7], [-1], [99], ["x"]])
def test_double_or_out_of_range_free_raises_and_leaves_pool_unchanged(ids):
    pool = PagePool(8)
    pool.alloc(1)  # page 0, refcount 1
    before = (pool.occupancy(), pool.refcount(0))
    with pytest.raises(PageError):
        pool.free(ids)
    assert (pool.occupancy(), pool.refcount(0)) == before
    pool.check()


def test_free_is_all_or_nothing():
    pool = PagePool(4)
    pool.alloc(2)
    with pytest.raises(PageError, match="page 3 is FREE"):
        pool.free([0, 1, 3])
    assert pool.occupancy()["kv"] == 2
    pool.check()


def test_wrong_state_transitions_raise():
    pool = PagePool(4)
    [kv] = pool.alloc(1)
    [ad] = pool.alloc(1, PageKind.ADAPTER)
    pool.share(kv)
    with pytest.raises(PageError, match="only the last user"):
        pool.cache(kv)
    with pytest.raises(PageError, match="ADAPTER, not KV"):
        pool.share(ad)
    with pytest.raises(PageError, match="KV, not CACHED_KV"):
        pool.drop(kv)
    with pytest.raises(PageError, match="FREE, not CACHED_KV"):
        pool.reuse(3)
    with pytest.raises(PageError, match="KV or ADAPTER"):
        pool.alloc(1, PageKind.CACHED_KV)
    with pytest.raises(PageError, match=">= 0"):
        pool.alloc(-1)
    pool.check()


def test_bad_size():
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(0)


def test_cache_many_equals_caching_one_page_at_a_time():
    batched, single = PagePool(8), PagePool(8)
    for pool in (batched, single):
        pool.alloc(5)
        pool.share(4)
    batched.cache_many([3, 0, 2])
    for page in (3, 0, 2):
        single.cache(page)
    for pool in (batched, single):
        pool.check()
    assert batched.occupancy() == single.occupancy() == {"free": 3, "kv": 2, "cached_kv": 3, "adapter": 0}
    assert [batched.kind(p) for p in range(8)] == [single.kind(p) for p in range(8)]
    assert batched._free == single._free


@pytest.mark.parametrize("pages, match", [([0, 1, 4], "only the last user"), ([0, 7], "FREE, not KV"),
                                          ([0, 0], "twice"), ([1, 99], r"not in \[0, 8\)")])
def test_cache_many_validates_every_page_before_changing_any(pages, match):
    pool = PagePool(8)
    pool.alloc(5)
    pool.share(4)
    with pytest.raises(PageError, match=match):
        pool.cache_many(pages)
    assert pool.occupancy() == {"free": 3, "kv": 5, "cached_kv": 0, "adapter": 0}
    pool.check()


def _state(pool: PagePool) -> tuple:
    return pool.occupancy(), [pool.kind(p) for p in range(pool.num_pages)], pool.refcounts()[:], pool.free_stack()[:]


def test_unchecked_fast_paths_equal_the_checked_ones_on_valid_pages():
    checked, unchecked = PagePool(8), PagePool(8)
    for pool in (checked, unchecked):
        pool.alloc(6)
        pool.share(5)
    checked.cache_many([4, 1, 2, 0])
    unchecked.cache_many_unchecked([4, 1, 2, 0])
    assert _state(checked) == _state(unchecked)
    checked.drop_many([2, 4])
    unchecked.drop_many_unchecked([2, 4])
    for pool in (checked, unchecked):
        pool.check()
    assert _state(checked) == _state(unchecked)
    assert unchecked.free_stack()[-2:] == [2, 4]  # dropped pages are handed out next, the last first
