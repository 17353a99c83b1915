"""A short tour of unipage: ``python -m unipage.demo``.

Part 1, the unified pool: writes four random PEFT adapters for a small
Qwen3-MoE-shaped model (both MoE adapter formats, different ranks, one
attention-only), registers them through the real loader, serves KV for a few
sequences (one hits the prefix cache), makes adapters resident and shows
memory flowing between KV and adapters under one eviction policy as pressure
grows.

Part 2, the engine: writes a random checkpoint of that model, and
`unipage.LLM` generates for a batch in which every prompt has a different
adapter (or none), then checks that each sequence alone gives the same tokens.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from unipage import LLM, SamplingParams
from unipage.adapter_pack import gather_adapter
from unipage.adapters import Residency
from unipage.config import LoRAConfig, ModelConfig, PoolConfig, UnipageConfig
from unipage.memory import UnifiedMemory
from unipage.models.random_checkpoint import write_random_checkpoint
from unipage.peft_io import load_adapter_weights
from unipage.peft_write import write_random_adapter
from unipage.storage import PoolStorage

MODEL = ModelConfig(num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=32,
                    num_experts=8, top_k=2, expert_intermediate_size=128, dtype="float32")
ADAPTERS = {  # name: (rank, alpha, targets, expert format)
    "sql-r8": (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "experts"), "per_expert"),
    "chat-r16": (16, 16, ("q_proj", "v_proj", "experts"), "fused"),
    "math-r16": (16, 32, ("q_proj", "k_proj", "v_proj", "o_proj", "experts"), "per_expert"),
    "style-r32": (32, 64, ("q_proj", "k_proj", "v_proj", "o_proj"), "per_expert"),
}


def show(memory: UnifiedMemory, what: str) -> None:
    occ = memory.occupancy()
    bar = "".join(ch * (occ[k] * 40 // memory.pool.num_pages)
                  for k, ch in (("kv", "K"), ("cached_kv", "c"), ("adapter", "A"), ("free", ".")))
    resident = ",".join(memory.adapters.resident()) or "-"
    print(f"{what:<64} [{bar:<40}] free={occ['free']:>3} kv={occ['kv']:>3} "
          f"cached={occ['cached_kv']:>3} adapter={occ['adapter']:>3}  resident: {resident}")


def make_resident(memory: UnifiedMemory, storage: PoolStorage, name: str) -> str:
    """Request ``name`` and perform the resulting loads and evictions at once (CPU: synchronous)."""
    state = memory.adapters.request(name)
    result = storage.apply(memory.adapters.take_effects())
    for done in result.done:
        memory.adapters.load_done(done)
    for failed, reason in result.failed:
        memory.adapters.load_failed(failed)
        print(f"  load of {failed} failed: {reason}")
    return {Residency.READY: "already resident", Residency.LOADING: "loaded",
            Residency.NO_SPACE: "no space"}[state]


def register_adapters(memory: UnifiedMemory, root: str) -> None:
    for index, (name, (rank, alpha, targets, fmt)) in enumerate(ADAPTERS.items()):
        path = os.path.join(root, name)
        if not os.path.exists(os.path.join(path, "adapter_model.safetensors")):
            write_random_adapter(path, MODEL, rank=rank, alpha=alpha, targets=targets,
                                 expert_format=fmt, seed=index)
        record = memory.register_adapter(name, path)
        info = record.info
        print(f"registered {name:<10} rank {info.max_rank:>2}  {fmt:<10} {record.num_pages:>3} pages "
              f"({record.nbytes / 2**20:.1f} MiB)  digest {info.digest[:12]}")


def run(root: str, num_pages: int, policy: str) -> UnifiedMemory:
    config = UnipageConfig(MODEL, PoolConfig(block_tokens=16, num_pages=num_pages),
                           LoRAConfig(max_rank=64, eviction_policy=policy, host_cache_bytes=64 << 20,
                                      adapter_roots=(root,)))
    memory = UnifiedMemory(config)
    storage = PoolStorage(config)
    print(f"pool: {num_pages} pages x {config.page_elems} elements x {MODEL.num_layers} layers "
          f"({storage.pool.numel() * storage.pool.element_size() / 2**20:.0f} MiB), policy {policy}\n")
    register_adapters(memory, root)
    print()
    kv, adapters = memory.kv, memory.adapters
    system = list(range(1000, 1096))  # a 96-token shared system prompt
    for seq, adapter in (("req-1", "sql-r8"), ("req-2", "sql-r8")):
        make_resident(memory, storage, adapter)
        adapters.pin(adapter)
        salt = adapters.get(adapter).info.digest
        hit = kv.open(seq, system + [seq == "req-2"] * 30, salt)
        kv.grow(seq, len(system) + 30)
        kv.commit(seq, system + [seq == "req-2"] * 30)
        show(memory, f"{seq} on {adapter}: {hit} prompt tokens from cache")
    check_gather(memory, storage, "sql-r8")
    for seq in ("req-1", "req-2"):
        kv.free(seq)
        adapters.unpin("sql-r8")
    show(memory, "both finish: their full blocks stay cached")
    for name in ("chat-r16", "math-r16", "style-r32", "sql-r8"):
        before = dict(memory.reclaimer.evictions)
        state = make_resident(memory, storage, name)
        freed = {k: memory.reclaimer.evictions[k] - before.get(k, 0) for k in before}
        show(memory, f"make {name} resident ({state}; evicted {freed['adapter']} adapters, "
                     f"{freed['kv']} blocks)")
    memory.check()
    stats = adapters.stats
    print(f"\nloads {stats.loads} (from host cache {stats.loads_from_host}), "
          f"{stats.bytes_loaded / 2**20:.1f} MiB copied, evictions {stats.evictions}, "
          f"prefix blocks reused {kv.hits}; all pool invariants hold")
    return memory


def check_gather(memory: UnifiedMemory, storage: PoolStorage, name: str) -> None:
    record = memory.adapters.get(name)
    expect = load_adapter_weights(record.info, MODEL)
    got = gather_adapter(storage.pool, record.pages, record.layout)
    same = got.keys() == expect.keys() and all(
        torch.equal(got[k].a, expect[k].a) and all(map(torch.equal, got[k].b, expect[k].b)) for k in expect)
    print(f"  {name}: {len(expect)} LoRA matrix groups read back through its page table "
          f"{record.pages[:4]}...: {'identical to the files' if same else 'MISMATCH'}")
    if not same:
        raise SystemExit(1)


def serve(root: str, policy: str) -> None:
    """Part 2: generate with a different adapter per prompt, then each prompt alone."""
    print("\n--- engine: one batch, a different adapter per prompt ---")
    model_dir = write_random_checkpoint(os.path.join(root, "model"), MODEL)
    llm = LLM(model_dir, {name: os.path.join(root, name) for name in ADAPTERS}, device="cpu",
              pool=PoolConfig(block_tokens=16, num_pages=400),
              lora=LoRAConfig(max_rank=64, max_adapters_per_batch=4, eviction_policy=policy,
                              adapter_roots=(root,)))
    names = [*ADAPTERS, None, "sql-r8"]
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(8 + 5 * i)] for i in range(len(names))]
    greedy = SamplingParams(temperature=0)
    start = time.perf_counter()
    outs = llm.generate(prompts, greedy, adapters=names, max_tokens=16)
    wall = time.perf_counter() - start
    for out in outs:
        print(f"  {out.adapter or '(base model)':<12} prompt {len(out.prompt_token_ids):>2} tokens -> "
              f"{out.token_ids[:8]}... ({out.finish_reason})")
    stats = llm.engine.scheduler.stats
    print(f"  {sum(len(o.token_ids) for o in outs)} tokens in {stats.steps} steps, {wall:.2f} s on CPU "
          f"(torch reference kernels)")
    alone = [llm.generate(p, greedy, adapter=n, max_tokens=16)[0].token_ids for p, n in zip(prompts, names)]
    same = all(a == o.token_ids for a, o in zip(alone, outs))
    print(f"  each prompt alone gives {'the same tokens' if same else 'DIFFERENT tokens'} as in the mixed batch")
    if not same:
        raise SystemExit(1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter-dir", default=None, help="where to write the demo adapters "
                        "(default: a temporary directory)")
    parser.add_argument("--pages", type=int, default=160, help="pool size in pages")
    parser.add_argument("--policy", default="lru", help="eviction policy: lru, lfu, fifo, size, cost, idle")
    args = parser.parse_args(argv)
    if args.adapter_dir:
        root = os.path.realpath(args.adapter_dir)
        run(root, args.pages, args.policy)
        serve(root, args.policy)
        return
    with tempfile.TemporaryDirectory(prefix="unipage-demo-") as root:
        run(os.path.realpath(root), args.pages, args.policy)
        serve(os.path.realpath(root), args.policy)


if __name__ == "__main__":
    main()
