"""KVManager: block tables, prefix hits with exact page ids, LRU reclaim order."""

import hashlib
from array import array

import pytest

from unipage.eviction import make_policy
from unipage.kv import KVManager, block_hashes
from unipage.pool import PageKind, PagePool
from unipage.reclaim import Reclaimer

B = 4  # block tokens


def make(num_pages=16, policy="lru", caching=True):
    pool = PagePool(num_pages)
    reclaimer = Reclaimer(pool, make_policy(policy))
    return pool, reclaimer, KVManager(pool, reclaimer, B, prefix_caching=caching)


def run_sequence(kv, seq_id, tokens, salt=""):
    """Open, grow to the whole prompt, compute it (commit) and return the block table."""
    kv.open(seq_id, tokens, salt)
    assert kv.grow(seq_id, len(tokens))
    kv.commit(seq_id, tokens)
    return list(kv.block_table(seq_id))


def test_grow_appends_blocks_as_tokens_arrive():
    pool, _, kv = make()
    kv.open("a")
    assert kv.grow("a", 1) and kv.block_table("a") == [0]
    assert kv.grow("a", 4) and kv.block_table("a") == [0]
    assert kv.grow("a", 5) and kv.block_table("a") == [0, 1]
    assert kv.grow("a", 13) and kv.block_table("a") == [0, 1, 2, 3]
    kv.free("a")
    assert pool.occupancy() == {"free": 16, "kv": 0, "cached_kv": 0, "adapter": 0}
    kv.check()


def test_grow_that_does_not_fit_returns_false_and_changes_nothing():
    pool, _, kv = make(num_pages=3)
    kv.open("a")
    assert kv.grow("a", 8)
    assert not kv.grow("a", 16)
    assert kv.block_table("a") == [0, 1] and pool.num_free == 1
    kv.check()


def test_prefix_hit_shares_exact_pages_and_partial_block_is_private():
    pool, _, kv = make()
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    assert run_sequence(kv, "a", prompt) == [0, 1, 2]
    assert kv.match_prefix(prompt) == [0, 1]
    assert kv.open("b", prompt + [99]) == 8
    assert kv.block_table("b") == [0, 1]
    assert kv.grow("b", 11) and kv.block_table("b") == [0, 1, 3]
    assert pool.refcount(0) == 2 and pool.refcount(2) == 1
    kv.check()


def test_prefix_hit_needs_the_same_adapter_digest():
    _, _, kv = make()
    prompt = list(range(8))
    run_sequence(kv, "a", prompt, salt="digest-A")
    assert kv.match_prefix(prompt, "digest-A") == [0, 1]
    assert kv.match_prefix(prompt, "digest-B") == []
    assert kv.match_prefix(prompt) == []
    assert kv.match_prefix([0, 1, 2, 3, 9, 9, 9, 9], "digest-A") == [0]
    kv.check()


def test_freed_blocks_stay_cached_and_are_hit_again():
    pool, reclaimer, kv = make()
    prompt = list(range(8))
    run_sequence(kv, "a", prompt)
    kv.free("a")
    assert pool.occupancy()["cached_kv"] == 2 and reclaimer.evictable_pages == 2
    assert kv.open("b", prompt) == 8 and kv.block_table("b") == [0, 1]
    assert pool.occupancy()["cached_kv"] == 0 and pool.refcount(0) == 1
    kv.check()


def test_max_cached_tokens_caps_the_hit():
    _, _, kv = make()
    prompt = list(range(8))
    run_sequence(kv, "a", prompt)
    assert kv.open("b", prompt, max_cached_tokens=7) == 4
    assert kv.block_table("b") == [0]
    kv.check()


def test_pressure_reclaims_cached_blocks_lru_tail_first():
    pool, reclaimer, kv = make(num_pages=6)
    run_sequence(kv, "old", [1] * 8)  # pages 0, 1
    kv.free("old")
    run_sequence(kv, "new", [2] * 8)  # pages 2, 3
    kv.free("new")
    assert pool.num_free == 2
    # Needs 3 pages: the 2 free ones plus one cached block — the tail of the older chain.
    kv.open("c")
    assert kv.grow("c", 12)
    assert kv.block_table("c") == [1, 4, 5]  # the reclaimed page is on top of the free stack
    assert kv.match_prefix([1] * 8) == [0]  # the head of the old chain survives
    assert kv.match_prefix([2] * 8) == [2, 3]
    assert reclaimer.evictions["kv"] == 1
    kv.check()


def test_pressure_never_evicts_blocks_in_use():
    pool, _, kv = make(num_pages=4)
    run_sequence(kv, "a", list(range(8)))
    kv.open("b", list(range(8)))  # shares both blocks
    kv.open("c")
    assert kv.grow("c", 8)
    assert not kv.grow("c", 12)  # the shared blocks are not candidates
    assert pool.refcount(0) == 2
    kv.check()


def test_commit_of_a_block_computed_twice_keeps_the_first():
    pool, _, kv = make()
    prompt = list(range(4))
    kv.open("a")
    kv.open("b")
    kv.grow("a", 4)
    kv.grow("b", 4)
    kv.commit("a", prompt)
    kv.commit("b", prompt)
    assert kv.match_prefix(prompt) == [0]
    kv.free("b")
    assert pool.kind(1) == PageKind.FREE  # b's copy was never registered
    kv.free("a")
    assert pool.kind(0) == PageKind.CACHED_KV
    kv.check()


