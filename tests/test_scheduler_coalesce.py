"""`SchedulerConfig.prefill_coalesce_steps`: admission waits a few decode steps for adapter loads so that the
prompts start in one prefill step."""

import pytest
from test_scheduler_support import Executor, batch, make, req, step


def _decoding(**config):
    """A scheduler whose one running request (no adapter) only decodes from the second step on."""
    sched = make(adapters={"a": 2, "b": 2}, loaded=("b",), **config)
    sched.add(req("r0", max_tokens=12))
    executor = Executor(sched, load_steps=2)
    step(sched, executor)
    return sched, executor


def test_admission_waits_for_the_load_then_both_prompts_start_together():
    sched, executor = _decoding(prefill_coalesce_steps=4)
    sched.add(req("r1", adapter="a", start=20))  # its adapter is not resident
    sched.add(req("r2", adapter="b", start=30))  # ready now
    out, _ = step(sched, executor)  # waits; prefetch starts a's load
    assert batch(out) == [("r0", 1)] and [e.name for e in out.adapter_loads] == ["a"]
    for _ in range(2):  # the load lands with the third step's result
        out, _ = step(sched, executor)
        assert batch(out) == [("r0", 1)]
    out, _ = step(sched, executor)  # both start in one step
    assert batch(out) == [("r0", 1), ("r1", 4), ("r2", 4)] and sched.stats.coalesced == 3


def test_without_it_the_ready_prompt_starts_at_once():
    sched, executor = _decoding()
    sched.add(req("r1", adapter="a", start=20))
    sched.add(req("r2", adapter="b", start=30))
    out, _ = step(sched, executor)
    assert batch(out) == [("r0", 1), ("r2", 4)] and sched.stats.coalesced == 0


def test_the_wait_is_bounded():
    sched, executor = _decoding(prefill_coalesce_steps=1)
    executor.load_steps = 5
    sched.add(req("r1", adapter="a", start=20))
    sched.add(req("r2", adapter="b", start=30))
    assert batch(step(sched, executor)[0]) == [("r0", 1)]
    assert batch(step(sched, executor)[0]) == [("r0", 1), ("r2", 4)]  # it waited its one step
    assert sched.stats.coalesced == 1
    assert batch(step(sched, executor)[0]) == [("r0", 1), ("r2", 1)]  # the count starts over after admission:
    assert sched.stats.coalesced == 2  # it waits one step again ...
    assert batch(step(sched, executor)[0]) == [("r0", 1), ("r2", 1)]  # ... then admits (r1 still loading)
    assert sched.stats.coalesced == 2


def test_no_wait_when_the_ready_prompts_fill_the_step():
    sched, executor = _decoding(prefill_coalesce_steps=4)
    sched.add(req("r1", adapter="a", start=20))
    sched.add(req("r2", n=15, adapter="b", start=30))  # 15 of the 15 tokens left after r0's decode
    out, _ = step(sched, executor)
    assert batch(out) == [("r0", 1), ("r2", 15)] and sched.stats.coalesced == 0


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
