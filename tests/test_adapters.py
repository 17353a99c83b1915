"""AdapterManager + Reclaimer: residency, pins, effects, and the one eviction decision."""

import random

import pytest

from unipage.adapters import DropHostCopy, EvictAdapter, LoadAdapter, Residency
from unipage.adapter_info import synthetic_info
from unipage.config import LoRAConfig, ModelConfig, PoolConfig, UnipageConfig
from unipage.errors import (AdapterBusyError, AdapterError, AdapterExistsError, AdapterRankError,
                            AdapterShapeError, UnknownAdapterError)
from unipage.eviction import KV_BLOCK, Candidate, make_policy
from unipage.memory import UnifiedMemory
from unipage.pool import PagePool
from unipage.reclaim import Reclaimer

# page_elems = 4 * 2 * 1 * 64 = 512; an attention-only adapter of rank r takes
# 4 targets * (r rows of 64 (A) + r rows of 64 (B)) = 512 r elements = r pages.
MODEL = ModelConfig(num_layers=2, hidden_size=64, num_heads=1, num_kv_heads=1, head_dim=64,
                    intermediate_size=128, dtype="float32")


def make(num_pages=16, policy="lru", host_bytes=1 << 30, max_rank=16):
    config = UnipageConfig(MODEL, PoolConfig(block_tokens=4, num_pages=num_pages),
                           LoRAConfig(max_rank=max_rank, eviction_policy=policy, host_cache_bytes=host_bytes))
    return UnifiedMemory(config)


def add(memory, name, rank, digest=None):
    return memory.adapters.register(name, synthetic_info(MODEL, rank, digest=digest or name))


def load(memory, name, protect=frozenset()):
    """Request ``name`` and complete its load at once, as a synchronous executor would."""
    state = memory.adapters.request(name, protect)
    for effect in memory.adapters.take_effects():
        if isinstance(effect, LoadAdapter):
            memory.adapters.load_done(effect.name)
    return state


def test_pages_per_adapter_follow_the_layout():
    memory = make()
    assert [add(memory, f"a{r}", r).num_pages for r in (1, 2, 4)] == [1, 2, 4]


def test_request_emits_a_load_and_the_adapter_is_ready_after_it():
    memory = make()
    add(memory, "a", 4)
    assert memory.adapters.request("a") == Residency.LOADING
    [effect] = memory.adapters.take_effects()
    assert isinstance(effect, LoadAdapter)
    assert (effect.name, effect.slot, effect.pages, effect.from_host) == ("a", 0, (0, 1, 2, 3), False)
    assert memory.adapters.request("a") == Residency.LOADING
    assert memory.adapters.take_effects() == []
    memory.adapters.load_done("a")
    assert memory.adapters.request("a") == Residency.READY
    assert memory.occupancy() == {"free": 12, "kv": 0, "cached_kv": 0, "adapter": 4}
    memory.check()


def test_pinned_adapters_are_never_evicted_and_no_space_changes_nothing():
    memory = make(num_pages=8)
    add(memory, "a", 4)
    add(memory, "b", 4)
    add(memory, "c", 4)
    load(memory, "a")
    load(memory, "b")
    memory.adapters.pin("a")
    memory.adapters.pin("b")
    assert memory.adapters.request("c") == Residency.NO_SPACE
    assert memory.adapters.take_effects() == []
    assert memory.adapters.resident() == ["a", "b"]
    memory.adapters.unpin("b")
    assert load(memory, "c") == Residency.LOADING
    assert memory.adapters.resident() == ["a", "c"]
    memory.check()


@pytest.mark.parametrize("policy, victim", [
    ("lru", "b"),  # b was used least recently
    ("lfu", "c"),  # c was used once
    ("fifo", "a"),  # a became resident first
    ("size", "a"),  # a is the largest
    ("cost", "c"),  # c: cheapest reload per page (fewest uses, same bytes per page)
])
def test_victim_by_policy(policy, victim):
    memory = make(num_pages=12, policy=policy)
    add(memory, "a", 4)
    add(memory, "b", 2)
    add(memory, "c", 2)
    add(memory, "d", 6)
    for name in ("a", "b", "c"):
        load(memory, name)
    for name in ("b", "b", "a", "a", "a", "c", "a"):  # uses: a 4, b 2, c 1; least recent: b
        memory.adapters.pin(name)
        memory.adapters.unpin(name)
    assert memory.reclaimer.choose_victim().key == victim
    memory.check()


def test_idle_policy_evicts_when_the_last_pin_goes():
    memory = make(policy="idle")
    add(memory, "a", 2)
    load(memory, "a")
    memory.adapters.pin("a")
    memory.adapters.pin("a")
    memory.adapters.unpin("a")
    assert memory.adapters.resident() == ["a"]
    memory.adapters.unpin("a")
    assert memory.adapters.resident() == []
    assert isinstance(memory.adapters.take_effects()[-1], EvictAdapter)
    memory.check()


