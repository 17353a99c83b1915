"""``decode_kv_ahead``: a step's decodes hold KV room for the next token too (the engine's decode run-ahead
writes it before the scheduler sees the step's tokens), taken only where the pool has it without preempting;
0 changes nothing."""

import random

import pytest

from test_scheduler_support import Executor, batch, make, req, step
from unipage.scheduler import SchedulerConfig


def _room_after_each_step(sched, steps: int) -> list[bool]:
    """Per step and decode: whether the request's table holds the position one past the step's token."""
    seen = []
    for _ in range(steps):
        out, _ = step(sched)
        for rid, n in zip(out.req_ids, out.num_scheduled_tokens):
            r = sched.get(rid)
            if n == 1 and r is not None:  # (None: finished in this step's update)
                seen.append(r.capacity >= r.num_computed_tokens + 1)
    return seen


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_decodes_hold_the_next_position_when_the_pool_has_room(prefix_caching):
    sched = make(num_pages=64, prefix_caching=prefix_caching, decode_kv_ahead=1)
    for i in range(4):
        sched.add(req(f"r{i}", n=3 + i, max_tokens=20, start=10 * i))
    seen = _room_after_each_step(sched, 30)
    assert len(seen) > 40 and all(seen)
    plain = make(num_pages=64, prefix_caching=prefix_caching)
    for i in range(4):
        plain.add(req(f"r{i}", n=3 + i, max_tokens=20, start=10 * i))
    assert not all(_room_after_each_step(plain, 30))  # without it, a block boundary leaves none


def test_the_room_ahead_never_preempts():
    """Two requests fill the pool exactly: with room ahead they run as without it, no preemption, the same
    batches, and each decode gets its room ahead only while a page is free."""
    runs = []
    for ahead in (0, 1):
        sched = make(num_pages=4, prefix_caching=False, decode_kv_ahead=ahead)
        sched.add(req("r0", n=4, max_tokens=5))
        sched.add(req("r1", n=4, max_tokens=5, start=20))
        runs.append([batch(step(sched)[0]) for _ in range(6)])
        assert sched.stats.preemptions == 0
    assert runs[0] == runs[1]


def test_random_runs_match_without_room_ahead_when_memory_is_ample():
    """Batches and tokens are the same with and without it (only the pages differ) over random arrivals."""
    def run(ahead: int) -> list:
        rng = random.Random(7)
        sched = make(num_pages=256, decode_kv_ahead=ahead, max_num_batched_tokens=32)
        executor = Executor(sched, token=lambda rid: 3 + len(rid))
        trace, added = [], 0
        for _ in range(80):
            if added < 12 and rng.random() < 0.3:
                sched.add(req(f"q{added}", n=rng.randrange(1, 20), max_tokens=rng.randrange(1, 15),
                              start=rng.randrange(100)))
                added += 1
            out, outputs = step(sched, executor)
            trace.append((batch(out), [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs]))
        return trace

    assert run(0) == run(1)


def test_reserve_mode_keeps_to_its_reservation():
    sched = make(num_pages=64, admission="reserve", decode_kv_ahead=1)
    sched.add(req("r0", n=3, max_tokens=6))
    for _ in range(8):
        step(sched)
    assert sched.stats.steps == 8 and not sched.has_unfinished()


@pytest.mark.parametrize("value, message", [(-1, "decode_kv_ahead must be an integer >= 0"),
                                            (1.5, "decode_kv_ahead must be an integer >= 0")])
def test_bad_values_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(decode_kv_ahead=value)


def test_more_than_a_block_ahead_is_refused():
    with pytest.raises(ValueError, match="decode_kv_ahead 5 exceeds a KV block"):
        make(decode_kv_ahead=5)
