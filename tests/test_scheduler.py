"""Scheduler: exact batches step by step — chunking, preemption, adapters, aborts, bad input."""

import pathlib
import runpy
import subprocess
import sys

import pytest

from test_scheduler_support import TOKEN, Executor, batch, make, req, step
from unipage.scheduler.output import make_outputs
from unipage.adapters import LoadAdapter
from unipage.errors import UnknownAdapterError
from unipage.scheduler import (TRANSITIONS, DuplicateRequestError, FinishReason, InvalidTransitionError,
                               PromptTooLongError, Request, RequestError, RequestOutput, RequestStatus,
                               RequestTooLargeError, SamplingParams, SchedulerConfig, StepResult)

S = RequestStatus


def test_chunked_prefill_and_decode_share_the_token_budget():
    sched = make(max_num_batched_tokens=8, prefix_caching=False)
    sched.add(req("r0", n=10, max_tokens=3))
    sched.add(req("r1", n=3, max_tokens=3, start=50))
    out, outputs = step(sched)
    assert batch(out) == [("r0", 8)]  # the budget is spent on r0's first chunk: r1 waits
    assert [(n.request_id, n.block_table, n.num_computed_tokens) for n in out.new_requests] == [("r0", [0, 1], 0)]
    assert out.token_slots == [-1] * 8 and outputs == []
    out, outputs = step(sched)
    assert batch(out) == [("r0", 2), ("r1", 3)]  # r0 finishes its prompt, r1's prompt fits beside it
    assert out.running_ids == ["r0"] and out.new_block_ids == {"r0": [2]}
    assert out.new_requests[0].block_table == [3] and out.total_num_scheduled_tokens == 5
    assert outputs == [RequestOutput.of("r0", [TOKEN]), RequestOutput.of("r1", [TOKEN])]
    out, _ = step(sched)
    assert batch(out) == [("r0", 1), ("r1", 1)] and out.new_block_ids == {}
    out, outputs = step(sched)
    assert batch(out) == [("r0", 1), ("r1", 1)] and out.new_block_ids == {"r1": [4]}
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("r0", FinishReason.LENGTH),
                                                                  ("r1", FinishReason.LENGTH)]
    out, _ = step(sched)
    assert out.finished_ids == ["r0", "r1"] and out.req_ids == []
    assert sched.memory.occupancy()["free"] == 64 and not sched.has_unfinished()


def test_long_prefill_threshold_caps_each_request_chunk():
    sched = make(max_num_batched_tokens=16, long_prefill_token_threshold=4)
    sched.add(req("r0", n=10))
    sched.add(req("r1", n=6, start=20))
    assert batch(step(sched)[0]) == [("r0", 4), ("r1", 4)]
    assert batch(step(sched)[0]) == [("r0", 4), ("r1", 2)]
    assert batch(step(sched)[0]) == [("r0", 2), ("r1", 1)]


def test_token_slots_map_every_token_to_its_adapter_slot():
    sched = make(adapters={"a": 2, "b": 2}, loaded=("a", "b"))
    sched.add(req("r0", n=2, adapter="b"))
    sched.add(req("r1", n=3, adapter="a", start=10))
    sched.add(req("r2", n=1, start=20))
    out, _ = step(sched)
    assert out.token_slots == [1, 1, 0, 0, 0, -1]
    assert [n.adapter_slot for n in out.new_requests] == [1, 0, -1] and out.adapters == ["b", "a"]
    out, _ = step(sched)
    assert out.token_slots == [1, 0, -1]
    assert sched.adapters.get("a").pins == sched.adapters.get("b").pins == 1


def test_stop_token_finishes_and_keeps_the_token():
    sched = make()
    sched.add(req("r0", max_tokens=10, stop_token_ids=(5,)))
    tokens = iter([3, 5])
    executor = Executor(sched, token=lambda rid: next(tokens))
    assert step(sched, executor)[1] == [RequestOutput.of("r0", [3])]
    assert step(sched, executor)[1] == [RequestOutput.of("r0", [5], FinishReason.STOP)]
    assert sched.get("r0") is None and step(sched)[0].finished_ids == ["r0"]


