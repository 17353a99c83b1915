"""Scheduling policies: the waiting queue's order, preemption victims, early aborts.

A policy owns the waiting queue.  The scheduler pushes a request when it
arrives or is preempted and removes it when it is admitted or dropped; each
step it walks ``candidates(ctx)`` and admits what fits (skipping what cannot
run now), so a policy only *orders*, it never decides residency or memory.
While the scheduler walks a ``candidates`` generator it does not push or
remove (admitted requests are removed after the generator is closed), and the
generator skips requests that stopped waiting (admitted earlier in the walk).

Registry by name (``SchedulerConfig.policy``):

============  ===============================================================
``fcfs``      first come, first served within a priority level (lower first)
``affinity``  requests whose adapter is already in the batch first (no new
              adapter slot, no load), then the rest FCFS, each admitted
              one's adapter's other requests right after it; a request
              waiting longer than ``affinity_max_wait_s`` goes before them,
              in FCFS order
``vtc``       Virtual Token Counter fairness ("Fairness in Serving Large
              Language Models", OSDI'24): the client (adapter or tenant) with
              the smallest counter goes next; admitting charges
              ``vtc_input_weight`` per prompt token computed, each generated
              token ``vtc_output_weight``; a client that becomes backlogged is
              lifted to the smallest backlogged counter
``slo``       FCFS, and waiting requests predicted to miss ``slo_ttft_s`` are
              dropped with a reason instead of served late
============  ===============================================================

Preemption victim (all but ``vtc``): the running request with the largest
``(priority, arrival_time, seq)`` — the least important, latest arrival.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

from unipage.registry import Registry
from unipage.scheduler.config import SchedulerConfig
from unipage.scheduler.request import Request, RequestStatus

_RUNNING = RequestStatus.RUNNING


@dataclass(slots=True)
class StepContext:
    """What a policy may look at while the scheduler builds a step."""

    now: float  # the scheduler's clock
    batch_adapters: Mapping[str, int]  # adapters of running requests -> how many use each (live)
    num_running: int  # running requests before admission
    token_budget: int  # max_num_batched_tokens


class SortedQueue:
    """Requests ordered by ``queue_key`` (fixed while queued): O(log n) search, memmove insert/remove."""

    __slots__ = ("keys", "items")

    def __init__(self) -> None:
        self.keys: list[tuple] = []
        self.items: list[Request] = []

    def push(self, req: Request) -> None:
        key = req.queue_key
        if not self.keys or key > self.keys[-1]:  # arrivals come in order: append
            self.keys.append(key)
            self.items.append(req)
            return
        i = bisect_left(self.keys, key)
        self.keys.insert(i, key)
        self.items.insert(i, req)

    def remove(self, req: Request) -> None:
        i = bisect_left(self.keys, req.queue_key)
        if i == len(self.items) or self.items[i] is not req:
            raise KeyError(f"request {req.request_id!r} is not queued")
        del self.keys[i], self.items[i]

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.items)


def _victim_key(req: Request) -> tuple:
    return req.queue_key


class SchedulingPolicy:
    """Base class: FCFS queue, victim by ``(priority, arrival_time, seq)``, no early aborts, no accounting."""

    name = "base"

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._queue = SortedQueue()

    # -- the waiting queue -------------------------------------------------
    def push(self, req: Request) -> None:
        self._queue.push(req)

    def remove(self, req: Request) -> None:
        self._queue.remove(req)

    def __len__(self) -> int:
        return len(self._queue)

    def waiting(self) -> Iterator[Request]:
        """Every queued request, in no promised order."""
        return iter(self._queue)

    def candidates(self, ctx: StepContext) -> Iterator[Request]:
        """Queued requests in admission order, lazily (the scheduler stops early)."""
        return iter(self._queue)

    # -- decisions ---------------------------------------------------------
    def victim(self, running: Sequence[Request]) -> Request:
        """The request to preempt among ``running`` (non-empty)."""
        return max(running, key=_victim_key)

    def early_aborts(self, ctx: StepContext) -> list[tuple[Request, str]]:
        """Waiting requests to drop before admission, each with the reason told to its caller."""
        return []

    # -- accounting --------------------------------------------------------
    def on_admit(self, req: Request) -> None:
        """``req`` was admitted; its prefix-cache hit is in ``num_cached_tokens``."""

    def on_step(self, reqs: Sequence[Request], sampled: Sequence[list[int]]) -> None:
        """A step ran: ``sampled[i]`` are the tokens ``reqs[i]`` generated."""

    def on_decode_step(self, reqs: Sequence[Request], sampled: Sequence[list[int]]) -> None:
        """`on_step` for a step in which every request generated exactly one token (the common step).
        A policy whose parent overrides this must override it too when it overrides `on_step`."""
        self.on_step(reqs, sampled)


class FCFS(SchedulingPolicy):
    name = "fcfs"


class AdapterAffinity(SchedulingPolicy):
    name = "affinity"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._by_adapter: dict[str, SortedQueue] = {}

    def push(self, req: Request) -> None:
        super().push(req)
        if req.adapter is not None:
            self._by_adapter.setdefault(req.adapter, SortedQueue()).push(req)

    def remove(self, req: Request) -> None:
        super().remove(req)
        if req.adapter is not None:
            queue = self._by_adapter[req.adapter]
            queue.remove(req)
            if not queue:
                del self._by_adapter[req.adapter]

    def candidates(self, ctx: StepContext) -> Iterator[Request]:
        """Aged requests (FCFS), then those of adapters in the batch (FCFS per adapter), then the rest in FCFS
        order, except that once one of them is admitted in this walk its adapter's other requests come next:
        the walk does not start a new adapter for every slot that opens (the batch's adapters are read once,
        when the walk reaches them)."""
        seen: set[int] = set()
        aged = ctx.now - self.config.affinity_max_wait_s
        for req in self._queue:
            if req.arrival_time > aged:
                break
            seen.add(req.seq)
            yield req
        for adapter in list(ctx.batch_adapters):
            yield from self._of_adapter(adapter, seen)
        for req in self._queue:
            if req.seq in seen or not req.status.is_waiting:
                continue
            seen.add(req.seq)
            yield req
            if req.adapter is not None and not req.status.is_waiting:  # admitted: its adapter joined the batch
                yield from self._of_adapter(req.adapter, seen)

    def _of_adapter(self, adapter: str, seen: set[int]) -> Iterator[Request]:
        """``adapter``'s waiting requests not yet offered, FCFS."""
        for req in self._by_adapter.get(adapter, ()):
            if req.seq not in seen and req.status.is_waiting:
                seen.add(req.seq)
                yield req


