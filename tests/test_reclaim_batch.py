"""Batched allocation gives exactly what one page at a time gives.

`Reclaimer.alloc_each(n)` must hand out the pages of ``n`` calls of ``alloc(1)``, in their order, evicting the
same victims (KV blocks in runs from the lane, adapters whose eviction drops cached blocks), or change nothing
when they do not all fit; `KVManager.grow_each` and `GroupedKV.grow_each` must match `grow` one sequence at a
time.  Random walks under every built-in eviction policy, with and without the KV lane.
"""

import random

import pytest
from test_reclaim_lane import BUILT_IN, SALTS, Side, cache_block, idle_adapter

from unipage.eviction import KV_BLOCK, Candidate, make_policy
from unipage.kv import KVManager
from unipage.kv_groups import GroupedKV
from unipage.pool import PagePool
from unipage.reclaim import Reclaimer


def offer(sides, rng, tick) -> None:
    """Cache a KV block or make an adapter idle, the same on every side."""
    first = sides[0]
    stamp = tick if rng.random() < 0.7 else rng.randrange(max(1, tick - 6), tick + 1)
    uses, cost = rng.randrange(1, 4), rng.choice((0.0, 0.5, 2.0))
    if rng.random() < 0.8 and first.pool.num_free:
        cache_block(sides, rng.randrange(SALTS), stamp, uses, cost)
        return
    name = f"a{rng.randrange(SALTS)}"
    size = rng.randrange(1, 4)
    if name not in first.adapter_pages and first.pool.num_free >= size:
        idle_adapter(sides, name, size, stamp, uses, cost)


def walk(policy: str, lane: bool, seed: int, steps: int = 300) -> None:
    rng = random.Random(seed)
    batched, single = sides = [Side(policy, lane), Side(policy, lane)]
    held: list[list[int]] = [[], []]  # KV pages handed out, per side
    for _ in range(steps):
        tick = batched.reclaimer.tick()
        single.reclaimer.tick()
        op = rng.random()
        if op < 0.6:
            offer(sides, rng, tick)
        elif op < 0.75 and held[0]:
            count = rng.randrange(1, len(held[0]) + 1)
            for side, pages in zip(sides, held):
                side.pool.free(pages[:count])
                del pages[:count]
        else:
            n = rng.randrange(1, 8)
            fits = n <= single.pool.num_free + single.reclaimer.evictable_pages
            got = batched.reclaimer.alloc_each(n)
            if fits:
                want = [single.reclaimer.alloc(1)[0] for _ in range(n)]
                assert got == want
                held[0] += got
                held[1] += want
            else:
                assert got is None
        for side in sides:
            side.pool.check()
            side.reclaimer.check()
        assert batched.state() == single.state()
    assert batched.evicted and any(isinstance(key, str) for key in batched.evicted)  # blocks and adapters


@pytest.mark.parametrize("policy", BUILT_IN)
@pytest.mark.parametrize("lane", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_alloc_each_hands_out_what_alloc_one_at_a_time_does(policy, lane, seed):
    walk(policy, lane, seed)


def kv_side(kind: str, pages: int):
    pool = PagePool(pages)
    reclaimer = Reclaimer(pool, make_policy("lru"))
    kv = GroupedKV(pool, reclaimer, 4, window=6) if kind == "grouped" else KVManager(pool, reclaimer, 4)
    return pool, reclaimer, kv


@pytest.mark.parametrize("kind", ["plain", "grouped"])
@pytest.mark.parametrize("seed", range(4))
def test_grow_each_grows_as_grow_one_sequence_at_a_time_does(kind, seed):
    rng = random.Random(seed)
    batched, single = kv_side(kind, 40), kv_side(kind, 40)
    tokens: dict[int, list[int]] = {}
    for step in range(120):
        op = rng.random()
        if op < 0.3 or not tokens:
            prompt = [rng.randrange(1, 4) for _ in range(rng.randrange(1, 10))]
            outs = []
            for _, _, kv in (batched, single):
                hit = kv.open(step, prompt, max_cached_tokens=len(prompt) - 1)
                grown = kv.grow(step, len(prompt))
                if grown:
                    kv.commit(step, prompt)
                else:
                    kv.free(step)
                outs.append((hit, grown))
            assert outs[0] == outs[1]
            if outs[0][1]:
                tokens[step] = prompt
        elif op < 0.45:
            seq = rng.choice(sorted(tokens))
            for _, _, kv in (batched, single):
                kv.free(seq)
            del tokens[seq]
        else:
            seqs = rng.sample(sorted(tokens), rng.randrange(1, len(tokens) + 1))
            need = len(seqs) * (2 if kind == "grouped" else 1)
            fits = need <= single[0].num_free + single[1].evictable_pages
            assert batched[2].grow_each(seqs) == fits
            if fits:
                for seq in seqs:
                    assert single[2].grow(seq, (len(single[2].block_table(seq)) + 1) * 4)
            for seq in seqs:  # the new blocks hold tokens and are committed
                tokens[seq] = tokens[seq] + [rng.randrange(1, 4) for _ in range(4)]
                for _, _, kv in (batched, single):
                    kv.commit(seq, tokens[seq], min(len(tokens[seq]), len(kv.block_table(seq)) * 4))
        for pool, reclaimer, kv in (batched, single):
            pool.check()
            reclaimer.check()
            kv.check()
        assert list(batched[0].free_stack()) == list(single[0].free_stack())
        assert {s: list(batched[2].block_table(s)) for s in tokens} == \
            {s: list(single[2].block_table(s)) for s in tokens}
        assert dict(batched[1].evictions) == dict(single[1].evictions)


@pytest.mark.parametrize("policy", BUILT_IN)
@pytest.mark.parametrize("seed", range(3))
def test_add_used_now_stamps_and_adds_as_ticks_and_add_many(policy, seed):
    rng = random.Random(seed)
    batched, single = sides = [Side(policy, True), Side(policy, True)]
    for _ in range(200):
        tick = batched.reclaimer.tick()
        single.reclaimer.tick()
        op = rng.random()
        if op < 0.3:
            offer(sides, rng, tick)
        elif op < 0.7 and batched.pool.num_free:
            count = rng.randrange(1, batched.pool.num_free + 1)
            salt = rng.randrange(SALTS)
            for side in sides:
                pages = side.pool.alloc(count)
                side.pool.cache_many(pages)
                side.salt.update(dict.fromkeys(pages, salt))
            blocks = [[Candidate(KV_BLOCK, page, 1, 0, 0, 1, 0.0) for page in pages] for _ in sides]
            batched.reclaimer.add_used_now(blocks[0])
            for cand, now in zip(blocks[1], single.reclaimer.ticks(count)):
                cand.last_used = cand.inserted = now
            single.reclaimer.add_many(blocks[1])
        else:
            want = rng.randrange(1, 6)
            assert batched.reclaimer.reclaim(want) == single.reclaimer.reclaim(want)
        for side in sides:
            side.reclaimer.check()
        assert batched.state() == single.state()
        assert batched.reclaimer.tick() == single.reclaimer.tick()
    with pytest.raises(ValueError):  # a block offered twice
        page = next(iter(batched.salt))
        batched.reclaimer.add_used_now([Candidate(KV_BLOCK, page, 1, 0, 0, 1, 0.0)])
    batched.reclaimer.check()