def test_requests_with_equal_stop_tokens_share_one_stop_set():
    sched = make()
    for i, stops in enumerate(((2, 5), [5, 2], (7,), ())):
        sched.add(req(f"r{i}", stop_token_ids=stops, start=10 * i))
    sets = [sched.get(f"r{i}").stop_set for i in range(4)]
    assert sets == [frozenset({2, 5}), frozenset({2, 5}), frozenset({7}), frozenset()]
    assert sets[0] is sets[1] and sets[2] is not sets[0]


def test_length_counts_the_model_context():
    sched = make(max_model_len=8)
    sched.add(req("r0", n=6, max_tokens=100))
    outputs = [o for _ in range(3) for o in step(sched)[1]]
    assert [o.finish_reason for o in outputs] == [None, FinishReason.LENGTH]  # 6 + 2 tokens = max_model_len


def test_preemption_by_recompute_picks_the_latest_arrival():
    sched = make(num_pages=4, prefix_caching=False)
    sched.add(req("r0", max_tokens=8))
    sched.add(req("r1", max_tokens=8, start=20))
    assert batch(step(sched)[0]) == [("r0", 4), ("r1", 4)]
    out, _ = step(sched)
    assert out.new_block_ids == {"r0": [2], "r1": [3]} and sched.memory.pool.num_free == 0
    for _ in range(3):
        step(sched)
    out, _ = step(sched)  # r0 needs a third block and the pool is full: r1 goes
    assert batch(out) == [("r0", 1)] and out.preempted_ids == ["r1"] and out.new_block_ids == {"r0": [1]}
    r1 = sched.get("r1")
    assert r1.status is S.PREEMPTED and r1.num_computed_tokens == 0 and r1.num_output_tokens == 5
    assert batch(step(sched)[0]) == [("r0", 1)]  # r1's 9 tokens need 3 blocks: one is free
    out, outputs = step(sched)
    assert batch(out) == [("r0", 1)] and outputs[0].finish_reason is FinishReason.LENGTH
    out, _ = step(sched)  # resumed in full: its prompt and the 5 tokens it had generated
    assert batch(out) == [("r1", 9)] and out.new_requests[0].token_ids == list(range(20, 24)) + [TOKEN] * 5
    assert out.new_requests[0].num_prompt_tokens == 4 and sched.stats.preemptions == 1


def test_a_request_whose_adapter_is_loading_is_skipped_and_admitted_after_the_load():
    sched = make(adapters={"a": 2})
    executor = Executor(sched, load_steps=1)
    sched.add(req("r0", adapter="a"))
    sched.add(req("r1", start=20))
    out, _ = step(sched, executor)
    assert batch(out) == [("r1", 4)]  # r0 does not block r1
    [load] = out.adapter_effects
    assert isinstance(load, LoadAdapter) and (load.name, load.slot, load.pages) == ("a", 0, (0, 1))
    assert sched.get("r0").status is S.WAITING_FOR_ADAPTER
    out, _ = step(sched, executor)  # the load completes with this step's result
    assert batch(out) == [("r1", 1)] and sched.get("r0").status is S.WAITING
    out, _ = step(sched, executor)
    assert batch(out) == [("r1", 1), ("r0", 4)] and out.token_slots == [-1, 0, 0, 0, 0]
    assert sched.get("r0").status is S.RUNNING and sched.adapters.get("a").pins == 1


def test_a_request_beyond_the_adapters_per_step_limit_is_skipped_not_blocking():
    sched = make(adapters={"a": 2, "b": 2}, loaded=("a", "b"), max_adapters=1)
    sched.add(req("r0", adapter="a"))
    sched.add(req("r1", adapter="b", start=10))
    sched.add(req("r2", adapter="a", start=20))
    sched.add(req("r3", start=30))
    out, _ = step(sched)
    assert batch(out) == [("r0", 4), ("r2", 4), ("r3", 4)] and out.adapters == ["a"]
    assert sched.get("r1").status is S.WAITING and sched.get("r1").skips == 1
    for _ in range(3):
        step(sched)
    out, _ = step(sched)  # r0 and r2 finished: b takes the slot
    assert batch(out) == [("r1", 4)] and out.adapters == ["b"]


