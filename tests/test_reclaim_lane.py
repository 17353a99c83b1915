"""The reclaimer's KV lane (LRU's cached blocks in a linked list over pages) evicts exactly what the heap does.

Random walks over cached KV blocks (mostly with the newest tick, some older), multi-page adapters, removals,
victim queries and reclaims with protected candidates, and adapter evictions that drop cached blocks from
inside the owner callback, run on a reclaimer with the lane and one without (``kv_lane=False``, every
candidate in the heap): every victim, eviction, candidate and count must agree after every operation.
A seeded scheduler workload then runs on both and must take the same steps.
"""

import functools
import random

import pytest
from test_scheduler_fast_paths import run_workload

from unipage import memory as memory_module
from unipage.eviction import ADAPTER, KV_BLOCK, POLICIES, Candidate, make_policy
from unipage.pool import PageKind, PagePool
from unipage.reclaim import Reclaimer

BUILT_IN = sorted(name for name, cls in POLICIES.items() if cls.__module__ == "unipage.eviction")
SALTS = 3  # adapter "a{i}" computed the cached blocks of salt i


class Side:
    """A pool and a reclaimer whose owners record what they evict; evicting adapter i drops salt i's blocks."""

    def __init__(self, policy: str, lane: bool) -> None:
        self.pool = PagePool(48)
        self.reclaimer = Reclaimer(self.pool, make_policy(policy), kv_lane=lane)
        self.salt: dict[int, int] = {}  # cached page -> salt
        self.adapter_pages: dict[str, list[int]] = {}
        self.evicted: list = []
        self.reclaimer.register_owner(KV_BLOCK, self.evict_block)
        self.reclaimer.register_owner(ADAPTER, self.evict_adapter)

    def evict_block(self, page: int) -> None:
        self.evicted.append(page)
        del self.salt[page]
        self.pool.drop(page)

    def evict_adapter(self, name: str) -> None:
        self.evicted.append(name)
        self.pool.free(self.adapter_pages.pop(name))
        salt = int(name[1:])
        for page in sorted(p for p, s in self.salt.items() if s == salt):  # as `KVManager.invalidate`
            self.reclaimer.remove(KV_BLOCK, page)
            self.pool.drop(page)
            del self.salt[page]

    def state(self) -> tuple:
        cands = sorted((c.kind, str(c.key), c.last_used, c.uses) for c in self.reclaimer.candidates())
        return (cands, self.reclaimer.evictable_pages, dict(self.reclaimer.evictions), self.evicted,
                self.pool.occupancy(), list(self.pool.free_stack()))


def cache_block(sides, salt: int, stamp: int, uses: int, cost: float) -> None:
    """A new cached KV block of ``salt``, the same on every side."""
    for side in sides:
        [page] = side.pool.alloc(1)
        side.pool.cache(page)
        side.salt[page] = salt
        side.reclaimer.add(Candidate(KV_BLOCK, page, 1, stamp, stamp, uses, cost))


def idle_adapter(sides, name: str, size: int, stamp: int, uses: int, cost: float) -> None:
    """A resident, idle adapter of ``size`` pages, the same on every side."""
    for side in sides:
        side.adapter_pages[name] = side.pool.alloc(size, PageKind.ADAPTER)
        side.reclaimer.add(Candidate(ADAPTER, name, size, stamp, stamp, uses, cost))


def walk(policy: str, seed: int, steps: int = 600) -> None:
    rng = random.Random(seed)
    sides = [Side(policy, lane) for lane in (True, False)]
    for _ in range(steps):
        first = sides[0]
        op = rng.random()
        tick = first.reclaimer.tick()
        for side in sides[1:]:
            side.reclaimer.tick()
        r = rng.random()  # mostly the newest stamp, as under LRU; some recent ones (ties across kinds), a few old
        stamp = tick if r < 0.6 else rng.randrange(max(1, tick - 6) if r < 0.9 else 1, tick + 1)
        uses, cost = rng.randrange(1, 4), rng.choice((0.0, 0.5, 2.0))
        if op < 0.4 and first.pool.num_free:
            cache_block(sides, rng.randrange(SALTS), stamp, uses, cost)
        elif op < 0.5:
            name = f"a{rng.randrange(SALTS)}"
            size = rng.randrange(1, 4)
            if name not in first.adapter_pages and first.pool.num_free >= size:
                idle_adapter(sides, name, size, stamp, uses, cost)
        elif op < 0.6 and first.salt:
            page = rng.choice(sorted(first.salt))
            for side in sides:
                assert side.reclaimer.remove(KV_BLOCK, page).key == page
                side.pool.reuse(page)
                side.pool.free([page])
                del side.salt[page]
        elif op < 0.65 and first.adapter_pages:
            name = rng.choice(sorted(first.adapter_pages))
            for side in sides:
                assert side.reclaimer.remove(ADAPTER, name).key == name
                side.pool.free(side.adapter_pages.pop(name))
        else:
            idents = [(KV_BLOCK, p) for p in first.salt] + [(ADAPTER, n) for n in first.adapter_pages]
            protect = frozenset(rng.sample(sorted(idents, key=str), min(len(idents), rng.randrange(3))))
            want = rng.randrange(1, 6)
            victims = [side.reclaimer.choose_victim(protect) for side in sides]
            assert len({(v.kind, v.key) if v else None for v in victims}) == 1
            assert len({side.reclaimer.reclaim(want, protect) for side in sides}) == 1
            assert all((KV_BLOCK, p) in side.reclaimer for side in sides for p in side.salt)
        for side in sides:
            side.pool.check()
            side.reclaimer.check()
        assert sides[0].state() == sides[1].state()
    assert sides[0].evicted  # the walk did reclaim


@pytest.mark.parametrize("policy", BUILT_IN)
@pytest.mark.parametrize("seed", range(4))
def test_the_kv_lane_evicts_as_the_heap_does(policy, seed):
    walk(policy, seed)


def test_the_lane_is_used_under_lru_only():
    for policy, used in (("lru", True), ("idle", True), ("lfu", False), ("fifo", False)):
        pool = PagePool(8)
        reclaimer = Reclaimer(pool, make_policy(policy))
        [page] = pool.alloc(1)
        pool.cache(page)
        reclaimer.add(Candidate(KV_BLOCK, page, 1, 1, 1, 1, 0.0))
        assert (reclaimer._lane_len == 1) == used and (KV_BLOCK, page) in reclaimer


@pytest.mark.parametrize("config", [(160, "optimistic", "lru", False), (40, "optimistic", "lru", False),
                                    (40, "optimistic", "idle", True)])
def test_a_scheduler_takes_the_same_steps_with_and_without_the_lane(config, monkeypatch):
    with_lane = run_workload(*config)
    monkeypatch.setattr(memory_module, "Reclaimer", functools.partial(Reclaimer, kv_lane=False))
    assert run_workload(*config) == with_lane
