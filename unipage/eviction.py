"""Eviction policies: one ordering over cached KV blocks *and* idle adapters.

A policy turns a `Candidate` (something evictable, of either kind) into a
priority; the `Reclaimer` evicts the lowest priority first.  Because both
kinds go through the same ordering, memory pressure is one decision, not two
separate pools.  Priorities may only depend on fields that stay fixed while a
candidate is idle (it leaves the candidate set when it is used again), which
is what lets the reclaimer keep them in a heap.

Registry by name (``LoRAConfig.eviction_policy``):

============  ===========================================================
``lru``       least recently used first
``lfu``       fewest uses first, then least recently used
``fifo``      earliest to become resident (or cached) first
``size``      largest first (fewest evictions to free a request's pages)
``cost``      lowest expected reload cost per page freed first:
              ``cost_s * (1 + uses) / pages`` (reload cost over benefit)
``idle``      S-LoRA's evict-when-idle: an adapter leaves the GPU as soon as
              no running request uses it; cached KV in LRU order
============  ===========================================================
"""

from __future__ import annotations

from dataclasses import dataclass

from unipage.registry import Registry

KV_BLOCK = "kv"
ADAPTER = "adapter"


@dataclass(slots=True)
class Candidate:
    """An evictable unit: one cached KV block or one idle resident adapter."""

    kind: str  # KV_BLOCK or ADAPTER
    key: object  # page id for a KV block, adapter name for an adapter
    pages: int  # pages freed by evicting it
    inserted: int  # clock tick when it became resident / cached
    last_used: int  # clock tick of its last use
    uses: int  # times it was used (prefix hits, requests served)
    cost_s: float  # estimated seconds to bring it back after eviction


class EvictionPolicy:
    """Base class: ``priority`` orders candidates, lowest evicted first (a non-empty tuple)."""

    name = "base"
    evict_on_idle = False  # True: adapters are evicted the moment their last pin goes

    def priority(self, c: Candidate) -> tuple:
        raise NotImplementedError


class LRU(EvictionPolicy):
    name = "lru"

    def priority(self, c: Candidate) -> tuple:
        return (c.last_used,)


class LFU(EvictionPolicy):
    name = "lfu"

    def priority(self, c: Candidate) -> tuple:
        return (c.uses, c.last_used)


class FIFO(EvictionPolicy):
    name = "fifo"

    def priority(self, c: Candidate) -> tuple:
        return (c.inserted, c.last_used)


class SizeAware(EvictionPolicy):
    name = "size"

    def priority(self, c: Candidate) -> tuple:
        return (-c.pages, c.last_used)


class CostAware(EvictionPolicy):
    name = "cost"

    def priority(self, c: Candidate) -> tuple:
        return (c.cost_s * (1 + c.uses) / max(c.pages, 1), c.last_used)


class EvictWhenIdle(LRU):
    name = "idle"
    evict_on_idle = True


POLICIES = Registry("eviction policy", (LRU, LFU, FIFO, SizeAware, CostAware, EvictWhenIdle))


def make_policy(name: str) -> EvictionPolicy:
    return POLICIES.make(name)


def register_policy(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Add a policy class to the registry (usable as a decorator), e.g. the simulator's Belady."""
    return POLICIES.register(cls)
