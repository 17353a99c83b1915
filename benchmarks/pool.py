"""CPU benchmark of the pool bookkeeping, one JSON line per row.

    python benchmarks/pool.py [--out FILE]

Rows:
- ``pool_alloc_free``: `PagePool` alloc and free of 1M pages, in calls of
  ``chunk`` pages (1 = a decode step growing one sequence by one block).
  Target: <= 2 us per page allocated or freed.
- ``victim_choice``: 10,000 registered and 1,000 resident idle adapters (plus
  10,000 cached KV blocks competing under the same policy); each request for a
  non-resident adapter must evict.  Times the policy's victim choice alone and
  the whole reclaim-and-load decision, per policy.  Target: <= 20 us per choice.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import sys
import time

from unipage.adapter_info import synthetic_info
from unipage.config import LoRAConfig, ModelConfig, PoolConfig, UnipageConfig
from unipage.eviction import POLICIES
from unipage.memory import UnifiedMemory
from unipage.pool import PagePool

SEED = 0
# Llama-3.1-8B shape: page = 16 tokens x 2 x 8 kv heads x 128 = 32768 elements.
MODEL = ModelConfig(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                    intermediate_size=14336)


def emit(record: dict, out) -> None:
    record = {"bench": "pool", "device": platform.processor() or platform.machine(),
              "python": sys.version.split()[0], "seed": SEED, "unix_time": round(time.time(), 3), **record}
    print(json.dumps(record), file=out, flush=True)


def bench_alloc_free(num_pages: int, chunk: int) -> dict:
    pool = PagePool(num_pages)
    held = []
    start = time.perf_counter()
    for _ in range(num_pages // chunk):
        held.append(pool.alloc(chunk))
    mid = time.perf_counter()
    for ids in held:
        pool.free(ids)
    end = time.perf_counter()
    pool.check()
    pages = num_pages // chunk * chunk
    return {"row": "pool_alloc_free", "pages": pages, "chunk": chunk,
            "alloc_us_per_page": round((mid - start) / pages * 1e6, 4),
            "free_us_per_page": round((end - mid) / pages * 1e6, 4), "target_us_per_page": 2.0}


def build_memory(policy: str, registered: int, resident: int, cached_blocks: int) -> UnifiedMemory:
    """A full pool: ``resident`` idle adapters of ranks 8/16/32 and ``cached_blocks`` cached KV blocks."""
    rng = random.Random(SEED)
    lora = LoRAConfig(max_rank=64, eviction_policy=policy)
    infos = [synthetic_info(MODEL, rank) for rank in (8, 16, 32)]
    probe = UnifiedMemory(UnipageConfig(MODEL, PoolConfig(num_pages=10**5), lora))
    sizes = [probe.adapters.register(f"p{i}", info).num_pages for i, info in enumerate(infos)]
    need = sum(sizes[i % 3] for i in range(resident)) + cached_blocks
    memory = UnifiedMemory(UnipageConfig(MODEL, PoolConfig(block_tokens=16, num_pages=need), lora))
    for i in range(registered):
        memory.adapters.register(f"a{i}", dataclasses.replace(infos[i % 3], digest=f"d{i}"))
    for i in range(resident):
        memory.adapters.request(f"a{i}")
        memory.adapters.load_done(f"a{i}")
        for _ in range(rng.randrange(4) if policy != "idle" else 0):  # idle: unpin evicts
            memory.adapters.pin(f"a{i}")
            memory.adapters.unpin(f"a{i}")
    for s in range(cached_blocks // 8):
        tokens = [s] * 128
        memory.kv.open(s, tokens)
        memory.kv.grow(s, 128)
        memory.kv.commit(s, tokens)
        memory.kv.free(s)
    memory.adapters.take_effects()
    return memory


def bench_victims(policy: str, registered=10_000, resident=1_000, cached_blocks=10_000,
                  rounds=2_000) -> dict:
    memory = build_memory(policy, registered, resident, cached_blocks)
    assert memory.pool.num_free == 0
    reclaimer, adapters = memory.reclaimer, memory.adapters
    choose = 0.0
    start = time.perf_counter()
    for i in range(rounds):
        name = f"a{resident + i}"
        t0 = time.perf_counter()
        reclaimer.choose_victim()
        choose += time.perf_counter() - t0
        adapters.request(name)
        adapters.load_done(name)
        adapters.take_effects()
    total = time.perf_counter() - start
    evictions = sum(reclaimer.evictions.values())
    memory.check()
    return {"row": "victim_choice", "policy": policy, "registered": registered, "resident": resident,
            "cached_kv_blocks": cached_blocks, "requests": rounds, "evictions": evictions,
            "choose_us": round(choose / rounds * 1e6, 3),
            "reclaim_and_load_us_per_request": round(total / rounds * 1e6, 3),
            "us_per_eviction": round(total / max(evictions, 1) * 1e6, 3), "target_us": 20.0}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=argparse.FileType("w"), default=sys.stdout)
    parser.add_argument("--pages", type=int, default=1 << 20)
    args = parser.parse_args(argv)
    for chunk in (1, 16, 256):
        emit(bench_alloc_free(args.pages, chunk), args.out)
    for policy in sorted(POLICIES):
        emit(bench_victims(policy), args.out)


if __name__ == "__main__":
    main()
