"""CPU benchmark of the scheduler's bookkeeping per step, one JSON line per row.

    python benchmarks/scheduler.py [--out FILE] [--steps N] [--policy NAME ...]

Row ``calibration``: nanoseconds per iteration of a bare Python loop, to
compare machines.

Row ``scheduler_decode_step``: 256 running requests decoding with nothing
waiting (the best of five medians): the per-request cost of a step alone.

Row ``scheduler_step``: time of ``schedule()`` + ``update()`` for one step
(the fake executor between them is not timed) in steady state: 256 running
requests, 1,000 waiting (topped up after every step), 5,000 registered
adapters of which 64 are resident at the start, up to 128 distinct adapters
per batch, Llama-3.1-8B page geometry, a pool of 16,384 pages.  Prompts are
64..512 tokens, outputs 32..512 (no prefix sharing).  90% of requests use one
of the 64 hot adapters, 10% one of the 4,936 cold ones, so loads and
evictions happen all the time (the fake executor completes a load one step
after it starts).  Target: median
<= 200 us per step on one core.  One row per policy and admission mode, plus
FCFS without prefix caching.

Every run starts from a collected heap (the previous row's scheduler freed),
so rows do not depend on their order.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import random
import statistics
import sys
import time

try:
    from benchmarks.cpu import calibrate, commit
except ImportError:  # run as a script: benchmarks/ itself is on sys.path
    from cpu import calibrate, commit
from unipage.scheduler import (
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    StepResult,
)

from unipage.adapter_info import synthetic_info
from unipage.adapters import LoadAdapter
from unipage.config import LoRAConfig, ModelConfig, PoolConfig, UnipageConfig
from unipage.memory import UnifiedMemory

SEED = 0
MODEL = ModelConfig(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                    intermediate_size=14336)
RUNNING, WAITING, REGISTERED, RESIDENT, PAGES = 256, 1000, 5000, 64, 16384
HOT, ADAPTERS_PER_BATCH = 0.9, 128


def emit(record: dict, out) -> None:
    record = {"bench": "scheduler", "device": platform.processor() or platform.machine(),
              "machine": f"{platform.node()} ({os.cpu_count()} cpus)", "commit": commit(("unipage", "scheduler", "benchmarks/scheduler.py")),
              "python": sys.version.split()[0], "seed": SEED, "unix_time": round(time.time(), 3), **record}
    print(json.dumps(record), file=out, flush=True)


class FakeExecutor:
    """Samples a random token for every request that caught up; a load completes one step after it starts."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.loading: list[str] = []

    def run(self, out: SchedulerOutput, sched: Scheduler) -> StepResult:
        done, self.loading = self.loading, [e.name for e in out.adapter_effects if isinstance(e, LoadAdapter)]
        rand = self.rng.randrange
        sampled = []
        for rid in out.req_ids:
            req = sched.get(rid)
            sampled.append([rand(3, 32000)] if req.num_computed_tokens == req.num_tokens else [])
        return StepResult(sampled, loads_done=done)


