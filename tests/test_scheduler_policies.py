"""Scheduling policies and admission modes: admission order, victims, VTC counters, early aborts, starvation."""

import pytest

from test_scheduler_support import Executor, batch, make, req, step
from unipage.scheduler import (POLICIES, FinishReason, RequestOutput, RequestStatus, SchedulingPolicy,
                               make_policy, register_policy)
from unipage.scheduler.config import SchedulerConfig

S = RequestStatus


def admitted(out):
    return [n.request_id for n in out.new_requests]


def test_fcfs_admits_by_priority_then_arrival_not_by_add_order():
    sched = make(max_num_seqs=3)
    sched.add(req("late", arrival_time=3.0))
    sched.add(req("early", arrival_time=1.0))
    sched.add(req("urgent", arrival_time=5.0, priority=-1))
    sched.add(req("mid", arrival_time=2.0))
    assert admitted(step(sched)[0]) == ["urgent", "early", "mid"]


def test_affinity_prefers_adapters_already_in_the_batch_until_the_age_bound():
    for wait, expect in ((10.0, ["r2"]), (0.5, ["r1"])):
        sched = make(adapters={"a": 1, "b": 1}, loaded=("a", "b"), max_num_seqs=2, policy="affinity",
                     affinity_max_wait_s=wait)
        sched.add(req("r0", adapter="a", max_tokens=8, arrival_time=0.0))
        step(sched)
        sched.add(req("r1", adapter="b", arrival_time=0.1))
        sched.add(req("r2", adapter="a", arrival_time=0.2))
        sched.clock.now = 1.0  # r1 has waited 0.9 s
        assert admitted(step(sched)[0]) == expect, wait


def test_affinity_fills_the_slots_of_one_step_from_the_adapter_it_admitted_first():
    """No request of the batch's adapters waits and two slots are open: the first admitted (FCFS: b1) brings
    its adapter's next request (b2) before the older request of a third adapter (c1); FCFS takes c1."""
    for policy, expect in (("affinity", ["b1", "b2"]), ("fcfs", ["b1", "c1"])):
        sched = make(adapters={"a": 1, "b": 1, "c": 1}, loaded=("a", "b", "c"), max_num_seqs=3, policy=policy,
                     affinity_max_wait_s=10.0)
        sched.add(req("r0", adapter="a", max_tokens=8, arrival_time=0.0))
        step(sched)
        for name, t in (("b1", 0.1), ("c1", 0.2), ("b2", 0.3)):
            sched.add(req(name, adapter=name[0], arrival_time=t))
        sched.clock.now = 1.0
        assert admitted(step(sched)[0]) == expect, policy


def test_affinity_groups_only_behind_an_admitted_request():
    """b1 cannot run yet (its adapter is not resident): the walk goes on in FCFS order to c1, not to b2 —
    with a lookahead of two, grouping behind the skipped b1 would have examined b2 and admitted nothing."""
    sched = make(adapters={"a": 1, "b": 1, "c": 1}, loaded=("a", "c"), max_num_seqs=3, policy="affinity",
                 affinity_max_wait_s=10.0, lookahead=2)
    sched.add(req("r0", adapter="a", max_tokens=8, arrival_time=0.0))
    step(sched)
    for name, t in (("b1", 0.1), ("c1", 0.2), ("b2", 0.3), ("c2", 0.4)):
        sched.add(req(name, adapter=name[0], arrival_time=t))
    sched.clock.now = 1.0
    assert admitted(step(sched)[0]) == ["c1"]


def test_fcfs_would_take_the_oldest_instead():
    sched = make(adapters={"a": 1, "b": 1}, loaded=("a", "b"), max_num_seqs=2)
    sched.add(req("r0", adapter="a", max_tokens=8, arrival_time=0.0))
    step(sched)
    sched.add(req("r1", adapter="b", arrival_time=0.1))
    sched.add(req("r2", adapter="a", arrival_time=0.2))
    assert admitted(step(sched)[0]) == ["r1"]


