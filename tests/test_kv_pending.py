"""A lone chain's committed blocks are registered when someone could tell, not at commit.

`test_kv_lazy` compares every observable with eager hashing; these pin down the points where the pending
blocks of a lone root's chain get registered: a query, a lookup, a second chain, a free, and an invalidation
that drops them instead.
"""

from unipage.eviction import make_policy
from unipage.kv import KVManager, block_hashes
from unipage.pool import PageKind, PagePool
from unipage.reclaim import Reclaimer

B = 4


def make(pages: int = 16):
    pool = PagePool(pages)
    return pool, KVManager(pool, Reclaimer(pool, make_policy("lru")), B)


def test_a_decode_commit_of_a_lone_chain_registers_nothing_until_free():
    pool, kv = make()
    tokens = list(range(12))
    kv.open("a")
    kv.grow("a", 12)
    kv.commit("a", tokens, 4)
    assert [kv._blocks[p] is not None for p in range(3)] == [True, False, False]  # block 0 at once
    kv.commit("a", tokens, 12)
    assert [kv._blocks[p] is not None for p in range(3)] == [True, False, False]
    assert [kv.registered(p) for p in range(4)] == [True, True, True, False]  # as eager hashing says
    kv.check()
    kv.free("a")  # blocks 2, 1, 0 cached as one run (tail first; block 0 registered)
    assert pool.occupancy()["cached_kv"] == 3 and [kv.registered(p) for p in range(4)] == [True, True, True, False]
    [run] = kv._runs.values()
    assert run.run == [2, 1, 0] and kv._blocks[0] is not None and kv._blocks[1] is None
    kv.check()


def test_a_lookup_or_a_hash_query_registers_the_pending_blocks():
    _, kv = make()
    tokens = list(range(12))
    kv.open("a")
    kv.grow("a", 12)
    kv.commit("a", tokens)
    assert kv.block_hash(2) == block_hashes(tokens, B)[2]
    kv.open("b")
    kv.grow("b", 12)
    kv.commit("b", [7] * 12)
    assert kv.match_prefix([7] * 12) == [3, 4, 5]
    assert all(kv._blocks[p] is not None for p in range(6))
    kv.check()


def test_an_invalidation_drops_the_pending_blocks_of_its_salt():
    pool, kv = make()
    kv.open("a", (), "s")
    kv.grow("a", 12)
    kv.commit("a", list(range(12)))
    kv.open("b", (), "t")
    kv.grow("b", 8)
    kv.commit("b", list(range(8)))
    assert kv.invalidate("s") == 0  # nothing cached; a's blocks are no longer registered
    assert not any(kv.registered(p) for p in range(3)) and kv.registered(3) and kv.registered(4)
    kv.commit("a", list(range(16)), 12)  # nothing new
    kv.free("a")
    kv.free("b")
    assert [pool.kind(p) for p in range(5)] == [PageKind.FREE] * 3 + [PageKind.CACHED_KV] * 2
    kv.check()