def test_cached_kv_and_idle_adapters_compete_under_one_lru_order():
    memory = make(num_pages=8)
    kv, adapters = memory.kv, memory.adapters
    add(memory, "old", 2)
    add(memory, "new", 4)
    load(memory, "old")
    adapters.pin("old")
    adapters.unpin("old")  # "old" idle since now
    kv.open("s", list(range(8)))
    kv.grow("s", 8)
    kv.commit("s", list(range(8)))
    kv.free("s")  # two cached blocks, more recent than "old"
    assert memory.occupancy() == {"free": 4, "kv": 0, "cached_kv": 2, "adapter": 2}
    assert load(memory, "new") == Residency.LOADING  # 4 free pages: no eviction
    kv.open("t")
    assert kv.grow("t", 8)  # needs 2 pages: evicts "old" (older), keeps the cached blocks
    assert adapters.resident() == ["new"] and kv.match_prefix(list(range(8))) == [2, 3]
    kv.open("u")
    assert kv.grow("u", 4)  # now the cached tail goes first
    assert kv.match_prefix(list(range(8))) == [2]
    assert memory.reclaimer.evictions == {"kv": 1, "adapter": 1}
    memory.check()


def test_evicting_an_adapter_invalidates_its_cached_kv():
    memory = make(num_pages=16)
    add(memory, "a", 2, digest="sha-a")
    add(memory, "twin", 2, digest="sha-a")  # same weights under another name
    load(memory, "a")
    load(memory, "twin")
    prompt = list(range(8))
    memory.kv.open("s", prompt, "sha-a")
    memory.kv.grow("s", 8)
    memory.kv.commit("s", prompt)
    memory.kv.free("s")
    memory.adapters.evict("a")
    assert memory.kv.match_prefix(prompt, "sha-a") == [4, 5]  # twin still resident
    memory.adapters.evict("twin")
    assert memory.kv.match_prefix(prompt, "sha-a") == []
    assert memory.occupancy()["cached_kv"] == 0
    memory.check()


def test_protect_keeps_what_the_next_step_needs():
    memory = make(num_pages=8)
    for name, rank in (("a", 4), ("b", 4), ("c", 4)):
        add(memory, name, rank)
    load(memory, "a")
    load(memory, "b")
    assert load(memory, "c", protect=frozenset({("adapter", "a")})) == Residency.LOADING
    assert memory.adapters.resident() == ["a", "c"]
    assert memory.adapters.request("b", protect=frozenset({("adapter", "a"), ("adapter", "c")})) \
        == Residency.NO_SPACE
    memory.check()


def test_host_cache_serves_reloads_and_respects_its_budget():
    memory = make(num_pages=4, host_bytes=2 * 4 * 512 * 4 * 2)  # room for two 4-page adapters' copies
    for name in ("a", "b", "c"):
        add(memory, name, 4)
    load(memory, "a")
    load(memory, "b")  # evicts a (pool holds one)
    assert load(memory, "a") == Residency.LOADING
    assert memory.adapters.stats.loads_from_host == 1
    load(memory, "c")  # host cache full: drops the least recently used copy, b
    assert memory.adapters.host.names() == ["a", "c"]
    memory.check()


def test_host_cache_drop_is_an_effect():
    memory = make(num_pages=4, host_bytes=4 * 512 * 4 * 2)
    add(memory, "a", 4)
    add(memory, "b", 4)
    memory.adapters.request("a")
    memory.adapters.take_effects()
    memory.adapters.load_done("a")
    memory.adapters.request("b")
    effects = memory.adapters.take_effects()
    assert [type(e) for e in effects] == [EvictAdapter, DropHostCopy, LoadAdapter]
    assert effects[1].name == "a" and effects[2].cache_on_host


def test_load_failure_returns_the_pages():
    memory = make()
    add(memory, "a", 4)
    memory.adapters.request("a")
    memory.adapters.load_failed("a")
    assert memory.occupancy()["adapter"] == 0 and memory.adapters.resident() == []
    assert memory.adapters.stats.load_failures == 1
    memory.check()


def test_slots_are_reused_lowest_first():
    memory = make(num_pages=16)
    for name in "abc":
        add(memory, name, 2)
        load(memory, name)
    memory.adapters.evict("a")
    memory.adapters.evict("b")
    add(memory, "d", 2)
    load(memory, "d")
    assert memory.adapters.get("d").slot == 0 and memory.adapters.get("c").slot == 2