class Workload:
    """90% of requests use one of the 64 hot adapters (resident at the start), 10% one of the 4,936 others."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.next = 0

    def request(self) -> Request:
        rng, i = self.rng, self.next
        self.next += 1
        adapter = rng.randrange(RESIDENT) if rng.random() < HOT else rng.randrange(RESIDENT, REGISTERED)
        prompt = [rng.randrange(3, 32000) for _ in range(rng.randrange(64, 513))]
        return Request(f"r{i}", prompt, adapter=f"a{adapter}", max_tokens=rng.randrange(32, 513),
                       stop_token_ids=(2,), tenant=f"t{i % 16}")


def build(policy: str, admission: str, prefix_caching: bool) -> tuple[Scheduler, Workload, FakeExecutor]:
    gc.collect()  # the last row's scheduler is garbage in reference cycles: left uncollected, it slows this row
    rng = random.Random(SEED)
    config = UnipageConfig(MODEL, PoolConfig(block_tokens=16, num_pages=PAGES, prefix_caching=prefix_caching),
                           LoRAConfig(max_rank=64, max_adapters_per_batch=ADAPTERS_PER_BATCH))
    memory = UnifiedMemory(config)
    infos = [synthetic_info(MODEL, rank) for rank in (8, 16)]
    for i in range(REGISTERED):
        memory.adapters.register(f"a{i}", dataclasses.replace(infos[i % 2], digest=f"d{i}"))
    for i in range(RESIDENT):
        memory.adapters.request(f"a{i}")
        memory.adapters.load_done(f"a{i}")
    memory.adapters.take_effects()
    sched_config = SchedulerConfig(max_model_len=4096, max_num_batched_tokens=2048, max_num_seqs=RUNNING,
                                   policy=policy, admission=admission, slo_ttft_s=30.0)
    return Scheduler(memory, sched_config), Workload(rng), FakeExecutor(rng)



MEMORY_CALLS = (("kv", ("open", "grow", "commit", "free", "match_prefix")),
                ("adapters", ("request", "pin", "unpin", "load_done", "take_effects")))


def instrument(sched: Scheduler) -> list[float]:
    """Time every call the scheduler makes into the memory layer; returns the running total (one cell)."""
    spent = [0.0]
    for owner, names in MEMORY_CALLS:
        obj = getattr(sched, owner)
        for name in names:
            def timed(*args, _f=getattr(obj, name), **kwargs):
                t0 = time.perf_counter()
                try:
                    return _f(*args, **kwargs)
                finally:
                    spent[0] += time.perf_counter() - t0
            setattr(obj, name, timed)
    return spent


def run(policy: str, admission: str, prefix_caching: bool, steps: int, warmup: int, timed_memory: bool) -> dict:
    sched, workload, executor = build(policy, admission, prefix_caching)
    spent = instrument(sched) if timed_memory else [0.0]
    times, memory, scheduled, admitted, loads, add_s = [], [], 0, 0, 0, 0.0
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        while sched.num_waiting < WAITING:
            sched.add(workload.request())
        t1 = time.perf_counter()
        spent[0] = 0.0
        out = sched.schedule()
        t2 = time.perf_counter()
        result = executor.run(out, sched)
        t3 = time.perf_counter()
        sched.update(result)
        t4 = time.perf_counter()
        if step >= warmup:
            times.append((t2 - t1) + (t4 - t3))
            memory.append(spent[0])
            add_s += t1 - t0
            scheduled += len(out.req_ids)
            admitted += len(out.new_requests)
            loads += len(out.adapter_loads)
    sched.check()
    return {"times": times, "memory": memory, "scheduled": scheduled / steps, "admitted": admitted / steps,
            "loads": loads / steps, "preemptions": sched.stats.preemptions, "add_us": add_s / steps * 1e6}


def bench(policy: str, admission: str = "optimistic", prefix_caching: bool = True, steps: int = 2000,
          warmup: int = 300) -> dict:
    clean = run(policy, admission, prefix_caching, steps, warmup, timed_memory=False)
    probed = run(policy, admission, prefix_caching, steps, warmup, timed_memory=True)  # same seed, same steps
    times = sorted(clean["times"])
    share = statistics.median(m / t for m, t in zip(probed["memory"], probed["times"]))
    return {"row": "scheduler_step", "policy": policy, "admission": admission, "prefix_caching": prefix_caching,
            "steps": steps, "running_target": RUNNING, "waiting": WAITING, "registered_adapters": REGISTERED,
            "resident_adapters_at_start": RESIDENT, "max_adapters_per_batch": ADAPTERS_PER_BATCH,
            "pool_pages": PAGES, "mean_scheduled_requests": round(clean["scheduled"], 1),
            "admitted_per_step": round(clean["admitted"], 2), "loads_per_step": round(clean["loads"], 2),
            "preemptions": clean["preemptions"],
            "median_us": round(statistics.median(times) * 1e6, 1),
            "p90_us": round(times[int(0.9 * len(times))] * 1e6, 1),
            "mean_us": round(statistics.fmean(times) * 1e6, 1),
            "memory_layer_share": round(share, 3),  # of a step's time, inside KVManager/AdapterManager calls
            "add_us_per_step": round(clean["add_us"], 1), "target_median_us": 200.0}


def bench_decode(prefix_caching: bool, steps: int = 100, repeats: int = 5) -> dict:
    """256 running requests decoding, nothing waiting: the per-request cost of a step alone."""
    sched, _, _ = build("fcfs", "optimistic", prefix_caching)
    rng = random.Random(SEED)
    for i in range(RUNNING):
        prompt = [rng.randrange(3, 32000) for _ in range(rng.randrange(64, 129))]
        sched.add(Request(f"d{i}", prompt, adapter=f"a{i % RESIDENT}", max_tokens=4000))
    while sched.num_waiting:  # admit and prefill everyone first
        out = sched.schedule()
        sched.update(StepResult([[7] if sched.get(r).num_computed_tokens == sched.get(r).num_tokens else []
                                 for r in out.req_ids]))
    medians = []
    for _ in range(repeats):
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = sched.schedule()
            t1 = time.perf_counter()
            result = StepResult([[7]] * len(out.req_ids))
            t2 = time.perf_counter()
            sched.update(result)
            times.append(t1 - t0 + time.perf_counter() - t2)
        medians.append(statistics.median(times))
    assert len(out.req_ids) == RUNNING and not sched.stats.preemptions
    return {"row": "scheduler_decode_step", "prefix_caching": prefix_caching, "running": RUNNING,
            "steps": steps * repeats, "median_us": round(min(medians) * 1e6, 1),
            "us_per_request": round(min(medians) / RUNNING * 1e6, 3)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=argparse.FileType("w"), default=sys.stdout)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--policy", nargs="*", default=["fcfs", "affinity", "vtc", "slo"])
    args = parser.parse_args(argv)
    gc.collect()
    emit({"row": "calibration", "python_loop_ns_per_iter": round(calibrate(), 2)}, args.out)
    for policy in args.policy:
        emit(bench(policy, steps=args.steps), args.out)
    emit(bench("fcfs", admission="reserve", steps=args.steps), args.out)
    emit(bench("fcfs", prefix_caching=False, steps=args.steps), args.out)
    for prefix_caching in (True, False):
        emit(bench_decode(prefix_caching), args.out)


if __name__ == "__main__":
    main()