def test_prefix_cache_hits_need_the_same_adapter_weights():
    sched = make(adapters={"a": 2, "b": 2}, loaded=("a", "b"))
    sched.add(req("r0", n=9, adapter="a", max_tokens=1))
    out, _ = step(sched)
    table = out.new_requests[0].block_table
    sched.add(req("r1", n=9, adapter="a", max_tokens=1))
    sched.add(req("r2", n=9, adapter="b", max_tokens=1))
    sched.add(req("r3", n=9, max_tokens=1))
    out, _ = step(sched)
    hits = {n.request_id: (n.num_computed_tokens, n.block_table[:2] == table[:2]) for n in out.new_requests}
    assert hits == {"r1": (8, True), "r2": (0, False), "r3": (0, False)}
    assert batch(out) == [("r1", 1), ("r2", 9), ("r3", 6)] and sched.stats.prefix_hit_tokens == 8


def test_a_failed_load_answers_the_requests_waiting_for_it():
    sched = make(adapters={"a": 2})
    executor = Executor(sched, fail={"a"})
    sched.add(req("r0", adapter="a"))
    out, outputs = step(sched, executor)
    assert out.req_ids == [] and sched.get("r0") is None
    assert outputs == [RequestOutput.of("r0", [], FinishReason.LOAD_FAILED, "adapter 'a' failed to load")]
    assert step(sched)[0].aborted_ids == ["r0"] and sched.memory.occupancy()["adapter"] == 0


def test_an_adapter_unregistered_while_its_request_waits_answers_the_request():
    sched = make(adapters={"a": 2})
    sched.add(req("r0", adapter="a"))
    sched.adapters.unregister("a")
    out, outputs = step(sched)
    assert out.aborted_ids == ["r0"] and out.req_ids == []
    assert outputs == [RequestOutput.of("r0", [], FinishReason.LOAD_FAILED, "adapter 'a' was unregistered")]


def test_prefetch_loads_the_next_adapters_only_into_spare_pages():
    sched = make(num_pages=8, adapters={"a": 2, "b": 4}, max_num_seqs=1)
    executor = Executor(sched, load_steps=5)
    sched.add(req("r0", n=8, max_tokens=8))  # 2 blocks, then 4 with its output
    sched.add(req("r1", adapter="a", start=20))
    sched.add(req("r2", adapter="b", start=30))
    out, _ = step(sched, executor)  # r1 and r2 are next: a fits beside r0 with headroom, b does not
    assert [e.name for e in out.adapter_loads] == ["a"]
    assert sched.get("r1").status is sched.get("r2").status is S.WAITING_FOR_ADAPTER
    assert sched.adapters.resident() == ["a"]


@pytest.mark.parametrize("state", [S.WAITING, S.WAITING_FOR_ADAPTER, S.RUNNING, S.PREEMPTED])
def test_abort_from_every_state_frees_everything_it_holds(state):
    sched = make(num_pages=6, adapters={"a": 2, "b": 1}, loaded=("b",), max_num_seqs=2)
    executor = Executor(sched, load_steps=10)
    sched.add(req("old", n=7, max_tokens=8, adapter="b"))
    sched.add(req("x", n=6, max_tokens=8, adapter="a" if state is S.WAITING_FOR_ADAPTER else "b", start=20))
    sched.add(req("late", start=40))  # waits behind max_num_seqs
    for _ in range(4 if state is S.PREEMPTED else 1):  # at step 3 x needs a block and none is left
        step(sched, executor)
    victim = "late" if state is S.WAITING else "x"
    assert sched.get(victim).status is state
    held = sched.memory.occupancy()["kv"] - (len(sched.kv.block_table(victim)) if victim in sched.kv else 0)
    assert sched.abort(victim) and sched.get(victim) is None and not sched.abort(victim)
    sched.check()
    assert victim not in sched.kv and sched.memory.occupancy()["kv"] == held
    assert sched.adapters.get("b").pins == sum(r.adapter == "b" for r in sched.running)
    out, _ = step(sched, executor)
    assert out.aborted_ids == [victim] and victim not in out.req_ids


def test_abort_while_a_step_runs_drops_its_results():
    sched = make()
    sched.add(req("r0"))
    sched.add(req("r1", start=20))
    step(sched)
    sched.schedule()
    assert sched.abort("r0")
    outputs = sched.update(StepResult([[1], [2]]))
    assert outputs == [RequestOutput.of("r1", [2])] and sched.memory.occupancy()["kv"] == 2
    sched.check()