def test_bad_calls_raise_and_change_nothing():
    memory = make(max_rank=8)
    add(memory, "a", 2)
    with pytest.raises(AdapterExistsError):
        add(memory, "a", 2)
    with pytest.raises(AdapterRankError, match="max_rank=8"):
        add(memory, "big", 16)
    with pytest.raises(UnknownAdapterError, match="'nope'"):
        memory.adapters.request("nope")
    with pytest.raises(AdapterError, match="non-empty"):
        memory.adapters.register("", synthetic_info(MODEL, 2))
    with pytest.raises(AdapterError, match="not loaded"):
        memory.adapters.pin("a")
    with pytest.raises(AdapterError, match="no load in flight"):
        memory.adapters.load_done("a")
    load(memory, "a")
    with pytest.raises(AdapterError, match="not pinned"):
        memory.adapters.unpin("a")
    memory.adapters.pin("a")
    with pytest.raises(AdapterBusyError):
        memory.adapters.evict("a")
    with pytest.raises(AdapterBusyError):
        memory.adapters.unregister("a")
    assert memory.adapters.resident() == ["a"]
    memory.check()


def test_an_adapter_larger_than_the_pool_is_refused_at_registration():
    memory = make(num_pages=4)
    with pytest.raises(AdapterShapeError, match="needs 8 pages"):
        add(memory, "huge", 8)
    assert "huge" not in memory.adapters


def test_unregister_evicts_and_drops_the_host_copy():
    memory = make()
    add(memory, "a", 2)
    load(memory, "a")
    memory.adapters.unregister("a")
    assert [type(e) for e in memory.adapters.take_effects()] == [EvictAdapter, DropHostCopy]
    assert memory.occupancy()["free"] == 16 and "a" not in memory.adapters
    memory.check()


def test_a_loading_adapter_cannot_be_pinned_or_evicted():
    memory = make()
    add(memory, "a", 2)
    memory.adapters.request("a")
    with pytest.raises(AdapterError, match="not loaded"):
        memory.adapters.pin("a")
    with pytest.raises(AdapterBusyError, match="loading"):
        memory.adapters.evict("a")
    assert memory.reclaimer.choose_victim() is None  # not a reclaim candidate while its copy runs
    memory.adapters.load_done("a")
    memory.adapters.pin("a")
    memory.check()


def test_add_many_and_ticks_equal_one_at_a_time():
    batched, single = make().reclaimer, make().reclaimer
    ticks = list(batched.ticks(3))
    assert ticks == [single.tick() for _ in range(3)] and batched.tick() == single.tick() == 4
    cands = [Candidate(KV_BLOCK, page, 1, t, t, 1, 0.0) for page, t in zip((5, 3, 9), (3, 1, 2))]
    batched.add_many(cands)
    for cand in cands:
        single.add(cand)
    assert batched.candidates() == single.candidates() and batched.evictable_pages == 3
    order = []
    for r in (batched, single):
        keys = []
        while (victim := r.choose_victim()) is not None:
            keys.append(victim.key)
            r.remove(victim.kind, victim.key)
        order.append(keys)
    assert order == [[3, 9, 5], [3, 9, 5]]
    batched.add(cands[0])
    with pytest.raises(ValueError, match="already evictable"):
        batched.add_many([cands[0]])


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo"])
@pytest.mark.parametrize("seed", range(3))
def test_victims_come_in_the_policys_order_whether_keys_arrive_in_order_or_not(policy, seed):
    """The reclaimer's heap + ascending run give exactly the (priority, arrival) order, with lazy removal."""
    rng = random.Random(seed)
    pool = PagePool(64)
    reclaimer = Reclaimer(pool, make_policy(policy))
    evicted = []

    def evict(page):
        evicted.append(page)
        pool.drop(page)

    reclaimer.register_owner("kv", evict)
    live = {}  # page -> (priority, arrival): the order victims must come in
    for arrival in range(1500):
        action = rng.random()
        if action < 0.5 and pool.num_free:
            [page] = pool.alloc(1)
            pool.cache(page)
            newest = reclaimer.tick()
            tick = newest if rng.random() < 0.7 else rng.randrange(newest)  # mostly in order, as under LRU
            cand = Candidate("kv", page, 1, tick, tick, rng.randrange(4), 0.0)
            reclaimer.add(cand)
            live[page] = (reclaimer.policy.priority(cand), arrival)
        elif action < 0.65 and live:
            page = rng.choice(sorted(live))
            reclaimer.remove("kv", page)
            pool.reuse(page)
            pool.free([page])
            del live[page]
        elif live:
            protect = frozenset(("kv", p) for p in rng.sample(sorted(live), min(2, len(live))))
            order = [page for _, page in sorted((key, page) for page, key in live.items()
                                                if ("kv", page) not in protect)]
            victim = reclaimer.choose_victim(protect)
            assert (victim.key if victim else None) == (order[0] if order else None)
            want = rng.randrange(1, 4)
            assert reclaimer.reclaim(want, protect) == (len(order) >= want)
            assert evicted == (order[:want] if len(order) >= want else [])
            for page in evicted:
                del live[page]
            evicted.clear()
        reclaimer.check()
