"""``decode_kv_ahead``: a step's decodes hold KV room for the next token too (the engine's decode run-ahead
writes it before the scheduler sees the step's tokens), taken only where the pool has it without preempting;
0 changes nothing."""

import random

import pytest

from test_scheduler_support import Executor, batch, make, req, step
from unipage.scheduler import SchedulerConfig


def _room_after_each_step(sched, steps: int) -> list[bool]:
    """Per step of decodes only and request going on: whether its table holds the position one past the
    step's token."""
    seen = []
    for _ in range(steps):
        out, _ = step(sched)
        if out.new_requests or set(out.num_scheduled_tokens) != {1}:
            continue
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


@pytest.mark.parametrize("seed", range(40))
def test_the_room_ahead_comes_last_and_changes_nothing_but_pages(seed):
    """Small pools, random arrivals: the room ahead is taken after the running phase and the admission, and
    taking it leaves the step's batch, preemptions and admissions as they were, only adding pages to the
    ends of its requests' new blocks (in steps of decodes only)."""
    rng = random.Random(seed)
    sched = make(num_pages=rng.randrange(6, 16), prefix_caching=bool(seed % 2), decode_kv_ahead=1,
                 max_num_batched_tokens=32)
    order, added, extra = [], 0, 0
    real_ahead, real_admit = sched._room_ahead, sched._admission.admit

    def state(step):
        out = step.out
        return [r.request_id for r in step.reqs], list(out.preempted_ids), len(out.new_requests)

    def ahead(step):
        nonlocal extra
        before, pages = state(step), {rid: list(p) for rid, p in step.out.new_block_ids.items()}
        real_ahead(step)
        assert state(step) == before
        for rid, new in step.out.new_block_ids.items():
            assert new[:len(pages.get(rid, []))] == pages.get(rid, [])
            extra += len(new) - len(pages.get(rid, []))
            assert len(new) == len(pages.get(rid, [])) or not (step.partial or step.out.new_requests)
        order.append("ahead")

    sched._room_ahead = ahead
    sched._admission.admit = lambda *a: order.append("admit") or real_admit(*a)
    executor = Executor(sched, token=lambda rid: 3 + len(rid))
    for _ in range(40):
        if added < 8 and rng.random() < 0.4:
            sched.add(req(f"q{added}", n=rng.randrange(1, 12), max_tokens=rng.randrange(1, 14),
                          start=rng.randrange(100)))
            added += 1
        order.clear()
        step(sched, executor)
        assert order in (["admit", "ahead"], ["ahead"]), order
    if seed < 4:
        assert extra > 0  # (room ahead was taken)


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


def test_reserve_mode_needs_no_room_ahead():
    """Its reservation already holds every position a request computes: the same batches and pages."""
    runs = []
    for ahead in (0, 1):
        sched = make(num_pages=64, admission="reserve", decode_kv_ahead=ahead)
        sched.add(req("r0", n=3, max_tokens=6))
        sched.add(req("r1", n=6, max_tokens=11, start=30))
        runs.append([(batch(out), out.new_block_ids) for out, _ in (step(sched) for _ in range(12))])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("value, message", [(-1, "decode_kv_ahead must be an integer >= 0"),
                                            (1.5, "decode_kv_ahead must be an integer >= 0")])
def test_bad_values_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(decode_kv_ahead=value)


def test_a_block_ahead_or_more_is_refused():
    with pytest.raises(ValueError, match=r"decode_kv_ahead 4 must be below a KV block \(4 tokens\)"):
        make(decode_kv_ahead=4)
