"""Phases 2 and 3 of a step: admission of waiting requests, and adapter prefetch.

Admission walks the policy's candidates (at most ``lookahead``) and admits
each request whose adapter can run now and whose KV fits.  It never waits on
an adapter (the scheduler may skip a whole admission for a few steps while
loads are in flight: ``prefill_coalesce_steps``): a request is *skipped* when

- its adapter would be one too many for ``max_adapters_per_batch`` among the
  running requests (``_SKIP_LIMIT``),
- its adapter is not resident: its load is started if pages can be had
  (``_SKIP_LOADING``) or not (``_SKIP_NO_SPACE``); the request becomes
  WAITING_FOR_ADAPTER until the load completes,
- its adapter is being drained for a starving request (``_SKIP_DRAIN``),

and the requests behind it still run.  A request whose KV does not fit ends
admission: memory is what the ones behind it need too.

Starvation bound: a request passed over more than ``max_skips`` times for
want of a slot or pages (a load in flight does not count) is *starving*.
Starving for pages, it blocks everything behind it, so finishing requests
free them.  Starving for a slot, the next free adapter slot is reserved for
its adapter and the running adapter with the fewest requests admits no new
ones until it drains; the rest of the batch goes on.

Prefetch loads the adapters of the next ``prefetch_depth`` waiting requests,
only when the pages are free or reclaimable beyond a block per running request,
never evicting an adapter the step uses or passed over (``Step.protect``).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from unipage.adapters import Residency
from unipage.eviction import ADAPTER
from unipage.scheduler.output import NewRequestData, SchedulerOutput
from unipage.scheduler.policies import StepContext
from unipage.scheduler.request import NEVER, FinishReason, Request, RequestStatus, next_check

if TYPE_CHECKING:
    from unipage.scheduler.scheduler import Scheduler

_RUNNING = RequestStatus.RUNNING
_WAITING_FOR_ADAPTER = RequestStatus.WAITING_FOR_ADAPTER
_READY, _LOADING = Residency.READY, Residency.LOADING  # (a member read from its class is slow in Python 3.11)
# Admission outcomes.  Skips for want of an adapter slot or pages count towards max_skips; a load in
# flight does not, nor being held back while its adapter drains for a starving request.
_ADMITTED, _NO_MEMORY, _DROPPED, _SKIP_LOADING, _SKIP_LIMIT, _SKIP_NO_SPACE, _SKIP_DRAIN = range(7)


def close_iterator(iterator) -> None:
    """Close a policy's candidates generator (it may put back what it took off a heap)."""
    close = getattr(iterator, "close", None)
    if close is not None:
        close()


class Step:
    """The step being built: its output, what is left of its budget, and per-step memos."""

    __slots__ = ("out", "budget", "reqs", "num_running", "partial", "protect", "skip_adapters", "blocked",
                 "all_running")

    def __init__(self, index: int, budget: int) -> None:
        self.out = SchedulerOutput(index)
        self.budget = budget  # tokens still to hand out
        self.reqs: list[Request] = []  # scheduled requests, batch order (parallel to out.req_ids)
        self.num_running = 0  # reqs[:num_running] were running before this step
        self.partial: list[int] = []  # indices in reqs of prefill chunks that stop short: they sample nothing
        self.protect: set = set()  # (ADAPTER, name): adapters admitted or loading for requests earlier in the
        #   order; what comes later never evicts them
        self.skip_adapters: dict[str, int] = {}  # adapter -> why its requests are skipped this step
        self.blocked = False  # a request starving for pages stopped admission
        self.all_running = False  # every running request is in the batch (set when the step is sealed)