class _Client:
    """A VTC client (an adapter or a tenant): its counter and its queued requests."""

    __slots__ = ("key", "counter", "queue", "in_heap", "since")

    def __init__(self, key: str) -> None:
        self.key = key
        self.counter = 0.0
        self.queue = SortedQueue()
        self.in_heap = False
        self.since = 0  # seq of the request that made it backlogged: the tie-break among equal counters


class VTC(SchedulingPolicy):
    """Virtual Token Counter fairness.

    The heap holds at most one entry per backlogged client, keyed by
    ``(counter, since)`` where the counter may be stale: counters only grow,
    so an entry below its client's counter is re-keyed when it reaches the
    top (a lazy increase-key), and one whose client has no queued request is
    dropped.  Ties go to the client backlogged first, so the order is stable
    from step to step (a rotating order would make waiting requests evict
    each other's freshly loaded adapters).
    """

    name = "vtc"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._clients: dict[str, _Client] = {}
        self._heap: list[tuple[float, int, _Client]] = []  # (counter, since, client)
        self._floor = 0.0  # counter of the last client to leave the queue: the lift when none is backlogged
        self._by_tenant = config.vtc_client == "tenant"
        self._w_in, self._w_out = config.vtc_input_weight, config.vtc_output_weight
        self._waiting = 0

    def client_key(self, req: Request) -> str:
        return req.tenant if self._by_tenant else (req.adapter or "")

    def counters(self) -> dict[str, float]:
        """Every client's virtual token counter."""
        return {key: c.counter for key, c in self._clients.items()}

    def push(self, req: Request) -> None:
        key = self.client_key(req)
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = _Client(key)
        if not client.queue:  # becomes backlogged: lifted to the least-served backlogged client
            top = self._top()
            client.counter = max(client.counter, top.counter if top is not None else self._floor)
            client.since = req.seq
            self._enter_heap(client)
        client.queue.push(req)
        req.policy_data = client
        self._waiting += 1

    def remove(self, req: Request) -> None:
        client = req.policy_data
        client.queue.remove(req)
        self._waiting -= 1
        if not client.queue:
            self._floor = client.counter

    def __len__(self) -> int:
        return self._waiting

    def waiting(self) -> Iterator[Request]:
        for client in self._clients.values():
            yield from client.queue

    def candidates(self, ctx: StepContext) -> Iterator[Request]:
        """The least-served client's earliest request; after an admission the least-served is chosen anew."""
        held: list[_Client] = []  # taken off the heap during the walk; put back at the end
        pos: dict[str, int] = {}
        try:
            while (client := self._top()) is not None:
                heapq.heappop(self._heap)
                held.append(client)
                items, i, admitted = client.queue.items, pos.get(client.key, 0), False
                while i < len(items):
                    req, i = items[i], i + 1
                    if not req.status.is_waiting:
                        continue
                    yield req
                    admitted = req.status is _RUNNING
                    if admitted or not self._by_tenant:  # an adapter's other requests would be skipped too
                        break
                pos[client.key] = i
                if admitted and i < len(items):  # back in the race with its new counter
                    held.pop()
                    heapq.heappush(self._heap, self._entry(client))
        finally:
            for client in held:
                heapq.heappush(self._heap, self._entry(client))

    def victim(self, running: Sequence[Request]) -> Request:
        """The request of the most-served client (latest arrival among its requests)."""
        return max(running, key=lambda r: (self._served(r), r.queue_key))

    def on_admit(self, req: Request) -> None:
        req.policy_data.counter += self._w_in * (req.num_tokens - req.num_cached_tokens)

    def on_step(self, reqs: Sequence[Request], sampled: Sequence[list[int]]) -> None:
        w = self._w_out
        for req, tokens in zip(reqs, sampled):
            if tokens:
                req.policy_data.counter += w * len(tokens)

    def on_decode_step(self, reqs: Sequence[Request], sampled: Sequence[list[int]]) -> None:
        w = self._w_out  # (w * 1 is w: the same sums as on_step's, a third of its time)
        for req in reqs:
            req.policy_data.counter += w

    # -- internals ---------------------------------------------------------
    def _served(self, req: Request) -> float:
        client = self._clients.get(self.client_key(req))
        return client.counter if client is not None else 0.0

    @staticmethod
    def _entry(client: _Client) -> tuple[float, int, _Client]:
        return (client.counter, client.since, client)

    def _enter_heap(self, client: _Client) -> None:
        if not client.in_heap:
            client.in_heap = True
            heapq.heappush(self._heap, self._entry(client))

    def _top(self) -> _Client | None:
        """The backlogged client with the smallest counter (left on the heap), or None."""
        heap = self._heap
        while heap:
            counter, since, client = heap[0]
            if not client.queue.items:  # (the list: a SortedQueue's own len() is a Python call)
                heapq.heappop(heap)
                client.in_heap = False
            elif counter < client.counter or since != client.since:
                heapq.heapreplace(heap, self._entry(client))
            else:
                return client
        return None


