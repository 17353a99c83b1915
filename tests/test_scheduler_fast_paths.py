"""The scheduler's fast paths give exactly the steps of its general ones.

A seeded random workload (shared prefixes, adapters to load, aborts (some
while a step runs), stop
tokens, several tokens sampled at once, a pool tight enough to preempt) runs
twice — once as is, once with a fast path turned off — and every step's
output, every `RequestOutput` and the memory's state must agree.
"""

import dataclasses
import random

import pytest

from test_scheduler_support import MODEL, Clock
from unipage.adapter_info import synthetic_info
from unipage.adapters import LoadAdapter
from unipage.config import LoRAConfig, PoolConfig, UnipageConfig
from unipage.memory import UnifiedMemory
from unipage.scheduler import Request, Scheduler, SchedulerConfig, StepResult
from unipage.scheduler import admission as admission_module
from unipage.scheduler import scheduler as scheduler_module
from unipage.scheduler.policies import VTC, SchedulingPolicy

CONFIGS = {  # name -> (pages, admission, eviction policy, several tokens per sample, prefix caching)
    "roomy": (160, "optimistic", "lru", False, True),
    "preempting": (40, "optimistic", "lru", False, True),
    "speculative": (60, "optimistic", "lfu", True, True),
    "reserve": (80, "reserve", "cost", False, True),
    "no_prefix_cache": (40, "optimistic", "lru", False, False),
}


def run_workload(pages, admission, eviction, speculative, prefix_caching=True, steps=150, seed=0, policy="fcfs"):
    """Drive a scheduler through ``steps`` steps; returns one record per step."""
    rng = random.Random(seed)
    config = UnipageConfig(MODEL, PoolConfig(block_tokens=4, num_pages=pages, prefix_caching=prefix_caching),
                           LoRAConfig(max_rank=8, max_adapters_per_batch=3, eviction_policy=eviction))
    memory = UnifiedMemory(config)
    for i in range(6):
        memory.adapters.register(f"a{i}", synthetic_info(MODEL, 2 + i % 3, digest=f"digest-{i}"))
    clock = Clock()
    sched = Scheduler(memory, SchedulerConfig(max_model_len=64, max_num_batched_tokens=24, max_num_seqs=8,
                                              admission=admission, policy=policy), clock=clock)
    prefixes = [[rng.randrange(3, 40) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    records, loading, next_id = [], [], 0
    for _ in range(steps):
        clock.now += 0.01
        while sched.num_waiting < 6:
            prompt = rng.choice(prefixes) + [rng.randrange(3, 40) for _ in range(rng.randrange(1, 12))]
            adapter = rng.choice([None, "a0", "a1", "a2", "a3", "a4", "a5"])
            sched.add(Request(f"r{next_id}", prompt, adapter=adapter, max_tokens=rng.randrange(1, 30),
                              stop_token_ids=(2,)))
            next_id += 1
        if rng.random() < 0.03:
            sched.abort(rng.choice(sorted(sched.requests)))
        out = sched.schedule()
        batch = {rid: sched.get(rid) for rid in out.req_ids}
        if out.req_ids and rng.random() < 0.03:  # aborted while its step runs: update() skips it
            sched.abort(rng.choice(out.req_ids))
        done, loading = loading, [e.name for e in out.adapter_effects if isinstance(e, LoadAdapter)]
        sampled = []
        for rid in out.req_ids:
            r = batch[rid]
            count = rng.randrange(1, 4) if speculative else 1
            sampled.append([rng.randrange(2, 40) for _ in range(count)] if r.num_computed_tokens == r.num_tokens
                           else [])
        outputs = sched.update(StepResult(sampled, loads_done=done))
        sched.check()
        records.append((dataclasses.asdict(out), [vars_of(o) for o in outputs], memory.occupancy(),
                        sorted((c.kind, str(c.key), c.last_used, c.uses) for c in memory.reclaimer.candidates()),
                        list(memory.pool._free),
                        sorted((r.request_id, r.first_token_time, r.num_tokens) for r in sched.requests.values()),
                        sched.policy.counters() if policy == "vtc" else None))
    return records


def vars_of(output):
    return (output.request_id, output.new_token_ids, output.finish_reason, output.detail)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_all_decode_step_equals_the_general_loop(name, monkeypatch):
    calls = {"fast": 0, "short": 0}
    fast = Scheduler._schedule_decodes

    def counted(self, step):
        scheduled = fast(self, step)
        calls["fast"] += 1
        calls["short"] += scheduled < len(self.running)
        return scheduled

    monkeypatch.setattr(Scheduler, "_schedule_decodes", counted)
    with_fast_path = run_workload(*CONFIGS[name])
    monkeypatch.setattr(Scheduler, "_schedule_decodes", lambda self, step: 0)
    assert run_workload(*CONFIGS[name]) == with_fast_path
    assert calls["fast"] > (0 if name == "speculative" else 20)  # speculative: rarely one token each
    if name in ("preempting", "no_prefix_cache"):
        assert calls["short"] > 0  # it handed over to the general loop to preempt


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_plain_decode_update_equals_the_event_path(name, monkeypatch):
    with_hot_loop = run_workload(*CONFIGS[name])
    for module in (scheduler_module, admission_module):  # every request an event, every step
        monkeypatch.setattr(module, "next_check", lambda req: 0)
    assert run_workload(*CONFIGS[name]) == with_hot_loop


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_vtc_counts_a_decode_step_as_on_step_does(name, monkeypatch):
    with_decode_hook = run_workload(*CONFIGS[name], policy="vtc")
    monkeypatch.setattr(VTC, "on_decode_step", SchedulingPolicy.on_decode_step)  # every step through on_step
    assert run_workload(*CONFIGS[name], policy="vtc") == with_decode_hook
