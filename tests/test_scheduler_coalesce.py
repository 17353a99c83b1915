"""`SchedulerConfig.prefill_coalesce_steps`: admission waits a few decode steps for adapter loads so that the
prompts start in one prefill step."""

import pytest
from test_scheduler_support import Executor, batch, make, req, step


def _loading(load_steps=2, **config):
    """r0 (no adapter) only decodes; r1's adapter "a" is loading (``load_steps`` results); "b" is resident."""
    sched = make(adapters={"a": 2, "b": 2, "c": 2}, loaded=("b",), **config)
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


def test_no_wait_for_an_adapter_that_cannot_join():
    """One adapter slot, taken by r0's "b": prefetch loads r1's "a", but r1 cannot join, so r2 starts at once."""
    sched = make(adapters={"a": 2, "b": 2}, loaded=("b",), max_adapters=1, prefill_coalesce_steps=4)
    executor = Executor(sched, load_steps=3)
    sched.add(req("r0", adapter="b", max_tokens=12))
    step(sched, executor)
    sched.add(req("r1", adapter="a", start=20))
    out, _ = step(sched, executor)
    assert [e.name for e in out.adapter_loads] == ["a"]  # (prefetch: pages are spare)
    sched.add(req("r2", start=30))
    out, _ = step(sched, executor)
    assert batch(out) == [("r0", 1), ("r2", 4)] and sched.stats.coalesced == 0


def test_no_wait_while_admission_has_a_load_to_start():
    """r3's adapter "c" is neither resident nor loading: admission must run to request it, so the ready r2
    starts at once instead of waiting for r1's "a"."""
    sched, executor = _loading(prefill_coalesce_steps=4)
    sched.add(req("r3", adapter="c", start=40))
    sched.add(req("r2", adapter="b", start=30))
    out, _ = step(sched, executor)
    assert batch(out) == [("r0", 1), ("r2", 4)] and [e.name for e in out.adapter_loads] == ["c"]
    assert sched.stats.coalesced == 0


@pytest.mark.parametrize("running", [False, True])
def test_no_wait_without_decodes_or_with_a_prefill_running(running):
    """A load is in flight and r1 is ready, yet no wait: nothing runs (waiting would leave the step empty), or a
    request is still prefilling (the step is eager anyway)."""
    sched = make(adapters={"a": 2}, prefill_coalesce_steps=4)
    executor = Executor(sched, load_steps=3)
    sched.add(req("r2", adapter="a", start=50))
    if running:
        sched.add(req("r0", n=20, max_tokens=4))  # 20 tokens: two chunks of the 16-token budget
    out, _ = step(sched, executor)
    assert [e.name for e in out.adapter_loads] == ["a"] and bool(sched.running) == running
    sched.add(req("r1", start=40))
    out, _ = step(sched, executor)
    assert ("r1", 4) in batch(out) and sched.stats.coalesced == 0


def test_no_wait_with_a_full_batch():
    sched, executor = _loading(prefill_coalesce_steps=4, max_num_seqs=1)
    sched.add(req("r2", adapter="b", start=30))
    out, _ = step(sched, executor)
    assert batch(out) == [("r0", 1)] and sched.stats.coalesced == 0


def test_config_is_validated():
    from unipage.scheduler import SchedulerConfig

    with pytest.raises(ValueError, match="prefill_coalesce_steps must be an integer >= 0"):
        SchedulerConfig(prefill_coalesce_steps=-1)