def test_commit_is_incremental_over_decode():
    _, _, kv = make()
    tokens = list(range(6))
    run_sequence(kv, "a", tokens)
    tokens += [6, 7, 8]
    kv.grow("a", len(tokens))
    kv.commit("a", tokens)
    assert kv.match_prefix(tokens) == [0, 1]
    assert block_hashes(tokens, B)[1] == block_hashes(tokens[:8], B)[1]
    kv.check()


def test_invalidate_drops_cached_and_unregisters_live_blocks():
    pool, reclaimer, kv = make()
    run_sequence(kv, "a", list(range(8)), salt="d1")
    kv.free("a")
    run_sequence(kv, "b", list(range(8, 16)), salt="d1")
    assert kv.invalidate("d1") == 2
    assert pool.occupancy()["cached_kv"] == 0 and reclaimer.evictable_pages == 0
    assert kv.match_prefix(list(range(8, 16)), "d1") == []
    kv.free("b")
    assert pool.num_free == 16
    kv.check()


def test_prefix_caching_off():
    pool, _, kv = make(caching=False)
    run_sequence(kv, "a", list(range(8)))
    kv.free("a")
    assert pool.num_free == 16 and kv.open("b", list(range(8))) == 0


def test_unknown_and_duplicate_sequences():
    _, _, kv = make()
    kv.open("a")
    with pytest.raises(ValueError, match="already open"):
        kv.open("a")
    with pytest.raises(KeyError, match="unknown sequence"):
        kv.grow("zz", 4)
    with pytest.raises(KeyError, match="unknown sequence"):
        kv.free("zz")
    kv.check()


def test_block_hashes_are_blake2b_chained_over_int64_token_bytes():
    """The documented format: h[0] = blake2b(blake2b(salt) + tokens[0:B]), h[i] = blake2b(h[i-1] + block i)."""
    tokens = [0, 1, 2**40, 31999, 7, 8, 9, 10, 11]
    prev = hashlib.blake2b(b"digest-A", digest_size=16).digest()
    expected = []
    for start in (0, 4):
        prev = hashlib.blake2b(prev + array("q", tokens[start:start + 4]).tobytes(), digest_size=16).digest()
        expected.append(prev)
    assert block_hashes(tokens, B, "digest-A") == expected
    assert block_hashes(tokens[4:], B, parent=expected[0]) == expected[1:]


def test_commit_of_a_prefix_equals_commit_of_its_copy():
    _, _, kv = make()
    _, _, ref = make()
    tokens = list(range(14))
    for manager in (kv, ref):
        manager.open("a")
        manager.grow("a", 14)
    kv.commit("a", tokens, 9)  # the first 9 tokens: 2 full blocks
    ref.commit("a", tokens[:9])
    assert kv.match_prefix(tokens) == ref.match_prefix(tokens) == [0, 1]
    kv.commit("a", tokens, 99)  # capped at len(tokens)
    assert kv.match_prefix(tokens) == [0, 1, 2]
    kv.check()


def test_free_stamps_cached_blocks_tail_first_one_tick_each_and_keeps_shared_ones():
    pool, reclaimer, kv = make()
    prompt = list(range(12))
    run_sequence(kv, "a", prompt)  # pages 0, 1, 2
    kv.open("b", prompt[:8])  # shares pages 0 and 1
    kv.grow("b", 9)  # + page 3, never committed
    start = reclaimer.tick()
    kv.free("a")  # page 2 cached; 0 and 1 still used by b
    kv.free("b")  # pages 1, 0 cached (tail first); page 3 free
    stamps = {c.key: c.last_used for c in reclaimer.candidates()}
    assert stamps == {2: start + 1, 1: start + 2, 0: start + 3}
    assert pool.kind(3) == PageKind.FREE and pool.occupancy()["cached_kv"] == 3
    kv.check()


def test_a_page_registered_again_after_eviction_starts_a_fresh_registration():
    pool, reclaimer, kv = make(num_pages=2)
    run_sequence(kv, "a", [1] * 4, salt="s1")  # page 0
    kv.free("a")
    assert kv.open("hit", [1] * 5, "s1") == 4  # a prefix hit: page 0 has two uses
    kv.free("hit")
    run_sequence(kv, "b", [2] * 8, salt="s2")  # page 0 (its cached block evicted) and page 1
    assert kv.block_table("b") == [0, 1] and reclaimer.evictions["kv"] == 1
    assert kv.match_prefix([1] * 4, "s1") == [] and kv.match_prefix([2] * 8, "s2") == [0, 1]
    kv.free("b")
    blocks = {c.key: c for c in reclaimer.candidates()}
    assert (blocks[0].uses, blocks[0].salt, blocks[0].hash) == (1, "s2", block_hashes([2] * 8, B, "s2")[0])
    assert kv.invalidate("s1") == 0 and kv.invalidate("s2") == 2
    assert pool.occupancy()["free"] == 2
    kv.check()
