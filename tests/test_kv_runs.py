"""A freed lone chain cached as one `PageRun` behaves exactly as its blocks cached one by one.

Random walks on two KV managers over their own pools, one caching freed lone chains as runs and one
registering each block (``_use_runs = False``), with idle adapters in the same LRU order: prompts with and
without shared prefixes, decode commits, frees, lookups, invalidations and allocations under pressure that
evict from the front of runs, between adapters.  Every return value, page state, the free stack's order,
reclaim candidate (with its stamps), eviction count and registration must agree after every operation.
"""

import random

from unipage.eviction import ADAPTER, KV_BLOCK, Candidate, make_policy
from unipage.kv import KVManager
from unipage.pool import PageKind, PagePool
from unipage.reclaim import PageRun, Reclaimer

B = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [7] * 12, []]


class Side:
    def __init__(self, num_pages: int, runs: bool) -> None:
        self.pool = PagePool(num_pages)
        self.reclaimer = Reclaimer(self.pool, make_policy("lru"))
        self.kv = KVManager(self.pool, self.reclaimer, B)
        self.kv._use_runs = runs
        self.adapters: dict[str, list[int]] = {}  # idle adapter -> its pages
        self.reclaimer.register_owner(ADAPTER, self.evict_adapter)

    def evict_adapter(self, name: str) -> None:
        self.pool.free(self.adapters.pop(name))

    def idle_adapter(self, name: str, pages: int) -> bool:
        got = self.reclaimer.alloc(pages, PageKind.ADAPTER)
        if got is None:
            return False
        self.adapters[name] = got
        [stamp] = self.reclaimer.ticks(1)
        self.reclaimer.add(Candidate(ADAPTER, name, pages, stamp, stamp, 1, 0.0))
        return True

    def state(self, seqs) -> tuple:
        pages = range(self.pool.num_pages)
        cands = sorted((c.kind, str(c.key), c.pages, c.last_used, c.inserted, c.uses)
                       for c in self.reclaimer.candidates())
        return ([self.pool.kind(p) for p in pages], [self.pool.refcount(p) for p in pages],
                list(self.pool.free_stack()), cands, dict(self.reclaimer.evictions),
                {s: list(self.kv.block_table(s)) for s in seqs}, [self.kv.registered(p) for p in pages],
                self.kv.hits, sorted(self.adapters))


def walk(seed: int, steps: int = 150) -> int:
    """One random walk; returns how many runs it made."""
    rng = random.Random(seed)
    num_pages = rng.randrange(10, 28)
    sides = [Side(num_pages, runs) for runs in (True, False)]
    seqs: dict[int, list[int]] = {}
    made, next_id = 0, 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.3 or not seqs:
            tokens = rng.choice(PREFIXES) + [rng.randrange(50, 60) for _ in range(rng.randrange(1, 14))]
            salt = rng.choice(("", "s"))
            outs = []
            for side in sides:
                hit = side.kv.open(next_id, tokens, salt, max_cached_tokens=len(tokens) - 1)
                grown = side.kv.grow(next_id, len(tokens))
                if grown:
                    side.kv.commit(next_id, tokens)
                outs.append((hit, grown))
            assert outs[0] == outs[1]
            seqs[next_id] = tokens
            next_id += 1
        elif op < 0.55:
            seq = rng.choice(sorted(seqs))
            grown = seqs[seq] + [rng.randrange(50, 60) for _ in range(rng.randrange(1, 6))]
            outs = [side.kv.grow(seq, len(grown)) for side in sides]
            assert outs[0] == outs[1]
            if outs[0]:
                for side in sides:
                    side.kv.commit(seq, grown)
                seqs[seq] = grown
        elif op < 0.75:
            seq = rng.choice(sorted(seqs))
            for side in sides:
                side.kv.free(seq)
            made += sum(isinstance(c, PageRun) for c in sides[0].reclaimer._lane_cand)
            del seqs[seq]
        elif op < 0.8:
            name, pages = f"a{rng.randrange(4)}", rng.randrange(1, 4)
            if name not in sides[0].adapters:
                assert len({side.idle_adapter(name, pages) for side in sides}) == 1
        elif op < 0.9:  # a victim query and a reclaim, some cached blocks (maybe inside runs) protected
            blocks = sorted(c.key for c in sides[0].reclaimer.candidates() if c.kind == KV_BLOCK)
            protect = frozenset((KV_BLOCK, page) for page in rng.sample(blocks, min(len(blocks), 2)))
            victims = [side.reclaimer.choose_victim(protect) for side in sides]
            assert len({(v.kind, v.key, v.last_used) if v else None for v in victims}) == 1
            want = rng.randrange(1, 5)
            assert len({side.reclaimer.reclaim(want, protect) for side in sides}) == 1
            for side in sides:
                assert all(side.pool.kind(page) == PageKind.CACHED_KV for _, page in protect)
        elif op < 0.95:
            probe = rng.choice(PREFIXES) + [rng.randrange(50, 60) for _ in range(rng.randrange(0, 6))]
            salt = rng.choice(("", "s"))
            assert sides[0].kv.match_prefix(probe, salt) == sides[1].kv.match_prefix(probe, salt)
        else:
            salt = rng.choice(("", "s"))
            assert sides[0].kv.invalidate(salt) == sides[1].kv.invalidate(salt)
        for side in sides:
            side.pool.check()
            side.reclaimer.check()
            side.kv.check()
        assert sides[0].state(seqs) == sides[1].state(seqs)
    return made


def test_runs_behave_as_blocks_cached_one_by_one():
    assert sum(walk(seed) for seed in range(60)) > 0  # (the walks did cache runs)


def test_a_run_is_evicted_from_its_tail_and_split_by_a_lookup():
    pool = PagePool(6)
    reclaimer = Reclaimer(pool, make_policy("lru"))
    kv = KVManager(pool, reclaimer, B)
    tokens = list(range(16))  # 4 blocks: pages 0..3
    kv.open("a")
    kv.grow("a", 16)
    kv.commit("a", tokens)
    kv.free("a")
    [run] = kv._runs.values()
    assert run.run == [3, 2, 1, 0] and len(reclaimer.candidates()) == 4
    kv.open("b")
    assert kv.grow("b", 12)  # pages 4 and 5 were free; the run gives its first page (block 3) to make 3
    assert kv.block_table("b") == [3, 4, 5] and run.run == [2, 1, 0] and reclaimer.evictions[KV_BLOCK] == 1
    assert kv.match_prefix(tokens) == [0, 1, 2]  # the lookup split the run, hashed its blocks and found them
    assert not kv._runs and all(kv._blocks[p] is not None for p in (0, 1, 2))
    kv.check()
    reclaimer.check()