def test_unknown_and_finished_requests_are_not_aborted():
    sched = make()
    assert not sched.abort("nope")
    sched.add(req("r0", max_tokens=1))
    step(sched)
    assert not sched.abort("r0")


def test_the_id_of_a_finished_request_can_be_used_again():
    sched = make()
    sched.add(req("r0", max_tokens=1))
    step(sched)
    sched.add(req("r0", start=30))
    assert step(sched)[0].new_requests[0].token_ids == [30, 31, 32, 33]


BAD = [
    (lambda: req("long", n=64), PromptTooLongError, "prompt of 64 tokens leaves no room .* max_model_len=64"),
    (lambda: req("x", adapter="ghost"), UnknownAdapterError, "'ghost'"),
    (lambda: req("x", max_tokens=0), RequestError, "max_tokens must be an integer >= 1, got 0"),
    (lambda: req("x", max_tokens=2.5), RequestError, "max_tokens"),
    (lambda: req("dup"), DuplicateRequestError, "'dup' is already live"),
    (lambda: Request("x", []), RequestError, "non-empty list"),
    (lambda: Request("x", [1, -2]), RequestError, "integers >= 0"),
    (lambda: Request("x", [1, True]), RequestError, "integers >= 0"),
    (lambda: Request("x", [1, 2.0]), RequestError, "integers >= 0"),
    (lambda: Request("", [1]), RequestError, "request_id"),
    (lambda: req("x", stop_token_ids=("eos",)), RequestError, "stop_token_ids"),
    (lambda: req("x", n=40, max_tokens=20), RequestTooLargeError, "needs 15 pages .* the pool has 12"),
    (lambda: "not a request", RequestError, "expected a Request"),
]


@pytest.mark.parametrize("make_bad, error, message", BAD)
def test_bad_requests_raise_naming_the_cause_and_change_nothing(make_bad, error, message):
    sched = make(num_pages=12)
    sched.add(req("dup"))
    step(sched)
    before = (dict(sched.requests), len(sched.policy), sched.memory.occupancy(), str(sched.stats))
    with pytest.raises(error, match=message):
        sched.add(make_bad())
    assert (dict(sched.requests), len(sched.policy), sched.memory.occupancy(), str(sched.stats)) == before


def test_a_submitted_request_object_cannot_be_submitted_again():
    sched = make()
    r = req("r0", max_tokens=1)
    sched.add(r)
    step(sched)
    with pytest.raises(RequestError, match="already submitted"):
        sched.add(r)


def test_bad_step_results_raise_and_change_nothing():
    sched = make(max_num_batched_tokens=6, adapters={"a": 2}, loaded=("a",))
    sched.add(req("r0", n=8))
    sched.add(req("r1", n=2, start=20))
    step(sched)
    out = sched.schedule()
    assert batch(out) == [("r0", 2), ("r1", 2)]
    state = [(r.num_tokens, r.num_computed_tokens) for r in sched.running]
    for bad, message in [(StepResult([[1]]), "1 entries for 2 scheduled"),
                         (StepResult([[], [1]]), "'r0': no token sampled although all its tokens were computed"),
                         (StepResult([[1], [1]], loads_done=["nope"]), "unknown adapter 'nope'"),
                         (StepResult([[1], [1]], loads_done=["a"]), "'a' has no load in flight")]:
        with pytest.raises(ValueError, match=message):
            sched.update(bad)
    assert [(r.num_tokens, r.num_computed_tokens) for r in sched.running] == state
    sched.update(StepResult([[1], [1]]))
    with pytest.raises(RuntimeError, match="no step in flight"):
        sched.update(StepResult([]))


def test_tokens_for_a_partial_prefill_are_refused():
    sched = make(max_num_batched_tokens=4)
    sched.add(req("r0", n=8))
    sched.schedule()
    with pytest.raises(ValueError, match="'r0': tokens sampled in the middle of its prefill"):
        sched.update(StepResult([[1]]))
    assert sched.get("r0").num_tokens == 8
    sched.update(StepResult([[]]))


def test_schedule_twice_without_update_is_refused():
    sched = make()
    sched.schedule()
    with pytest.raises(RuntimeError, match="call update"):
        sched.schedule()


