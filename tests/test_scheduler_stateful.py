"""Random walks over the scheduler on a pool that holds only two of the fifty adapters requested.

Arrivals, aborts, adapter choices, load completions and failures, stop tokens
and a moving clock come in random order, under every policy, admission mode
and a few eviction policies.  After every step every invariant of the
scheduler and the pool holds and the step obeys its limits; at the end,
after draining, every request has finished or been aborted — none lost, none
stuck — and the pool holds nothing but what could be reclaimed at once.
"""

import dataclasses
import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from test_scheduler_support import MODEL, Clock
from unipage.adapter_info import synthetic_info
from unipage.adapters import LoadAdapter
from unipage.config import LoRAConfig, PoolConfig, UnipageConfig
from unipage.memory import UnifiedMemory
from unipage.scheduler import POLICIES, Request, Scheduler, SchedulerConfig, StepResult

HYBRID = dataclasses.replace(MODEL, sliding_layers=(0,), sliding_window=3)
ADAPTERS = [f"lora{i}" for i in range(50)]  # rank 4: 4 pages each (8 hybrid); 2 fit in the pool, 3 never do
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 6]
STOP = 0


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(sorted(POLICIES)), admission=st.sampled_from(["optimistic", "reserve"]),
                eviction=st.sampled_from(["lru", "lfu", "idle", "cost"]), max_adapters=st.integers(1, 3),
                max_skips=st.integers(0, 3), prefix_caching=st.booleans(), budget=st.sampled_from([4, 12]),
                seqs=st.sampled_from([1, 4]), lookahead=st.sampled_from([1, 8]), prefetch=st.sampled_from([0, 2]),
                chunk=st.sampled_from([0, 3]), seed=st.integers(0, 2**16), window=st.sampled_from([0, 0, 3, 6]),
                coalesce=st.sampled_from([0, 2]))  # (coalesce last: the replayed examples below leave it 0)
    def setup(self, policy, admission, eviction, max_adapters, max_skips, prefix_caching, budget, seqs, lookahead,
              prefetch, chunk, seed, window, coalesce=0):
        # window > 0: layer 0 slides (its KV in a group of its own, pages half as large: twice as many)
        model = MODEL if not window else dataclasses.replace(HYBRID, sliding_window=window)
        pages = 11 * (2 if window else 1)
        config = UnipageConfig(model, PoolConfig(block_tokens=4, num_pages=pages, prefix_caching=prefix_caching),
                               LoRAConfig(max_rank=8, max_adapters_per_batch=max_adapters, eviction_policy=eviction,
                                          host_cache_bytes=1 << 20))
        memory = UnifiedMemory(config)
        for name in ADAPTERS:
            memory.adapters.register(name, synthetic_info(model, 4, digest=f"digest-{name}"))
        sched_config = SchedulerConfig(max_model_len=24, max_num_batched_tokens=budget, max_num_seqs=seqs,
                                       long_prefill_token_threshold=chunk, policy=policy, admission=admission,
                                       max_skips=max_skips, lookahead=lookahead, prefetch_depth=prefetch,
                                       prefill_coalesce_steps=coalesce, slo_ttft_s=0.5, step_time_s=0.01,
                                       affinity_max_wait_s=0.05)
        self.sched = Scheduler(memory, sched_config, clock=Clock())
        self.rng = random.Random(seed)
        self.loading: list[str] = []  # loads started and not yet reported
        self.added: set[str] = set()
        self.finished: dict[str, str] = {}  # id -> finish reason (from a RequestOutput)
        self.aborted: set[str] = set()  # aborted by us
        self.next_id = 0

    @rule(adapter=st.one_of(st.none(), st.integers(0, 49)), prefix=st.integers(0, 2), extra=st.integers(0, 3),
          max_tokens=st.integers(1, 6))
    def add(self, adapter, prefix, extra, max_tokens):
        rid = f"r{self.next_id}"
        self.next_id += 1
        prompt = PREFIXES[prefix] + [100 + extra] * extra
        self.sched.add(Request(rid, prompt, adapter=None if adapter is None else ADAPTERS[adapter],
                               max_tokens=max_tokens, stop_token_ids=(STOP,), tenant=f"t{prefix}"))
        self.added.add(rid)

    @precondition(lambda self: self.added)
    @rule(index=st.integers(0, 1000))
    def abort(self, index):
        rid = sorted(self.added)[index % len(self.added)]
        if self.sched.abort(rid):
            assert rid not in self.finished and rid not in self.aborted
            self.aborted.add(rid)
        assert self.sched.get(rid) is None

    @rule(finish_loads=st.integers(0, 3), fail=st.booleans())
    def step(self, finish_loads, fail):
        self._step(finish_loads, fail)

    @rule()
    def abandoned_step(self):
        """The executor cannot run a step: its running requests are preempted and come back later."""
        out = self.sched.schedule()
        self._check_output(out)
        self.loading += [e.name for e in out.adapter_effects if isinstance(e, LoadAdapter)]
        ids = self.sched.abandon_step()
        assert sorted(ids) == sorted(rid for rid in out.req_ids if self.sched.get(rid) is not None)
        self.abandoned = set(ids)

    def _step(self, finish_loads, fail):
        sched = self.sched
        out = sched.schedule()
        self._check_output(out)
        self.loading += [e.name for e in out.adapter_effects if isinstance(e, LoadAdapter)]
        reported, self.loading = self.loading[:finish_loads], self.loading[finish_loads:]
        failed = reported[:1] if fail else []
        sampled = []
        for rid in out.req_ids:
            r = sched.get(rid)
            sampled.append([self.rng.randrange(0, 12)] if r.num_computed_tokens == r.num_tokens else [])
        outputs = sched.update(StepResult(sampled, loads_done=reported[len(failed):], loads_failed=failed))
        for o in outputs:
            if o.finished:
                assert o.request_id not in self.finished and o.request_id not in self.aborted
                self.finished[o.request_id] = o.finish_reason.value
        sched.clock.now += 0.01

    def _check_output(self, out):
        sched = self.sched
        cfg = sched.config
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens) == len(out.token_slots)
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert max(out.num_scheduled_tokens, default=0) <= (cfg.long_prefill_token_threshold or 10**9)
        assert len(out.req_ids) <= cfg.max_num_seqs and len(set(out.req_ids)) == len(out.req_ids)
        assert 0 < min(out.num_scheduled_tokens, default=1)
        names = {sched.get(rid).adapter for rid in out.req_ids} - {None}
        assert names == set(out.adapters) and len(names) <= sched.max_adapters
        expect = [sched.adapters.get(sched.get(rid).adapter).slot if sched.get(rid).adapter else -1
                  for rid, n in zip(out.req_ids, out.num_scheduled_tokens) for _ in range(n)]
        assert out.token_slots == expect
        if sched.config.admission == "reserve":  # no preemption, but of an abandoned step's requests
            assert set(out.preempted_ids) <= getattr(self, "abandoned", set())
        self.abandoned = set()

    @invariant()
    def consistent(self):
        if hasattr(self, "sched"):
            self.sched.check()

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        sched = self.sched
        for _ in range(100 + 40 * len(sched.requests)):  # ample: <= 17 tokens each; loads complete at once
            if not sched.has_unfinished() and not self.loading:
                break
            self._step(len(self.loading) + 2, False)
            sched.check()
        stuck = {rid: sched.get(rid).status.value for rid in sched.requests}
        assert not stuck, f"requests stuck: {stuck}"
        assert self.added == set(self.finished) | self.aborted, "requests lost"
        assert sched.memory.occupancy()["kv"] == 0 and sched.num_waiting == 0 and not sched.running
        assert all(sched.adapters.get(name).pins == 0 for name in ADAPTERS)
        reclaimer = sched.memory.reclaimer
        loading = [n for n in sched.adapters.resident() if not sched.adapters.get(n).loaded]
        assert not loading, f"loads never reported: {loading}"
        assert reclaimer.reclaim(sched.memory.pool.num_pages - sched.memory.pool.num_free)
        assert sched.memory.occupancy()["free"] == sched.memory.pool.num_pages


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=400, stateful_step_count=50, deadline=None)


def test_a_request_put_back_ahead_of_a_reservation_does_not_hide_it():
    """Found by the machine: one adapter slot, lookahead 1; r3 holds the reservation for the slot, then an
    abandoned step puts r2 (another adapter) back ahead of it.  Examined in policy order alone, r2 could not
    take the reserved slot and r3 was never reached: both waited forever."""
    state = SchedulerMachine()
    state.setup(policy="affinity", admission="optimistic", eviction="lru", max_adapters=1, max_skips=0,
                prefix_caching=False, budget=4, seqs=4, lookahead=1, prefetch=0, chunk=0, seed=0, window=0)
    state.add(adapter=None, extra=0, max_tokens=1, prefix=0)
    state.abort(index=0)
    state.add(adapter=None, extra=0, max_tokens=1, prefix=0)
    state.add(adapter=1, extra=0, max_tokens=2, prefix=0)
    state.abort(index=1)
    state.step(fail=False, finish_loads=1)
    state.add(adapter=0, extra=0, max_tokens=1, prefix=0)
    state.step(fail=False, finish_loads=0)
    state.step(fail=False, finish_loads=0)
    state.abandoned_step()
    state.consistent()
    state.teardown()
