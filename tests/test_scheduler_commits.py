"""When KV blocks are committed to the prefix cache.

A running request commits the blocks it filled at the start of the next `schedule()`, before anything there
looks a prefix up; one that leaves (finishes, or is aborted between steps) commits at once, after the running
requests ahead of it: of two equal blocks the one earlier in the batch is registered, and stays hittable while
its request runs, even once the other's copy is cached and evicted.
"""

import pytest
from test_scheduler_support import make
from unipage.scheduler import Request, StepResult

PROMPT = [1, 2, 3, 4, 5, 6]  # one full 4-token block and two tokens


def hit_after_pressure(leave: str) -> int:
    """A and B compute the same block; B leaves; D needs every page; C (A's prompt) comes while A runs."""
    s = make(num_pages=8, max_num_batched_tokens=32)
    s.add(Request("A", PROMPT, max_tokens=20))
    s.add(Request("B", PROMPT, max_tokens=1 if leave == "finish" else 20))
    s.schedule()
    s.update(StepResult([[9], [9]]))  # both prefilled; B finishes on its token (or is aborted next)
    if leave == "abort":
        s.abort("B")
    s.check()
    s.add(Request("D", list(range(20, 43)), max_tokens=1))  # 23 tokens: every page but A's
    out = s.schedule()
    assert [n.request_id for n in out.new_requests] == ["D"]
    s.update(StepResult([[9] for _ in out.req_ids]))
    s.check()
    s.add(Request("C", PROMPT, max_tokens=1))
    out = s.schedule()
    s.check()
    [new] = out.new_requests
    return new.num_computed_tokens


@pytest.mark.parametrize("leave", ["finish", "abort"])
def test_the_copy_of_a_block_that_registers_is_the_running_requests(leave):
    assert hit_after_pressure(leave) == 4  # A's block 0, registered first, was not evicted with B's copy


def test_blocks_filled_in_a_step_are_committed_before_the_next_admission_looks_them_up():
    s = make(num_pages=32, max_num_batched_tokens=64)
    s.add(Request("A", list(range(1, 10)), max_tokens=8))  # 9 tokens: 2 full blocks after its prefill
    s.schedule()
    s.update(StepResult([[50]]))
    s.add(Request("B", list(range(1, 10)) + [7], max_tokens=1))
    out = s.schedule()
    [new] = out.new_requests
    assert new.num_computed_tokens == 8  # A's two blocks, committed at the start of this schedule()
    s.check()