def test_transitions_are_written_down_and_enforced():
    assert set(TRANSITIONS) == set(RequestStatus)
    r = req("r0")
    r.transition(S.RUNNING)
    with pytest.raises(InvalidTransitionError, match="RUNNING -> WAITING"):
        r.transition(S.WAITING)
    r.transition(S.FINISHED)
    assert all(not TRANSITIONS[s] for s in (S.FINISHED, S.ABORTED))


@pytest.mark.parametrize("field, value, message", [
    ("max_model_len", 1, "max_model_len must be an integer >= 2"),
    ("max_num_seqs", 0, "max_num_seqs must be an integer >= 1"),
    ("policy", "lottery", "policy must be one of"),
    ("admission", "hope", "admission must be one of"),
    ("slo_ttft_s", 0, "slo_ttft_s must be > 0"),
    ("max_skips", -1, "max_skips must be an integer >= 0"),
])
def test_scheduler_config_is_validated(field, value, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**{field: value})


def test_sampling_params_are_validated():
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0)


def test_the_scheduler_imports_no_torch():
    code = "import sys, unipage.scheduler; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("policy, admission", [("fcfs", "optimistic"), ("vtc", "reserve"), ("slo", "optimistic")])
def test_the_documented_example_runs(policy, admission, capsys):
    example = runpy.run_path(str(pathlib.Path(__file__).parent.parent / "docs" / "scheduler_example.py"))
    example["main"](["--policy", policy, "--admission", admission])
    assert "16 requests done" in capsys.readouterr().out


def test_request_outputs_are_immutable_records_equal_only_to_request_outputs():
    import pickle

    out = RequestOutput.of("r0", [5], FinishReason.STOP)
    assert (out.request_id, out.new_token_ids, out.finish_reason, out.detail, out.finished) == \
        ("r0", [5], FinishReason.STOP, "", True)
    assert out == RequestOutput.of("r0", [5], FinishReason.STOP) and not out != RequestOutput.of("r0", [5], FinishReason.STOP)
    assert out != ("r0", [5], FinishReason.STOP, "") and out != RequestOutput.of("r0", [5])
    assert pickle.loads(pickle.dumps(out)) == out and repr(out) == "RequestOutput('r0', [5], STOP, '')"
    assert RequestOutput(("r0", [5], FinishReason.STOP, "")) == out  # from its fields, as make_outputs does
    assert make_outputs(["r0", "r1"], [[5], []]) == [RequestOutput.of("r0", [5]), RequestOutput.of("r1", [])]
    with pytest.raises(AttributeError):
        out.detail = "changed"


def test_an_abandoned_step_preempts_its_requests_and_the_scheduler_goes_on():
    """The executor could not run a step: `abandon_step` preempts the step's running requests (KV freed),
    reports them in the next output's preempted_ids, and they run again and finish; a load the step started
    completes through a later update."""
    sched = make(adapters={"a": 2})
    ex = Executor(sched, load_steps=1)
    for i in range(3):
        sched.add(req(f"r{i}", n=6, max_tokens=3, start=10 * i + 1))
    sched.add(req("ra", n=4, adapter="a", max_tokens=2))
    step(sched, ex)  # r0..r2 prefill; a's load starts
    out = sched.schedule()
    assert out.req_ids == ["r0", "r1", "r2"]
    with pytest.raises(RuntimeError, match="in flight"):
        sched.schedule()
    assert sorted(sched.abandon_step()) == ["r0", "r1", "r2"]
    sched.check()
    assert sched.memory.occupancy()["kv"] == 0 and all(sched.get(r).status.name == "PREEMPTED" for r in out.req_ids)
    with pytest.raises(RuntimeError, match="no step in flight"):
        sched.abandon_step()
    out, _ = step(sched, ex)
    assert out.preempted_ids[:3] == ["r0", "r1", "r2"]
    assert {n.request_id for n in out.new_requests} >= {"r0", "r1", "r2"}
    finished = set()
    for _ in range(20):
        if not sched.has_unfinished():
            break
        _, outputs = step(sched, ex)
        finished |= {o.request_id for o in outputs if o.finished}
    assert finished >= {"r0", "r1", "r2", "ra"} and not sched.has_unfinished()
    assert sched.memory.occupancy()["kv"] == 0