def test_vtc_counters_and_order_step_by_step():
    # One request runs at a time; w_in = 1 per prompt token, w_out = 2 per generated token.
    sched = make(adapters={"a": 1, "b": 1}, loaded=("a", "b"), max_num_seqs=1, policy="vtc")
    sched.add(req("a1", adapter="a", max_tokens=2))
    sched.add(req("a2", adapter="a", max_tokens=2, start=10))
    sched.add(req("b1", adapter="b", max_tokens=2, start=20))
    trace = []
    for _ in range(6):
        out, _ = step(sched)
        trace.append((batch(out), sched.policy.counters()))
    assert trace == [
        ([("a1", 4)], {"a": 6.0, "b": 0.0}),  # admitted: +4 prompt tokens, then +2 for its first token
        ([("a1", 1)], {"a": 8.0, "b": 0.0}),
        ([("b1", 4)], {"a": 8.0, "b": 6.0}),  # b has the smaller counter: b1 before a2 (FCFS: a2 first)
        ([("b1", 1)], {"a": 8.0, "b": 8.0}),
        ([("a2", 4)], {"a": 14.0, "b": 8.0}),
        ([("a2", 1)], {"a": 16.0, "b": 8.0}),
    ]


def test_vtc_lifts_a_newly_backlogged_client_to_the_least_served_backlogged_one():
    sched = make(adapters={"a": 1, "b": 1, "c": 1}, loaded=("a", "b", "c"), max_num_seqs=1, policy="vtc")
    sched.add(req("a1", adapter="a", max_tokens=2))
    sched.add(req("b1", adapter="b", max_tokens=2, start=20))
    step(sched)
    step(sched)  # a1 done: a = 8; b is backlogged at 0
    sched.add(req("a2", adapter="a", start=30))
    sched.add(req("c1", adapter="c", start=40))
    assert sched.policy.counters() == {"a": 8.0, "b": 0.0, "c": 0.0}  # a keeps its higher counter
    out, _ = step(sched)
    assert admitted(out) == ["b1"]
    step(sched)
    assert admitted(step(sched)[0]) == ["c1"]  # c (0) before a (8)


def test_vtc_counts_tenants_when_asked():
    sched = make(adapters={"a": 1}, loaded=("a",), policy="vtc", vtc_client="tenant")
    sched.add(req("r0", adapter="a", tenant="acme"))
    sched.add(req("r1", tenant="zeta", start=10, n=2))
    step(sched)
    assert sched.policy.counters() == {"acme": 6.0, "zeta": 4.0}


def test_vtc_preempts_the_most_served_client():
    policy = make_policy("vtc", SchedulerConfig())
    a, b = req("a", adapter="x"), req("b", adapter="y")
    for r, seq in ((a, 0), (b, 1)):
        r.seq, r.arrival_time = seq, float(seq)
        policy.push(r)
    policy._clients["x"].counter = 50.0
    assert policy.victim([a, b]) is a and make_policy("fcfs", SchedulerConfig()).victim([a, b]) is b


def test_slo_policy_drops_requests_predicted_to_miss_their_first_token_deadline():
    sched = make(policy="slo", max_num_batched_tokens=8, step_time_s=1.0, slo_ttft_s=2.5)
    for i in range(3):
        sched.add(req(f"r{i}", n=8, start=10 * i, arrival_time=0.0))
    out, outputs = step(sched)  # r0 after 1 step, r1 after 2, r2 after 3 > 2.5 s
    assert batch(out) == [("r0", 8)] and out.aborted_ids == ["r2"]
    assert outputs == [RequestOutput.of("r2", [], FinishReason.SLO,
                                     "predicted time to first token 3.000 s exceeds slo_ttft_s=2.5 s"),
                       RequestOutput.of("r0", [9])]
    sched.clock.now = 1.0
    out, outputs = step(sched)  # r1: 1 s waited + 8 tokens at 7 per step
    assert batch(out) == [("r0", 1), ("r1", 7)] and out.aborted_ids == []
    assert sched.stats.aborted == 1


def test_slo_keeps_requests_that_already_produced_a_token():
    sched = make(policy="slo", num_pages=4, prefix_caching=False, step_time_s=1.0, slo_ttft_s=1.5)
    sched.add(req("r0", max_tokens=8))
    sched.add(req("r1", max_tokens=8, start=20))
    for _ in range(6):
        step(sched)
    assert sched.get("r1").status is S.PREEMPTED
    sched.clock.now = 100.0
    step(sched)
    assert sched.get("r1") is not None


