"""`Scheduler`: adapter-aware continuous batching over the unified pool.  Pure Python.

    add(request) ─► waiting queue (the policy's) ─┐
                                                  ▼
    schedule() = early aborts ─► running phase ─► admission phase ─► prefetch phase ─► SchedulerOutput
    update(StepResult) = adapter loads done/failed ─► new tokens, stops, prefix commits ─► [RequestOutput]
    abort(request_id): frees what the request holds, from any state

Phases:

0. **early aborts** — the policy may drop waiting requests (the SLO policy).
1. **running** (below) — every running request gets its next tokens under
   the budget (a prefill chunk or one decode token).  Its KV grows; if the
   pool is short, the pool's eviction policy reclaims cached KV and idle
   adapters (inside ``KVManager.grow``); if that is not enough, the
   scheduling policy picks a victim among the running requests not yet
   scheduled this step and it is preempted by recompute (KV freed, adapter
   unpinned, back to the queue).  Reserve mode never gets that far: its KV
   was reserved at admission.
2. **admission** (`unipage.scheduler.admission`; skipped in a step that
   preempted, and while ``prefill_coalesce_steps`` lets it wait for adapter
   loads: `Admission.waits`) — waiting requests in the policy's order; a
   request whose adapter cannot run now is skipped, never waited on, with a
   starvation bound.
3. **prefetch** (same module) — loads for the adapters of the next waiting
   requests, into free or reclaimable pages only.

Contracts with the memory layer: a running request pins its adapter (unpinned
at finish, preemption and abort) and owns the KV sequence named by its id;
the prefix-hash salt is the adapter's content digest (``""`` without
adapter); full blocks are committed after ``update``.  The scheduler is the
one caller of ``memory.adapters.take_effects()`` while it runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from unipage.memory import UnifiedMemory
from unipage.scheduler.admission import Admission, Step
from unipage.scheduler.config import SchedulerConfig
from unipage.scheduler.output import RequestOutput, SchedulerOutput, StepResult, make_outputs
from unipage.scheduler.policies import StepContext, make_policy
from unipage.scheduler.request import NEVER, FinishReason, Request, RequestStatus, next_check
from unipage.scheduler.validate import validate_request, validate_result

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING
_WAITING_FOR_ADAPTER = RequestStatus.WAITING_FOR_ADAPTER
_PREEMPTED, _FINISHED, _ABORTED = RequestStatus.PREEMPTED, RequestStatus.FINISHED, RequestStatus.ABORTED
_STOP, _LENGTH, _ABORT = FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT  # (a member read from
#   its class is slow in Python 3.11)


def _append_tokens(req: Request, tokens: list[int]) -> tuple[list[int], FinishReason | None]:
    """Append several sampled tokens (speculative decoding); those after a finish are dropped."""
    all_tokens = req.all_token_ids
    for i, token in enumerate(tokens):
        all_tokens.append(token)
        if token in req.stop_set:
            return tokens[:i + 1], _STOP
        if len(all_tokens) >= req.max_len:
            return tokens[:i + 1], _LENGTH
    return tokens, None


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0
    admitted: int = 0  # admissions, resumptions after preemption included
    preemptions: int = 0
    skips: int = 0  # times a waiting request was passed over for want of an adapter slot or pages
    finished: int = 0
    aborted: int = 0  # by abort(), early abort or a failed load
    prefix_hit_tokens: int = 0  # prompt tokens taken from the prefix cache at admission
    coalesced: int = 0  # steps whose admission waited for adapter loads (`prefill_coalesce_steps`)


class Scheduler:
    def __init__(self, memory: UnifiedMemory, config: SchedulerConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.memory = memory
        self.config = config = config or SchedulerConfig()
        self.clock = clock  # seconds; the simulator passes its own
        self.kv, self.adapters = memory.kv, memory.adapters
        self.block_tokens = memory.config.pool.block_tokens
        self.max_adapters = memory.config.lora.max_adapters_per_batch
        self.policy = make_policy(config.policy, config)
        self.requests: dict[str, Request] = {}  # every live request (not finished, not aborted)
        self.running: list[Request] = []  # admission order
        self._running_ids: list[str] = []  # their ids and adapter slots, in that order (the batch lists of the
        self._running_slots: list[int] = []  # common decode step, kept as requests come and go)
        self.stats = SchedulerStats()
        self._reserve = config.admission == "reserve"
        self._slides = bool(self.kv.window)  # sliding-window layers return pages that leave the window
        self._grouped = self.kv.num_groups > 1  # ... from a block table of their own
        self._chunk = config.long_prefill_token_threshold or config.max_num_batched_tokens
        self._ahead = config.decode_kv_ahead
        if self._ahead >= self.block_tokens:
            raise ValueError(f"decode_kv_ahead {self._ahead} must be below a KV block ({self.block_tokens} tokens)")
        self.running_adapters: dict[str, int] = {}  # adapter -> running requests using it (read-only)
        self._awaiting: dict[str, dict[str, Request]] = {}  # adapter -> its WAITING_FOR_ADAPTER requests
        self._in_flight: Step | None = None  # the step being run
        self._all_decoding = False  # every running request has exactly one token to compute
        self._seq = 0
        self._finished_ids: list[str] = []
        self._aborted_ids: list[str] = []
        self._abandoned_ids: list[str] = []  # preempted by `abandon_step`: the next output's preempted_ids
        self._pending: list[RequestOutput] = []  # outputs decided in schedule(), returned by update()
        self._stop_sets: dict[frozenset, frozenset] = {}  # one object per distinct stop set (`_stop_set`)
        self._admission = Admission(self)

    # -- API -----------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request; a bad one raises a `RequestError` (or `UnknownAdapterError`), changing nothing."""
        validate_request(self, request)
        request.arrival_time = self.clock() if request.arrival_time is None else float(request.arrival_time)
        request.all_token_ids = list(request.prompt_token_ids)
        request.num_prompt_tokens = len(request.all_token_ids)
        request.max_len = min(request.num_prompt_tokens + request.max_tokens, self.config.max_model_len)
        request.stop_set = self._stop_set(request.stop_token_ids)
        request.seq, self._seq = self._seq, self._seq + 1
        self.requests[request.request_id] = request
        self.policy.push(request)

    def _stop_set(self, stop_token_ids) -> frozenset:
        """The frozenset of ``stop_token_ids``, one object for equal sets (up to 256 of them): the requests'
        stop tests, every step, then read the same memory."""
        stops = frozenset(stop_token_ids)
        shared = self._stop_sets.get(stops)
        if shared is None and len(self._stop_sets) < 256:
            shared = self._stop_sets[stops] = stops
        return stops if shared is None else shared

    def abort(self, request_id: str) -> bool:
        """Drop a live request at once, freeing its KV and its adapter pin; False if it is not live."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        if req.status is _RUNNING:
            if self._in_flight is None and req.num_computed_tokens >= req.next_commit:
                self._commit_running_upto(req)
            self._remove_running(req)
        self._drop(req, _ABORTED, _ABORT)
        return True

    def abandon_step(self) -> list[str]:
        """The executor could not run the step in flight (its forward pass raised): the step's running
        requests are preempted by recompute (their KV freed, back to waiting, listed in the next output's
        ``preempted_ids``) and the step is no longer in flight, so `schedule` may be called again.  The
        adapter loads the step started stay in flight: report them through a later `update` as usual.
        Returns the preempted ids."""
        step = self._in_flight
        if step is None:
            raise RuntimeError("no step in flight: nothing to abandon")
        self._in_flight = None
        self._all_decoding = False  # its premise (every running request sampled in the last step) is void
        ids = []
        for req in step.reqs:
            if req.status is _RUNNING:
                self._remove_running(req)
                self._preempt(req, ids)
        self._abandoned_ids += ids
        return ids

    def get(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.policy)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        """Build the next step: what each request computes, and the adapter data to move first."""
        if self._in_flight is not None:
            raise RuntimeError(f"step {self.stats.steps - 1} is in flight: call update() before schedule()")
        step = Step(self.stats.steps, self.config.max_num_batched_tokens)
        ctx = StepContext(self.clock(), self.running_adapters, len(self.running),
                          self.config.max_num_batched_tokens)
        self._early_abort(ctx)
        self._schedule_running(step)
        if step.out.preempted_ids:  # memory is short this step: admit nothing
            self._admission.waited = 0
        elif not self._admission.waits(step, ctx):
            self._admission.admit(step, ctx)
        if self._ahead:
            self._room_ahead(step)
        self._admission.prefetch(step, ctx)
        return self._seal(step)

    def update(self, result: StepResult) -> list[RequestOutput]:
        """Take the executor's results for the step in flight; returns every request's new tokens."""
        step = self._in_flight
        if step is None:
            raise RuntimeError("no step in flight: call schedule() before update()")
        validate_result(self, step.reqs, step.partial, result)
        self._in_flight = None
        self._apply_loads(result)
        outputs, self._pending = self._pending, []
        single, one_each = self._apply_tokens(step, result.sampled_token_ids, outputs)
        # Next step, may every running request simply decode one token?  Yes if each sampled one just now.
        self._all_decoding = single and step.all_running and not step.partial
        if one_each:
            self.policy.on_decode_step(step.reqs, result.sampled_token_ids)
        else:
            self.policy.on_step(step.reqs, result.sampled_token_ids)
        return outputs

    # -- phase 0: early aborts -----------------------------------------------
    def _early_abort(self, ctx: StepContext) -> None:
        for req, detail in self.policy.early_aborts(ctx):
            self._drop(req, RequestStatus.ABORTED, FinishReason.SLO, detail)

    # -- phase 1: running requests -------------------------------------------
    def _schedule_running(self, step: Step) -> None:
        """Every running request gets its next tokens while the budget lasts: grow KV, else reclaim, else preempt.

        First, with prefix caching, each commits the blocks it filled since the last step (`_commit`).
        """
        start = 0
        if self._slides:  # (commit first: the blocks that leave the window keep their registrations)
            slide, commit = self.kv.slide, self.kv.prefix_caching
            for req in self.running:
                if commit and req.num_computed_tokens >= req.next_commit:
                    self._commit(req)
                slide(req.request_id, req.num_computed_tokens)
        if self._all_decoding and len(self.running) <= step.budget:
            start = self._schedule_decodes(step)  # (it commits, for every running request)
        if start < len(self.running):
            self._schedule_from(start, step)
        step.num_running = len(step.reqs)
        if step.out.preempted_ids:
            self.running = [r for r in self.running if r.status is _RUNNING]
            self._running_ids = [r.request_id for r in self.running]
            self._running_slots = [r.slot for r in self.running]

    def _schedule_decodes(self, step: Step) -> int:
        """The common step: every running request decodes one token, and the budget covers them all.

        The same outcome as `_schedule_from`, in fewer operations: the requests whose KV is full get a
        block each at once, and the batch lists are built in one go.  If those blocks cannot all be had
        without a preemption, it goes one by one and stops at the first request that would need one, and
        returns how many requests it scheduled; `_schedule_from` takes over from there.
        """
        running, full = self.running, []
        if self.kv.prefix_caching and not self._slides:  # (with slides, the slide loop committed)
            commit, block = self.kv.commit, self.block_tokens
            for req in running:  # the hottest loop of a step
                done = req.num_computed_tokens
                if done >= req.next_commit:  # a block filled: commit it (`_commit`, inlined) ...
                    commit(req.request_id, req.all_token_ids, done)
                    req.next_commit = (done // block + 1) * block
                    if done >= req.capacity:  # ... and if it was the last, one more (next_commit <= capacity)
                        full.append(req)
                req.num_computed_tokens = done + 1
        else:
            for req in running:
                done = req.num_computed_tokens
                if done >= req.capacity:
                    full.append(req)
                req.num_computed_tokens = done + 1
        if full and not self._grow_each(full, step):
            for req in running:
                req.num_computed_tokens -= 1
            return self._schedule_decodes_one_by_one(step)
        self._add_decodes(len(running), step)
        return len(running)

    def _schedule_decodes_one_by_one(self, step: Step) -> int:
        """`_schedule_decodes` when memory is short: growth one request at a time, up to a preemption."""
        running, scheduled = self.running, len(self.running)
        for req in running:
            done = req.num_computed_tokens
            if done >= req.capacity and not self._extend_kv(req, done + 1, step):
                scheduled = running.index(req)
                break
            req.num_computed_tokens = done + 1
        self._add_decodes(scheduled, step)
        return scheduled

    def _add_decodes(self, scheduled: int, step: Step) -> None:
        """Put ``running[:scheduled]``, one token each, in the batch."""
        batch = self.running[:scheduled]
        step.reqs += batch
        step.out.num_scheduled_tokens += [1] * scheduled
        step.out.token_slots += self._running_slots[:scheduled]
        step.budget -= scheduled

    def _grow_each(self, reqs: list[Request], step: Step) -> bool:
        """A KV block more for each of ``reqs``, as `_extend_kv` one by one would; False (nothing changed) if
        they do not all fit without a preemption."""
        if not self.kv.grow_each([req.request_id for req in reqs]):
            return False
        new_blocks, block = step.out.new_block_ids, self.block_tokens
        for req in reqs:
            new_blocks[req.request_id] = req.block_table[-1:]
            req.capacity += block
        if self._grouped:
            for req in reqs:
                step.out.new_window_block_ids[req.request_id] = req.window_table[-1:]
        return True

    def _schedule_from(self, start: int, step: Step) -> None:
        """The general loop over ``running[start:]``: prefill chunks, decodes, several tokens, preemption.
        From the start (``start`` 0), it commits for every running request first."""
        if not start and self.kv.prefix_caching:
            for req in self.running:
                if req.num_computed_tokens >= req.next_commit:
                    self._commit(req)
        chunk, budget = self._chunk, step.budget
        reqs, counts, slots = step.reqs, step.out.num_scheduled_tokens, step.out.token_slots
        for req in self.running[start:] if start else self.running:
            if req.status is not _RUNNING:  # preempted earlier in this loop
                continue
            done = req.num_computed_tokens
            n = len(req.all_token_ids) - done
            if n > budget or n > chunk:  # a prefill chunk that stops short: it samples nothing
                n = min(n, budget, chunk)
                if done + n > req.capacity and not self._grow(req, done + n, step):
                    continue  # preempted itself
                step.partial.append(len(reqs))
            elif done + n > req.capacity and not self._grow(req, done + n, step):
                continue
            reqs.append(req)
            counts.append(n)
            if n == 1:
                slots.append(req.slot)
            else:
                slots.extend([req.slot] * n)
            req.num_computed_tokens = done + n
            budget -= n
            if not budget:
                break
        step.budget = budget

    def _room_ahead(self, step: Step) -> None:
        """``decode_kv_ahead``: in a step of decodes only (the kind the engine runs ahead of), each request that
        goes on past it gets KV room for that many tokens past the step's, where `_extend_kv` finds a page
        free or reclaimable.  It comes after every request's own room and the admission, so it never takes
        a page they need, and never preempts; the first request it cannot serve ends it."""
        out, reqs = step.out, step.reqs
        if step.partial or out.new_requests or self.config.max_num_batched_tokens - step.budget != len(reqs):
            return
        ahead = self._ahead
        for req in reqs:
            done = req.num_computed_tokens  # (this step's token included)
            if done + ahead > req.capacity and done + 1 < req.max_len and not self._extend_kv(req, done + ahead,
                                                                                               step):
                return

    def _grow(self, req: Request, tokens: int, step: Step) -> bool:
        """Room for ``tokens`` tokens of KV; preempt victims (not yet scheduled) until it fits. False: req was one."""
        while not self._extend_kv(req, tokens, step):  # grow reclaims cached KV and idle adapters first
            if self._reserve:
                raise RuntimeError(f"reserve mode: request {req.request_id!r} outgrew its reservation")
            later = self.running[self.running.index(req):]  # not yet scheduled this step
            victim = self.policy.victim([r for r in later if r.status is _RUNNING])
            self._preempt(victim, step.out.preempted_ids)
            if victim is req:
                return False
        return True

    def _extend_kv(self, req: Request, tokens: int, step: Step) -> bool:
        """Room for ``tokens`` tokens of KV, reclaiming but never preempting; False (nothing changed) if short."""
        have = len(req.block_table)
        if not self.kv.grow(req.request_id, tokens):
            return False
        step.out.new_block_ids.setdefault(req.request_id, []).extend(req.block_table[have:])
        if self._grouped:
            step.out.new_window_block_ids.setdefault(req.request_id, []).extend(req.window_table[have:])
        req.capacity = len(req.block_table) * self.block_tokens
        return True

    def _preempt(self, req: Request, preempted_ids: list[str]) -> None:
        """Preempt a running request by recompute (the caller updates ``self.running``); its id goes to
        ``preempted_ids``."""
        self._release_running(req)
        req.transition(_PREEMPTED)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.skips = 0
        self.policy.push(req)
        preempted_ids.append(req.request_id)
        self.stats.preemptions += 1

    def _seal(self, step: Step) -> SchedulerOutput:
        out = step.out
        step.all_running = len(step.reqs) == len(self.running)  # then in the same order
        out.req_ids = self._running_ids[:] if step.all_running else [r.request_id for r in step.reqs]
        out.running_ids = out.req_ids[:step.num_running]
        out.total_num_scheduled_tokens = self.config.max_num_batched_tokens - step.budget
        if step.all_running:
            out.adapters = list(self.running_adapters)
        else:
            out.adapters = list(dict.fromkeys(r.adapter for r in step.reqs if r.adapter is not None))
        out.adapter_effects = self.adapters.take_effects()
        out.aborted_ids, self._aborted_ids = self._aborted_ids, []
        if self._abandoned_ids:  # preempted by abandon_step() since the last output: listed first
            out.preempted_ids = self._abandoned_ids + out.preempted_ids
            self._abandoned_ids = []
        out.finished_ids, self._finished_ids = self._finished_ids, []
        self._in_flight = step
        self.stats.steps += 1
        return out

    # -- update --------------------------------------------------------------
    def _apply_loads(self, result: StepResult) -> None:
        """Requests waiting for a loaded adapter wait no more; those waiting for a failed one are dropped."""
        for name in result.loads_done:
            self.adapters.load_done(name)
            for req in self._awaiting.pop(name, {}).values():
                req.transition(_WAITING)
        for name in result.loads_failed:
            self.adapters.load_failed(name)
            for req in list(self._awaiting.get(name, {}).values()):
                self._drop(req, RequestStatus.ABORTED, FinishReason.LOAD_FAILED, f"adapter {name!r} failed to load")

    def _apply_tokens(self, step: Step, sampled: list[list[int]], outputs: list[RequestOutput]) -> tuple[bool, bool]:
        """Append sampled tokens, finish on a stop token or the length, commit newly full KV blocks.

        Most requests decode one token that changes nothing else: the hot loop does only that, and leaves the
        others ("events": a prefill chunk, a block to commit, a first or last token) to `_apply_event`, in
        batch order.  Returns whether every request that goes on sampled at most one token, and whether every
        request in the batch sampled exactly one.
        """
        reqs, events = step.reqs, []
        for req, tokens in zip(reqs, sampled):  # the hot loop: one new token each for most requests
            if req.num_computed_tokens < req.next_check:  # (0 once it stopped running: an event)
                try:
                    [token] = tokens  # (cheaper than len() and two subscripts)
                except ValueError:  # none (a prefill chunk) or several
                    events.append(req)
                    continue
                if token not in req.stop_set:
                    req.all_token_ids.append(token)
                    continue
            events.append(req)
        made = make_outputs(step.out.req_ids, sampled)  # batch order; events replace theirs
        now, single, one_each, silent, i, find = self.clock(), True, True, False, -1, reqs.index
        for req in events:
            i = find(req, i + 1)  # its place in the batch (events are in batch order: a search in C from the last)
            tokens = sampled[i]
            made[i] = output = self._apply_event(req, tokens, now, made[i])
            if output is None:
                silent = True
            if len(tokens) != 1:
                one_each = False
                single = single and output is None
        outputs += [o for o in made if o is not None] if silent else made
        return single, one_each

    def _apply_event(self, req: Request, tokens: list[int], now: float, plain: RequestOutput) -> RequestOutput | None:
        """A request off the hot loop; returns its output (None: aborted while the step ran, or mid-prefill).

        ``plain``: its output had it simply decoded, returned if it stands.
        """
        if req.status is not _RUNNING:
            return None
        if not tokens:  # a prefill chunk (its blocks commit at the next schedule())
            return None
        if len(tokens) == 1:
            token = tokens[0]
            req.all_token_ids.append(token)
            reason = _STOP if token in req.stop_set else _LENGTH if len(req.all_token_ids) >= req.max_len else None
        else:
            tokens, reason = _append_tokens(req, tokens)
        if req.first_token_time is None:
            req.first_token_time = now
        req.next_check = next_check(req)
        if reason is not None:
            if req.num_computed_tokens >= req.next_commit:  # its last blocks, before they are cached
                self._commit_running_upto(req)
            self._drop(req, _FINISHED, reason)
            self._remove_running(req)
        else:
            if tokens is plain[1]:  # its new_token_ids (a subscript: cheaper than the property)
                return plain
        return RequestOutput.of(req.request_id, tokens, reason)

    def _commit_running_upto(self, req: Request) -> None:
        """`_commit` ``req`` (it leaves now), after the running requests ahead of it commit what they computed:
        of equal blocks, the first in batch order registers, as if every request committed in `update`."""
        for r in self.running:  # the earlier ones first, as update() used to: the same copy of a block registers
            if r is req:
                self._commit(r)
                break
            if r.num_computed_tokens >= r.next_commit:  # (next_commit left as is: the next schedule() sees it)
                self.kv.commit(r.request_id, r.all_token_ids, r.num_computed_tokens)

    def _commit(self, req: Request) -> None:
        """Register the request's newly full blocks of computed tokens in the prefix cache.

        A running request commits at the start of the next `schedule` (before anything there looks a prefix
        up), when it finishes, or when it is aborted between steps: never in `update`'s hot loop.
        """
        done = req.num_computed_tokens
        self.kv.commit(req.request_id, req.all_token_ids, done)
        req.next_commit = (done // self.block_tokens + 1) * self.block_tokens

    # -- bookkeeping ---------------------------------------------------------
    def _await_adapter(self, req: Request, name: str) -> None:
        if req.status is not _WAITING_FOR_ADAPTER:
            req.transition(_WAITING_FOR_ADAPTER)
            self._awaiting.setdefault(name, {})[req.request_id] = req

    def _adapter_arrived(self, req: Request) -> None:
        self._leave_awaiting(req)
        req.transition(_WAITING)

    def _leave_awaiting(self, req: Request) -> None:
        waiting = self._awaiting[req.adapter]
        del waiting[req.request_id]
        if not waiting:
            del self._awaiting[req.adapter]

    def _add_running(self, req: Request) -> None:
        self.running.append(req)
        self._running_ids.append(req.request_id)
        self._running_slots.append(req.slot)

    def _remove_running(self, req: Request) -> None:
        """O(running) in C; finishes are few per step."""
        i = self.running.index(req)
        del self.running[i], self._running_ids[i], self._running_slots[i]

    def _release_running(self, req: Request) -> None:
        """Free a running request's KV and unpin its adapter (the caller updates ``self.running``)."""
        self.kv.free(req.request_id)
        req.block_table = req.window_table = None
        req.capacity = 0
        req.next_commit = NEVER
        req.next_check = 0  # an update() with it in the batch (aborted while the step ran) looks closer
        name = req.adapter
        if name is not None:
            self.adapters.unpin(name)
            left = self.running_adapters[name] - 1
            if left:
                self.running_adapters[name] = left
            else:
                del self.running_adapters[name]

    def _drop(self, req: Request, status: RequestStatus, reason: FinishReason, detail: str = "") -> None:
        """Finish or abort ``req`` from any live state, releasing what it holds."""
        if req.status is _RUNNING:
            self._release_running(req)
        else:
            if req.status is _WAITING_FOR_ADAPTER:
                self._leave_awaiting(req)
            self.policy.remove(req)
        req.transition(status)
        req.finish_reason = reason
        req.finish_time = self.clock()
        del self.requests[req.request_id]
        if status is _FINISHED:
            self._finished_ids.append(req.request_id)
            self.stats.finished += 1
        else:
            self._aborted_ids.append(req.request_id)
            self.stats.aborted += 1
            if reason is not _ABORT:  # the scheduler's own decision: tell the caller why
                self._pending.append(RequestOutput.of(req.request_id, [], reason, detail))

    def check(self) -> None:
        """Assert the scheduler's invariants and the memory's (O(requests + pages); for tests)."""
        from unipage.scheduler.validate import check_scheduler

        check_scheduler(self)
