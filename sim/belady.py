"""Belady's optimum as an eviction policy of the real pool: evict the adapter needed farthest in the future.

An offline bound, only meaningful in the simulator: it reads the future from
the trace.  Registered in the pool's eviction registry as ``belady``
(`unipage.eviction.register_policy`) when `unipage.sim` is imported, and
given its future by the simulator (`Belady.attach`); a real engine that picks
it gets an error at the first eviction decision.

The next use of an adapter at time ``now`` is ``now`` itself (highest keep
priority) while a request for it waits in the scheduler's queue, else the
arrival time of its next request after ``now`` (infinity if none).  That value
stays fixed while the adapter is idle — the contract of
`unipage.eviction.EvictionPolicy` — except when the scheduler changes the
queue under it: a preempted request re-queued, a waiting request dropped.
The simulator reports those (`BeladyOracle.requeued` / `dropped`) and the
adapter's candidate is re-keyed through the reclaimer's public ``remove`` /
``add``.

Cached KV blocks: their future reuse is not in the trace, so Belady evicts
them before any adapter, least recently used first (with unique prompts they
are never reused, which makes this the optimum too).  Adapters differ in size
(ranks); with mixed sizes farthest-next-use is the classic heuristic bound,
exact only for equal sizes.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable

from unipage.eviction import ADAPTER, Candidate, EvictionPolicy, register_policy
from unipage.reclaim import Reclaimer

_NEEDED_NOW = -1.0  # next use of an adapter whose requests are queued: before any arrival time
_INF = float("inf")


class BeladyOracle:
    """The future of a trace: when each adapter is next needed."""

    def __init__(self, arrivals: dict[str, list[float]], clock: Callable[[], float]) -> None:
        self.arrivals = arrivals  # adapter -> arrival times of its requests, sorted
        self.clock = clock
        self.queued: dict[str, int] = {}  # adapter -> its requests waiting in the scheduler's queue
        self.reclaimer: Reclaimer | None = None

    def next_use(self, name: str) -> float:
        if self.queued.get(name):
            return _NEEDED_NOW
        times = self.arrivals.get(name, ())
        i = bisect_right(times, self.clock())  # arrivals up to now were added: queued or running
        return times[i] if i < len(times) else float("inf")

    # -- the queue, as the simulator sees it ---------------------------------
    def arrived(self, name: str) -> None:
        self.queued[name] = self.queued.get(name, 0) + 1

    def admitted(self, name: str) -> None:
        self.queued[name] -= 1

    def requeued(self, name: str) -> None:
        """A request of ``name`` was preempted: it waits again."""
        self.arrived(name)
        self._rekey(name)

    def dropped(self, name: str) -> None:
        """A waiting request of ``name`` was dropped (SLO, failed load)."""
        self.admitted(name)
        self._rekey(name)

    def _rekey(self, name: str) -> None:
        reclaimer = self.reclaimer
        if reclaimer is not None and (ADAPTER, name) in reclaimer:
            reclaimer.add(reclaimer.remove(ADAPTER, name))


@register_policy
class Belady(EvictionPolicy):
    name = "belady"

    def __init__(self) -> None:
        self.oracle: BeladyOracle | None = None

    def attach(self, oracle: BeladyOracle, reclaimer: Reclaimer) -> None:
        self.oracle = oracle
        oracle.reclaimer = reclaimer

    def priority(self, c: Candidate) -> tuple:
        if self.oracle is None:
            raise RuntimeError("the belady eviction policy needs the future: only unipage-sim can use it")
        if c.kind != ADAPTER:
            return (-_INF, 0, c.last_used)  # cached KV first, LRU among them
        return (-self.oracle.next_use(c.key), 1, c.last_used)  # farthest next use first