class Admission:
    """Admission and prefetch on a scheduler's bookkeeping; holds the adapter-slot reservation."""

    def __init__(self, sched: "Scheduler") -> None:
        self.sched = sched
        self.config, self.kv, self.adapters = sched.config, sched.kv, sched.adapters
        self.block_tokens = sched.block_tokens
        self.chunk = self.config.long_prefill_token_threshold or self.config.max_num_batched_tokens
        self.reserve = self.config.admission == "reserve"
        self.reserved_for: Request | None = None  # starving for an adapter slot: the next free one is its
        self.draining: str | None = None  # running adapter admitting nothing new, so that a slot frees
        self.waited = 0  # consecutive steps whose admission waited for adapter loads (`waits`)

    # -- phase 2 -------------------------------------------------------------
    def waits(self, step: Step, ctx: StepContext) -> bool:
        """Whether admission waits this step (config ``prefill_coalesce_steps``): among the requests it would
        examine (the policy's first ``lookahead`` candidates), some prompt is ready but the ready ones fill less
        than the step, an adapter load is in flight for one that could then join the batch, and no adapter
        admission would start loading is waiting to be requested; every running request only decodes (a step
        without prefill: a CUDA graph's), the batch has room, and fewer than ``prefill_coalesce_steps`` steps in a
        row have waited.  So prompts whose adapters land a step or two apart start in one prefill step, not one
        each: a step with prefill has a fixed cost (eager launches) far above a decode step's.  An adapter that
        cannot join (no slot, draining) is not waited for.  The ready count follows the policy's candidates (the
        vtc policy offers one request per client)."""
        sched, cfg = self.sched, self.config
        if (self.waited < cfg.prefill_coalesce_steps and sched._all_decoding and sched.running
                and len(sched.running) < cfg.max_num_seqs and len(sched.policy) and self._worth_waiting(step, ctx)):
            self.waited += 1
            sched.stats.coalesced += 1
            return True
        self.waited = 0
        return False

    def _worth_waiting(self, step: Step, ctx: StepContext) -> bool:
        """Over the policy's first ``lookahead`` waiting requests (preempted ones included): some prompt could start
        now but the ready ones fill less than ``step.budget``, a load worth waiting for is in flight, and no request
        whose adapter could join is neither resident nor loading (admission must run to request it)."""
        ready, loading, find = 0, False, self.adapters.find
        candidates = self.sched.policy.candidates(ctx)
        try:
            for req in itertools.islice(candidates, self.config.lookahead):
                if not req.status.is_waiting:
                    continue
                name = req.adapter
                record = find(name) if name is not None else None
                if name is None or (record is not None and record.resident and record.loaded):
                    ready += req.num_tokens - req.num_computed_tokens
                    if ready >= step.budget:
                        return False
                elif record is None or not self.could_run(name):  # unregistered (admission drops it), or no slot
                    continue
                elif record.resident:  # its load is in flight
                    loading = True
                else:
                    return False
        finally:
            close_iterator(candidates)
        return loading and ready > 0

    def admit(self, step: Step, ctx: StepContext) -> None:
        """Admit waiting requests in the policy's order; skip (never wait on) what cannot run now."""
        sched, cfg = self.sched, self.config
        if not len(sched.policy) or not step.budget or len(sched.running) >= cfg.max_num_seqs:
            return
        self._refresh_reservation()
        self._protect_reserved(step)
        admitted, dropped, examined = [], [], 0
        candidates = sched.policy.candidates(ctx)
        # The reserved request is examined first: requests put back ahead of it (preempted ones) would hide
        # it behind the lookahead while the slot they wait for is kept for it (a deadlock).
        owner = self.reserved_for
        try:
            for req in itertools.chain((owner,) if owner is not None else (), candidates):
                if not step.budget or len(sched.running) >= cfg.max_num_seqs or examined == cfg.lookahead:
                    break
                if not req.status.is_waiting or (req is owner and examined):
                    continue
                examined += 1
                outcome = self._try_admit(req, step)
                if outcome == _ADMITTED:
                    admitted.append(req)
                elif outcome == _NO_MEMORY:
                    break
                elif outcome == _DROPPED:
                    dropped.append(req)
                elif outcome == _SKIP_LIMIT or outcome == _SKIP_NO_SPACE:
                    sched.stats.skips += 1
                    req.skips += 1
                    if req.skips > cfg.max_skips and self._starving(req, outcome, step):
                        break
        finally:
            close_iterator(candidates)
        for req in admitted:
            sched.policy.remove(req)
        for req in dropped:
            sched._drop(req, RequestStatus.ABORTED, FinishReason.LOAD_FAILED,
                        f"adapter {req.adapter!r} was unregistered")

    def _starving(self, req: Request, outcome: int, step: Step) -> bool:
        """``req`` was passed over too often; True: admit nothing behind it this step."""
        if outcome == _SKIP_NO_SPACE:
            step.blocked = True
            return True
        if self.reserved_for is None:
            running = self.sched.running_adapters
            self.reserved_for = req
            self.draining = min(running, key=running.__getitem__)
        return False

    def _refresh_reservation(self) -> None:
        owner = self.reserved_for
        if owner is not None and not owner.status.is_waiting:  # admitted or dropped: the slot is free to all
            self.reserved_for = self.draining = None
        elif self.draining is not None and self.draining not in self.sched.running_adapters:
            self.draining = None  # drained: the reservation keeps its slot

    def _protect_reserved(self, step: Step) -> None:
        if self.reserved_for is not None and self.reserved_for.adapter is not None:
            step.protect.add((ADAPTER, self.reserved_for.adapter))

    def _try_admit(self, req: Request, step: Step) -> int:
        name = req.adapter
        if name is not None:
            outcome = self._adapter_outcome(req, name, step)
            if outcome is not None:
                return outcome
        if req.status is _WAITING_FOR_ADAPTER:  # its adapter is resident after all
            self.sched._adapter_arrived(req)
        n = self._open_kv(req, step)
        if not n:
            return _NO_MEMORY
        self._start_running(req, n, step)
        return _ADMITTED

    def _adapter_outcome(self, req: Request, name: str, step: Step) -> int | None:
        """None if ``name`` can run in this step; else why ``req`` is skipped."""
        outcome = step.skip_adapters.get(name)
        if outcome is None:
            if name == self.draining:
                outcome = _SKIP_DRAIN
            elif name not in self.sched.running_adapters and not self._slot_for(name):
                outcome = _SKIP_LIMIT
                if self.reserved_for is not None and name == self.reserved_for.adapter:
                    self._request_adapter(name, step)  # loaded ahead for when its slot frees
            else:
                outcome = self._request_adapter(name, step)
                if outcome is None or outcome == _DROPPED:
                    return outcome
            step.skip_adapters[name] = outcome
        if outcome == _SKIP_LOADING or outcome == _SKIP_NO_SPACE:
            self.sched._await_adapter(req, name)
        return outcome

    def could_run(self, name: str) -> bool:
        """Whether a request of adapter ``name`` could join this step's batch once its adapter is resident:
        not draining, and running already or a free slot (`_slot_for`)."""
        return name != self.draining and (name in self.sched.running_adapters or self._slot_for(name))

    def _slot_for(self, name: str) -> bool:
        """May a new adapter join the batch?  A reserved slot goes to its adapter only."""
        free = self.sched.max_adapters - len(self.sched.running_adapters)
        owner = self.reserved_for
        return free > 0 if owner is None or name == owner.adapter else free > 1

    def _request_adapter(self, name: str, step: Step) -> int | None:
        """Make ``name`` resident: None if it is, else the skip outcome (its load started if pages allow).

        From here on the step protects ``name``: what comes later in the order never evicts it.  An adapter
        whose requests cannot take a slot this step is not protected, or it could hold the pages that the
        reserved slot's request needs (a deadlock).
        """
        if name not in self.adapters:
            return _DROPPED  # unregistered while its requests waited
        state = self.adapters.request(name, step.protect)
        step.protect.add((ADAPTER, name))
        if state is _READY:
            return None
        return _SKIP_LOADING if state is _LOADING else _SKIP_NO_SPACE

    def _open_kv(self, req: Request, step: Step) -> int:
        """Open the request's KV with its cached prefix and grow it for this step (reserve: its whole life).

        Returns the tokens it gets this step, or 0 (nothing held) if its KV does not fit.
        """
        rid, tokens, kv, block = req.request_id, req.all_token_ids, self.kv, self.block_tokens
        # The digest of the weights it will run with now (a name may have been re-registered since add()).
        req.salt = self.adapters.get(req.adapter).info.digest if req.adapter is not None else ""
        cached = 0
        if kv.prefix_caching and len(tokens) > block and kv.match_prefix(tokens[:block], req.salt):
            # hash the whole prompt only after a first-block hit
            cached = kv.open(rid, tokens, req.salt, max_cached_tokens=len(tokens) - 1)
        else:
            kv.open(rid, (), req.salt)
        n = min(len(tokens) - cached, step.budget, self.chunk)
        need = max(req.max_len - 1, cached + n) if self.reserve else cached + n
        if not kv.grow(rid, need, step.protect):
            kv.free(rid)
            return 0
        req.num_cached_tokens = req.num_computed_tokens = cached
        req.block_table = kv.block_table(rid)
        if kv.num_groups > 1:
            req.window_table = kv.window_table(rid)
        req.capacity = len(req.block_table) * block
        return n

    def _start_running(self, req: Request, n: int, step: Step) -> None:
        sched, name, out, cached = self.sched, req.adapter, step.out, req.num_computed_tokens
        if name is not None:
            self.adapters.pin(name)
            req.slot = self.adapters.get(name).slot
            sched.running_adapters[name] = sched.running_adapters.get(name, 0) + 1
        req.transition(_RUNNING)
        req.skips = 0
        req.next_commit = cached + self.block_tokens if self.kv.prefix_caching else NEVER
        req.next_check = next_check(req)
        window = list(req.window_table) if req.window_table is not None else None
        out.new_requests.append(NewRequestData(req.request_id, list(req.all_token_ids), req.num_prompt_tokens,
                                               name, req.slot, req.sampling, list(req.block_table), cached,
                                               window))
        if cached + n < req.num_tokens:
            step.partial.append(len(step.reqs))
        out.num_scheduled_tokens.append(n)
        out.token_slots.extend([req.slot] * n)
        step.reqs.append(req)
        step.budget -= n
        req.num_computed_tokens = cached + n
        sched._add_running(req)
        sched.policy.on_admit(req)
        sched.stats.admitted += 1
        sched.stats.prefix_hit_tokens += cached

    # -- phase 3 -------------------------------------------------------------
    def prefetch(self, step: Step, ctx: StepContext) -> None:
        """Start loads for the adapters of the next waiting requests, into free or reclaimable pages only."""
        sched, depth = self.sched, self.config.prefetch_depth
        if step.blocked or not depth or not len(sched.policy):
            return
        self._refresh_reservation()
        self._protect_reserved(step)
        headroom = len(sched.running)  # a block per running request: what the next step may need
        seen = 0
        candidates = sched.policy.candidates(ctx)
        try:
            for req in candidates:
                if seen == depth:
                    break
                if not req.status.is_waiting:
                    continue
                seen += 1
                name = req.adapter
                record = self.adapters.find(name) if name is not None else None
                if record is None:
                    continue
                if not record.resident and self._spare_pages(step.protect) >= record.num_pages + headroom:
                    self.adapters.request(name, step.protect)
                step.protect.add((ADAPTER, name))
                if not (record.resident and record.loaded):
                    sched._await_adapter(req, name)
        finally:
            close_iterator(candidates)

    def _spare_pages(self, protect: set) -> int:
        """Pages free or reclaimable without touching ``protect``."""
        memory = self.sched.memory
        held = sum(self.adapters.get(name).num_pages for kind, name in protect if (kind, name) in memory.reclaimer)
        return memory.pool.num_free + memory.reclaimer.evictable_pages - held
