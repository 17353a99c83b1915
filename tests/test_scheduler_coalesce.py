"""`SchedulerConfig.prefill_coalesce_steps`: admission waits a few decode steps for adapter loads so that the
prompts start in one prefill step."""

import pytest
from test_scheduler_support import Executor, batch, make, req, step


def _loading(load_steps=2, **config):
    """r0 (no adapter) only decodes; r1's adapter "a" is loading (``load_steps`` results); "b" is resident."""
    sched = make(adapters={"a": 2, "b": 2}, loaded=("b",), **config)
    sched.add(req("r0", max_tokens=12))
    executor = Executor(sched, load_steps=load_steps)
    step(sched, executor)
    sched.add(req("r1", adapter="a", start=20))
    out, _ = step(sched, executor)  # admission starts a's load
    assert batch(out) == [("r0", 1)] and [e.name for e in out.adapter_loads] == ["a"]
    return sched, executor


def test_admission_waits_for_the_load_then_both_prompts_start_together():
    sched, executor = _loading(prefill_coalesce_steps=4)
    sched.add(req("r2", adapter="b", start=30))  # ready now
    for _ in range(2):  # the load lands with the second of these steps' results
        out, _ = step(sched, executor)
        assert batch(out) == [("r0", 1)]
    out, _ = step(sched, executor)  # both start in one step
    assert batch(out) == [("r0", 1), ("r1", 4), ("r2", 4)] and sched.stats.coalesced == 2


def test_without_it_the_ready_prompt_starts_at_once():
    sched, executor = _loading()
    sched.add(req("r2", adapter="b", start=30))
    out, _ = step(sched, executor)
    assert batch(out) == [("r0", 1), ("r2", 4)] and sched.stats.coalesced == 0


def test_the_wait_is_bounded():
    sched, executor = _loading(load_steps=5, prefill_coalesce_steps=1)
    sched.add(req("r2", adapter="b", start=30))
    assert batch(step(sched, executor)[0]) == [("r0", 1)]
    assert batch(step(sched, executor)[0]) == [("r0", 1), ("r2", 4)]  # it waited its one step
    assert batch(step(sched, executor)[0]) == [("r0", 1), ("r2", 1)]  # nothing ready now: no wait
    assert sched.stats.coalesced == 1


def test_no_wait_when_the_ready_prompts_fill_the_step():
    sched, executor = _loading(prefill_coalesce_steps=4)
    sched.add(req("r2", n=15, adapter="b", start=30))  # the 15 tokens left after r0's decode
    out, _ = step(sched, executor)
    assert batch(out) == [("r0", 1), ("r2", 15)] and sched.stats.coalesced == 0


def test_no_wait_for_an_adapter_that_is_not_loading():
    """One adapter slot, taken by r0's "b": r1's "a" is skipped for the slot, not loaded, so r2 starts at once."""
    sched = make(adapters={"a": 2, "b": 2}, loaded=("b",), max_adapters=1, prefetch_depth=0,
                 prefill_coalesce_steps=4)
    sched.add(req("r0", adapter="b", max_tokens=12))
    step(sched)
    sched.add(req("r1", adapter="a", start=20))
    sched.add(req("r2", start=30))
    out, _ = step(sched)
    assert batch(out) == [("r0", 1), ("r2", 4)] and sched.stats.coalesced == 0


@pytest.mark.parametrize("running", [False, True])
def test_no_wait_without_decodes_or_with_a_prefill_running(running):
    """Nothing running: waiting would leave the step empty.  A request still prefilling: the step is eager anyway."""
    sched = make(adapters={"a": 2}, prefill_coalesce_steps=4)
    executor = Executor(sched, load_steps=2)
    if running:
        sched.add(req("r0", n=20, max_tokens=4))  # 20 tokens: two chunks of the 16-token budget
        step(sched, executor)
    sched.add(req("r1", start=40))
    sched.add(req("r2", adapter="a", start=50))
    out, _ = step(sched, executor)
    assert ("r1", 4) in batch(out) and sched.stats.coalesced == 0


def test_config_is_validated():
    from unipage.scheduler import SchedulerConfig

    with pytest.raises(ValueError, match="prefill_coalesce_steps must be an integer >= 0"):
        SchedulerConfig(prefill_coalesce_steps=-1)
