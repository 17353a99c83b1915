"""Checks at the scheduler's two input boundaries, and its invariants.

Everything here only reads: a bad request or step result raises before the
scheduler changes anything.  ``check_scheduler`` asserts the bookkeeping
invariants (for tests and idle time)::

    requests = running ∪ waiting (the policy's queue), disjoint
    running: RUNNING, a KV sequence with its block table, adapter pinned,
             num_computed_tokens <= num_tokens, at most max_num_seqs,
             distinct adapters <= max_adapters_per_batch
    waiting: a waiting state, no KV sequence;
             WAITING_FOR_ADAPTER <=> listed under its adapter in the index
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unipage.scheduler.output import StepResult
from unipage.scheduler.request import (DuplicateRequestError, PromptTooLongError, Request, RequestError,
                                       RequestStatus, RequestTooLargeError, SamplingParams)

if TYPE_CHECKING:
    from unipage.scheduler.scheduler import Scheduler


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids_ok(ids) -> bool:
    """Every id an integer >= 0.  Plain ints (the usual case) are checked by C-level passes: a
    1K-token prompt in 36 us, not the 114 us of a per-token Python test (measured on a CPU host)."""
    if set(map(type, ids)) == {int}:
        return min(ids) >= 0
    return all(_is_int(t) and t >= 0 for t in ids)


def validate_request(sched: "Scheduler", req: Request) -> None:
    """Raise a `RequestError` (or `UnknownAdapterError`) naming the first problem with ``req``."""
    if not isinstance(req, Request):
        raise RequestError(f"expected a Request, got {type(req).__name__}")
    rid = req.request_id
    if not isinstance(rid, str) or not rid:
        raise RequestError(f"request_id must be a non-empty string, got {rid!r}")
    if rid in sched.requests:
        raise DuplicateRequestError(f"request id {rid!r} is already live "
                                    f"({sched.requests[rid].status.value})")
    if req.status is not RequestStatus.WAITING or req.all_token_ids:
        raise RequestError(f"request {rid!r} was already submitted ({req.status.value}); "
                           f"submit a new Request object")
    prompt = req.prompt_token_ids
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise RequestError(f"request {rid!r}: prompt_token_ids must be a non-empty list of token ids")
    if not _token_ids_ok(prompt):
        raise RequestError(f"request {rid!r}: prompt_token_ids must hold integers >= 0")
    limit = sched.config.max_model_len
    if len(prompt) >= limit:
        raise PromptTooLongError(f"request {rid!r}: prompt of {len(prompt)} tokens leaves no room for a "
                                 f"generated token within max_model_len={limit}")
    if not _is_int(req.max_tokens) or req.max_tokens < 1:
        raise RequestError(f"request {rid!r}: max_tokens must be an integer >= 1, got {req.max_tokens!r}")
    stops = req.stop_token_ids
    if not isinstance(stops, (list, tuple, set, frozenset)) or not all(_is_int(t) for t in stops):
        raise RequestError(f"request {rid!r}: stop_token_ids must be a sequence of token ids, got {stops!r}")
    if not isinstance(req.sampling, SamplingParams):
        raise RequestError(f"request {rid!r}: sampling must be a SamplingParams, got {req.sampling!r}")
    if not _is_int(req.priority) or not isinstance(req.tenant, str):
        raise RequestError(f"request {rid!r}: priority must be an integer and tenant a string")
    if req.arrival_time is not None and not (isinstance(req.arrival_time, (int, float))
                                             and req.arrival_time == req.arrival_time):
        raise RequestError(f"request {rid!r}: arrival_time must be a number or None, got {req.arrival_time!r}")
    adapter_pages = 0
    if req.adapter is not None:
        adapter_pages = sched.adapters.get(req.adapter).num_pages  # UnknownAdapterError names it
    _check_fits(sched, req, adapter_pages)


def _check_fits(sched: "Scheduler", req: Request, adapter_pages: int) -> None:
    """Its KV at full length plus its adapter must fit the pool, else it could never finish."""
    longest = min(len(req.prompt_token_ids) + req.max_tokens, sched.config.max_model_len) - 1
    pages = sched.kv.blocks_needed(longest) + adapter_pages
    if pages > sched.memory.pool.num_pages:
        raise RequestTooLargeError(f"request {req.request_id!r} needs {pages} pages at its full length "
                                   f"({longest} tokens of KV + {adapter_pages} adapter pages); the pool has "
                                   f"{sched.memory.pool.num_pages}")


def validate_result(sched: "Scheduler", reqs: list[Request], partial: list[int], result: StepResult) -> None:
    """Raise ``ValueError`` if ``result`` does not answer the step in flight.

    ``partial``: indices of the requests whose prefill chunk stopped short of their tokens; every other
    scheduled request has caught up and must have sampled.
    """
    sampled = result.sampled_token_ids
    if len(sampled) != len(reqs):
        raise ValueError(f"sampled_token_ids has {len(sampled)} entries for {len(reqs)} scheduled requests")
    if partial or not all(sampled):  # else every request sampled, as expected (the common step)
        _check_sampled(reqs, partial, sampled)
    names = list(result.loads_done) + list(result.loads_failed)
    if names:
        _check_loads(sched, names)


def _check_sampled(reqs: list[Request], partial: list[int], sampled: list[list[int]]) -> None:
    expected = [True] * len(reqs)
    for i in partial:
        expected[i] = False
    if list(map(bool, sampled)) != expected:
        i = next(i for i, (t, e) in enumerate(zip(sampled, expected)) if bool(t) != e)
        raise ValueError(f"request {reqs[i].request_id!r}: " + ("tokens sampled in the middle of its prefill"
                         if sampled[i] else "no token sampled although all its tokens were computed"))


def _check_loads(sched: "Scheduler", names: list[str]) -> None:
    if len(set(names)) != len(names):
        raise ValueError(f"an adapter is reported more than once in loads_done/loads_failed: {names}")
    for name in names:
        record = sched.adapters.get(name)
        if not record.resident or record.loaded:
            raise ValueError(f"adapter {name!r} has no load in flight")


def check_scheduler(sched: "Scheduler") -> None:
    waiting = list(sched.policy.waiting())
    assert len(waiting) == len(sched.policy) == len(set(map(id, waiting)))
    assert {r.request_id for r in waiting}.isdisjoint(r.request_id for r in sched.running)
    assert len(waiting) + len(sched.running) == len(sched.requests)
    assert len(sched.running) <= sched.config.max_num_seqs
    assert sched._running_ids == [r.request_id for r in sched.running]
    assert sched._running_slots == [r.slot for r in sched.running]
    counts: dict[str, int] = {}
    for req in sched.running:
        assert sched.requests[req.request_id] is req and req.status is RequestStatus.RUNNING
        assert req.block_table is sched.kv.block_table(req.request_id)
        assert req.window_table is (sched.kv.window_table(req.request_id) if sched.kv.num_groups > 1 else None)
        assert req.num_computed_tokens <= req.num_tokens
        if req.adapter is not None:
            counts[req.adapter] = counts.get(req.adapter, 0) + 1
            record = sched.adapters.get(req.adapter)
            assert record.loaded and record.pins >= counts[req.adapter] and record.slot == req.slot
    assert counts == sched.running_adapters and len(counts) <= sched.max_adapters
    if sched._all_decoding and sched.kv.prefix_caching:  # the next step's growth: `_schedule_decodes` reads
        #   a full table from a block to commit
        assert all(r.next_commit <= r.capacity for r in sched.running), "a full KV with no block to commit"
    awaiting = {rid for reqs in sched._awaiting.values() for rid in reqs}
    for req in waiting:
        assert sched.requests[req.request_id] is req and req.status.is_waiting
        assert req.request_id not in sched.kv and req.block_table is None and req.window_table is None
        assert (req.status is RequestStatus.WAITING_FOR_ADAPTER) == (req.request_id in awaiting)
    assert len(awaiting) == sum(map(len, sched._awaiting.values()))
    sched.memory.check()
