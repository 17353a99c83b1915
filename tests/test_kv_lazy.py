"""Lazy prefix hashing: a KV manager that hashes blocks only when a lookup or a second chain can tell
behaves exactly as one that hashes every block at commit (``lazy_hashing = False``).

Random walks over shared and unshared prefixes, two salts, prefix hits, decode commits, frees, window
slides, invalidations and reclaim under pressure, on a plain manager, a windowed one and a `GroupedKV`,
under every built-in eviction policy: every return value, block table, page state, reclaim candidate
(with its stamps) and eviction count must agree after every operation.
"""

import random

import pytest

from unipage.eviction import POLICIES, make_policy
from unipage.kv import KVManager, block_hashes
from unipage.kv_groups import GroupedKV
from unipage.pool import PagePool
from unipage.reclaim import Reclaimer

B = 4
BUILT_IN = sorted(name for name, cls in POLICIES.items() if cls.__module__ == "unipage.eviction")
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 12, []]


def make(kind: str, policy: str, lazy: bool, num_pages: int):
    pool = PagePool(num_pages)
    reclaimer = Reclaimer(pool, make_policy(policy))
    if kind == "grouped":
        kv = GroupedKV(pool, reclaimer, B, window=6)
        managers = (kv.full, kv.windowed)
    else:
        kv = KVManager(pool, reclaimer, B, window=6 if kind == "window" else 0)
        managers = (kv,)
    for manager in managers:
        manager.lazy_hashing = lazy
    return pool, reclaimer, kv, managers


def state(pool, reclaimer, kv, managers, seqs) -> tuple:
    pages = range(pool.num_pages)
    cands = sorted((c.kind, str(c.key), c.last_used, c.inserted, c.uses) for c in reclaimer.candidates())
    tables = {s: (list(kv.block_table(s)), list(kv.window_table(s)) if hasattr(kv, "window_table") else None)
              for s in seqs}
    registered = [[m.registered(p) for p in pages] for m in managers]
    return ([pool.kind(p) for p in pages], [pool.refcount(p) for p in pages], cands, dict(reclaimer.evictions),
            tables, registered, kv.hits)


def walk(kind: str, policy: str, seed: int, steps: int = 120) -> None:
    rng = random.Random(seed)
    num_pages = rng.randrange(8, 24)
    runs = [make(kind, policy, lazy, num_pages) for lazy in (True, False)]
    seqs: dict[int, list[int]] = {}  # open sequence -> its tokens (committed as they come)
    next_id = 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.3 or not seqs:
            tokens = rng.choice(PREFIXES) + [rng.randrange(50, 53) for _ in range(rng.randrange(0, 9))]
            tokens = tokens or [5]
            salt = rng.choice(("", "s"))
            cap = rng.choice((None, len(tokens) - 1))
            part, outs = rng.random(), []  # plain: commit a part of the prompt first
            for _, _, kv, _ in runs:
                hit = kv.open(next_id, tokens, salt, max_cached_tokens=cap)
                grown = kv.grow(next_id, len(tokens))
                if grown:
                    kv.commit(next_id, tokens, hit + int(part * (len(tokens) - hit)) if kind == "plain" else None)
                outs.append((hit, grown))
            assert outs[0] == outs[1]
            seqs[next_id] = tokens
            next_id += 1
        elif op < 0.6:
            seq = rng.choice(sorted(seqs))
            grown = seqs[seq] + [rng.randrange(50, 52) for _ in range(rng.randrange(1, 6))]
            outs = []
            for _, _, kv, _ in runs:
                ok = kv.grow(seq, len(grown))
                if ok:
                    kv.slide(seq, len(grown) - 1)
                    kv.commit(seq, grown)
                outs.append(ok)
            assert outs[0] == outs[1]
            if outs[0]:
                seqs[seq] = grown
        elif op < 0.8:
            seq = rng.choice(sorted(seqs))
            for _, _, kv, _ in runs:
                kv.free(seq)
            del seqs[seq]
        elif op < 0.95:
            probe = rng.choice(PREFIXES) + [rng.randrange(50, 53) for _ in range(rng.randrange(0, 6))]
            salt = rng.choice(("", "s"))
            assert runs[0][2].match_prefix(probe, salt) == runs[1][2].match_prefix(probe, salt)
        else:
            salt = rng.choice(("", "s"))
            assert runs[0][2].invalidate(salt) == runs[1][2].invalidate(salt)
        for pool, reclaimer, kv, _ in runs:
            pool.check()
            reclaimer.check()
            kv.check()
        assert state(*runs[0], seqs) == state(*runs[1], seqs)
    for lazy, eager in zip(runs[0][3], runs[1][3]):  # every registered block hashes as the eager one did
        pages = [p for p in range(num_pages) if eager.registered(p)]
        assert [lazy.block_hash(p) for p in pages] == [eager.block_hash(p) for p in pages]
    runs[0][2].check()


@pytest.mark.parametrize("policy", BUILT_IN)
@pytest.mark.parametrize("kind", ["plain", "window", "grouped"])
def test_lazy_hashing_behaves_as_hashing_at_commit(kind, policy):
    for seed in range(25):
        walk(kind, policy, seed)


def test_an_unshared_chain_hashes_only_its_first_block_until_looked_up():
    pool = PagePool(16)
    kv = KVManager(pool, Reclaimer(pool, make_policy("lru")), B)
    tokens = list(range(20))
    kv.open("a")
    kv.grow("a", 20)
    kv.commit("a", tokens)
    assert len(kv._by_hash) == 1 and kv._seqs["a"].committed == 5
    kv.open("b")
    kv.grow("b", 5)
    kv.commit("b", [99] * 5)  # another root: "a" stays lazy
    assert len(kv._by_hash) == 2
    assert kv.match_prefix(tokens) == [0, 1, 2, 3, 4]  # the lookup reached a's root: a is hashed
    assert len(kv._by_hash) == 6 and kv.block_hash(4) == block_hashes(tokens, B)[4]
    kv.free("a")
    kv.check()


def test_a_second_chain_under_a_root_makes_it_eager():
    pool = PagePool(16)
    kv = KVManager(pool, Reclaimer(pool, make_policy("lru")), B)
    tokens = list(range(12))
    for seq in ("a", "b"):  # both compute the same blocks: b's are not registered (a's came first)
        kv.open(seq)
        kv.grow(seq, 12)
    kv.commit("a", tokens)
    kv.commit("b", tokens)
    assert [kv.registered(p) for p in range(6)] == [True] * 3 + [False] * 3
    assert kv._roots[block_hashes(tokens, B)[0]].lone is None
    kv.free("a")
    kv.free("b")
    assert pool.occupancy()["cached_kv"] == 3 and pool.num_free == 13
    kv.check()