class SLOEarlyAbort(FCFS):
    """FCFS that drops waiting requests predicted to miss the time-to-first-token objective.

    Model: a step lasts ``step_time_s`` and leaves ``max(token_budget - running, 1)``
    tokens for prefill; a waiting request's first token comes after the prompt
    tokens queued ahead of it and its own are computed::

        predicted_ttft = (now - arrival) + (ahead + own) / per_step * step_time_s

    ``ahead`` counts the requests kept, in queue order, so once the queue
    ahead exceeds the objective everything behind it is dropped: the queue
    this walks stays as short as what can still be served in time.  The walk
    is skipped when even the oldest request behind all queued tokens would
    make it (O(1) a step).  Requests that already produced a token (resumed
    after preemption) are kept.
    """

    name = "slo"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._tokens = 0  # tokens of every queued request
        self._arrivals: list[tuple[float, int]] = []  # (arrival, seq) heap, lazy: queued ones are in _queued
        self._queued: set[int] = set()

    def push(self, req: Request) -> None:
        super().push(req)
        self._tokens += len(req.all_token_ids)
        self._queued.add(req.seq)
        heapq.heappush(self._arrivals, (req.arrival_time, req.seq))

    def remove(self, req: Request) -> None:
        super().remove(req)
        self._tokens -= len(req.all_token_ids)
        self._queued.discard(req.seq)

    def _oldest_arrival(self) -> float:
        while self._arrivals[0][1] not in self._queued:
            heapq.heappop(self._arrivals)
        return self._arrivals[0][0]

    def early_aborts(self, ctx: StepContext) -> list[tuple[Request, str]]:
        if not self._queue:
            return []
        slo = self.config.slo_ttft_s
        scale = self.config.step_time_s / max(ctx.token_budget - ctx.num_running, 1)  # seconds per token
        if ctx.now - self._oldest_arrival() + self._tokens * scale <= slo:
            return []  # no request can be late: O(1) while the queue is within its objective
        bound = slo - ctx.now  # predicted > slo  <=>  (ahead + own) * scale - arrival > bound
        ahead, drop = 0, []
        for req in self._queue:  # O(waiting) a step, kept short by the drops themselves
            own = len(req.all_token_ids)
            if own == req.num_prompt_tokens and (ahead + own) * scale - req.arrival_time > bound:
                predicted = ctx.now - req.arrival_time + (ahead + own) * scale
                drop.append((req, f"predicted time to first token {predicted:.3f} s exceeds slo_ttft_s={slo} s"))
                continue
            ahead += own
        return drop


POLICIES = Registry("scheduling policy", (FCFS, AdapterAffinity, VTC, SLOEarlyAbort))


def make_policy(name: str, config: SchedulerConfig) -> SchedulingPolicy:
    return POLICIES.make(name, config)


def register_policy(cls: type[SchedulingPolicy]) -> type[SchedulingPolicy]:
    """Add a policy class to the registry (usable as a decorator)."""
    return POLICIES.register(cls)