def test_reserve_mode_reserves_to_completion_and_never_preempts():
    for admission, expect_admitted, expect_preempted in (("reserve", 2, 0), ("optimistic", 3, 1)):
        sched = make(num_pages=6, prefix_caching=False, admission=admission)
        for i in range(3):
            sched.add(req(f"r{i}", max_tokens=8, start=10 * i))
        out, _ = step(sched)
        assert len(out.new_requests) == expect_admitted, admission
        if admission == "reserve":  # 4 + 8 tokens: 11 computed at most, 3 blocks each
            assert [len(n.block_table) for n in out.new_requests] == [3, 3]
        while sched.has_unfinished():
            step(sched)
        assert sched.stats.preemptions == expect_preempted, admission
        assert sched.stats.finished == 3


def test_a_request_starving_for_an_adapter_slot_gets_the_next_one():
    # One adapter per batch.  A steady stream of a-requests would keep b out forever; after
    # max_skips passes, a is drained (no new a-requests) and b gets the slot.
    expected = {1: [["a0", "a1"], [], [], ["b0"], [], []],
                100: [["a0", "a1"], ["a2"], ["a3"], ["a4"], ["a5"], ["a6"]]}
    for max_skips, trace in expected.items():
        sched = make(adapters={"a": 1, "b": 1}, loaded=("a", "b"), max_adapters=1, max_skips=max_skips)
        sched.add(req("a0", adapter="a", max_tokens=3))
        sched.add(req("b0", adapter="b", start=50))
        got = []
        for i in range(6):
            sched.add(req(f"a{i + 1}", adapter="a", max_tokens=3, start=10 * i + 100))
            got.append(admitted(step(sched)[0]))
        assert got == trace, max_skips


def test_a_request_starving_for_pages_blocks_those_behind_it():
    # big's adapter needs 6 of the 8 pages; r0 and r1 hold 3, then 5.
    for max_skips, r2_admitted in ((1, False), (100, True)):
        sched = make(num_pages=8, adapters={"a": 6}, prefix_caching=False, max_num_batched_tokens=32,
                     max_skips=max_skips)
        sched.add(req("r0", n=8))
        sched.add(req("r1", start=20))
        sched.add(req("big", adapter="a", start=40))
        assert admitted(step(sched)[0]) == ["r0", "r1"]
        assert sched.get("big").status is S.WAITING_FOR_ADAPTER and sched.get("big").skips == 1
        sched.add(req("r2", start=60))
        assert ("r2" in admitted(step(sched)[0])) is r2_admitted, max_skips
        while sched.get("big") is not None and sched.get("big").status is not S.RUNNING:
            step(sched)
        assert sched.get("big").adapter == "a"


def test_policy_registry():
    assert sorted(POLICIES) == ["affinity", "fcfs", "slo", "vtc"]
    with pytest.raises(ValueError, match="unknown scheduling policy 'nope'"):
        make_policy("nope", SchedulerConfig())
    with pytest.raises(ValueError, match="already registered"):
        register_policy(type("Dup", (SchedulingPolicy,), {"name": "fcfs"}))


def test_a_registered_policy_is_chosen_by_name():
    @register_policy
    class Lifo(SchedulingPolicy):
        name = "test-lifo"

        def candidates(self, ctx):
            return reversed(list(self._queue))

    try:
        sched = make(policy="test-lifo", max_num_seqs=1)
        sched.add(req("first"))
        sched.add(req("second", start=10))
        assert admitted(step(sched)[0]) == ["second"]
    finally:
        del POLICIES["test-lifo"]


def test_executor_reports_loads_in_a_later_step():
    sched = make(adapters={"a": 2}, policy="affinity")
    executor = Executor(sched, load_steps=2)
    sched.add(req("r0", adapter="a"))
    statuses = []
    for _ in range(4):
        step(sched, executor)
        statuses.append(sched.get("r0").status)
    assert statuses == [S.WAITING_FOR_ADAPTER, S.WAITING_FOR_ADAPTER, S.WAITING, S.RUNNING]
