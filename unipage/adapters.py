"""`AdapterManager`: the adapter registry and GPU residency.  Pure Python.

Tiers: disk (a PEFT directory) -> host cache (CPU memory, same page
layout) -> GPU pages taken from the unified `PagePool`.  This class only
decides; data movement is described as *effects* (`LoadAdapter`,
`EvictAdapter`, `DropHostCopy`) that an executor performs — `PoolStorage` on
a device, the simulator on a simulated clock — and reports back with
``load_done`` / ``load_failed``.

Life of a resident adapter::

    request() --pages+slot, LoadAdapter--> loading --load_done()--> loaded
    pins >= 1 only once loaded (a request runs only on a loaded adapter)
    loaded, pins == 0  : idle — a reclaim candidate (or evicted at once
                         under an evict-on-idle policy when the last pin goes)
    loaded, pins >= 1  : in use by running requests — never evicted
    evicted            : pages and slot returned, EvictAdapter emitted, the
                         cached KV computed with its weights invalidated

A *slot* is the small integer kernels use to index an adapter's page table;
freed slots are reused lowest first so the kernels' tables stay compact.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Callable

from unipage.config import UnipageConfig
from unipage.errors import (AdapterBusyError, AdapterError, AdapterExistsError, AdapterRankError,
                            AdapterShapeError, UnknownAdapterError)
from unipage.eviction import ADAPTER, Candidate
from unipage.host_cache import HostCacheIndex
from unipage.lora_layout import AdapterLayout, cached_layout
from unipage.pool import PageKind
from unipage.reclaim import Reclaimer

if TYPE_CHECKING:
    from unipage.adapter_info import AdapterInfo


class Residency(Enum):
    READY = "ready"  # loaded: requests may run
    LOADING = "loading"  # pages assigned, copy in flight
    NO_SPACE = "no_space"  # could not get pages now


_ADAPTER_PAGES = PageKind.ADAPTER
_READY, _LOADING, _NO_SPACE = Residency.READY, Residency.LOADING, Residency.NO_SPACE  # (a member read from
#   its class is slow in Python 3.11)


@dataclass(frozen=True, slots=True)
class LoadAdapter:
    """Copy an adapter into its pages (reading it from disk first unless ``from_host``)."""

    name: str
    slot: int
    pages: tuple[int, ...]
    from_host: bool
    cache_on_host: bool  # keep the packed host copy afterwards
    info: "AdapterInfo"
    layout: AdapterLayout


@dataclass(frozen=True, slots=True)
class EvictAdapter:
    name: str
    slot: int
    pages: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DropHostCopy:
    name: str


@dataclass(slots=True)
class AdapterRecord:
    name: str
    info: "AdapterInfo"
    layout: AdapterLayout
    num_pages: int  # GPU pages when resident
    nbytes: int  # packed bytes over all layers (= host copy size)
    pages: list[int] | None = None
    slot: int | None = None
    loaded: bool = False
    pins: int = 0
    uses: int = 0
    last_used: int = 0
    resident_since: int = 0

    @property
    def resident(self) -> bool:
        return self.pages is not None


@dataclass(slots=True)
class AdapterStats:
    loads: int = 0
    loads_from_host: int = 0
    bytes_loaded: int = 0
    evictions: int = 0
    load_failures: int = 0


class AdapterManager:
    def __init__(self, config: UnipageConfig, reclaimer: Reclaimer,
                 invalidate_kv: Callable[[str], object] | None = None) -> None:
        self.config = config
        self.reclaimer = reclaimer
        self.pool = reclaimer.pool
        self.host = HostCacheIndex(config.lora.host_cache_bytes)
        self.invalidate_kv = invalidate_kv or (lambda digest: None)
        self._adapters: dict[str, AdapterRecord] = {}
        self._resident_digests: dict[str, int] = {}  # content digest -> resident adapters with it
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._effects: list = []
        self.stats = AdapterStats()
        reclaimer.register_owner(ADAPTER, self._evict_idle)

    # -- registry --------------------------------------------------------
    def register(self, name: str, info: "AdapterInfo") -> AdapterRecord:
        if not isinstance(name, str) or not name or "/" in name:
            raise AdapterError(f"adapter name must be a non-empty string without '/', got {name!r}")
        if name in self._adapters:
            raise AdapterExistsError(f"adapter {name!r} is already registered")
        if info.max_rank > self.config.lora.max_rank:
            raise AdapterRankError(f"adapter {name!r} has rank {info.max_rank}, above the configured "
                                   f"maximum max_rank={self.config.lora.max_rank}")
        try:
            layout = cached_layout(self.config.model, tuple(info.layers))
        except ValueError as err:
            raise AdapterShapeError(f"adapter {name!r} does not fit the base model: {err}") from None
        num_pages = layout.num_pages(self.config.page_elems)
        if num_pages > self.pool.num_pages:
            raise AdapterShapeError(f"adapter {name!r} needs {num_pages} pages; the pool has "
                                    f"{self.pool.num_pages}")
        nbytes = num_pages * self.config.page_bytes
        record = AdapterRecord(name, info, layout, num_pages, nbytes)
        self._adapters[name] = record
        return record

    def unregister(self, name: str) -> None:
        record = self.get(name)
        if record.pins or (record.resident and not record.loaded):
            raise AdapterBusyError(f"adapter {name!r} is in use ({record.pins} pins) or loading")
        if record.resident:
            self.evict(name)
        if self.host.remove(name):
            self._effects.append(DropHostCopy(name))
        del self._adapters[name]

    def get(self, name: str) -> AdapterRecord:
        try:
            return self._adapters[name]
        except KeyError:
            raise UnknownAdapterError(f"unknown adapter {name!r}; registered: "
                                      f"{sorted(self._adapters)[:20]}") from None

    def find(self, name: str) -> AdapterRecord | None:
        """The adapter's record, or None if ``name`` is not registered."""
        return self._adapters.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    def names(self) -> list[str]:
        return list(self._adapters)

    def resident(self) -> list[str]:
        return [r.name for r in self._adapters.values() if r.resident]

    # -- residency -------------------------------------------------------
    def request(self, name: str, protect: frozenset = frozenset()) -> Residency:
        """Make ``name`` resident: READY if loaded, else start a load (LOADING) if pages can be had.

        ``protect``: reclaim candidates ``(kind, key)`` that must not be evicted for it.
        """
        record = self.get(name)
        if record.resident:
            return _READY if record.loaded else _LOADING
        pages = self.reclaimer.alloc(record.num_pages, _ADAPTER_PAGES, protect)
        if pages is None:
            return _NO_SPACE
        self._start_load(record, pages)
        return _LOADING

    def _start_load(self, record: AdapterRecord, pages: list[int]) -> None:
        record.pages, record.slot = pages, self._take_slot()
        digest = record.info.digest
        self._resident_digests[digest] = self._resident_digests.get(digest, 0) + 1
        record.loaded = False
        record.resident_since = record.last_used = self.reclaimer.tick()
        from_host = self.host.lookup(record.name)
        cache = from_host
        if not from_host:
            evicted = self.host.admit(record.name, record.nbytes)
            cache = evicted is not None
            self._effects.extend(DropHostCopy(old) for old in evicted or ())
        self.stats.loads += 1
        self.stats.loads_from_host += from_host
        self.stats.bytes_loaded += record.nbytes
        self._effects.append(LoadAdapter(record.name, record.slot, tuple(pages), from_host, cache,
                                         record.info, record.layout))

    def load_done(self, name: str) -> None:
        record = self._loading(name)
        record.loaded = True
        if record.pins == 0:
            self._offer(record)

    def load_failed(self, name: str) -> None:
        """The executor could not load it: return its pages; it stays registered, on disk only."""
        record = self._loading(name)
        self.stats.load_failures += 1
        if self.host.remove(name):
            self._effects.append(DropHostCopy(name))
        self._release(record)

    def pin(self, name: str) -> None:
        """A running request uses ``name``: it cannot be evicted until unpinned."""
        record = self.get(name)
        if not record.loaded:
            raise AdapterError(f"adapter {name!r} is not loaded; request() it and wait for load_done")
        if record.pins == 0:
            self.reclaimer.remove(ADAPTER, name)
        record.pins += 1
        record.uses += 1
        record.last_used = self.reclaimer.tick()

    def unpin(self, name: str) -> None:
        record = self.get(name)
        if record.pins == 0:
            raise AdapterError(f"adapter {name!r} is not pinned")
        record.pins -= 1
        record.last_used = self.reclaimer.tick()
        if record.pins:
            return
        if self.reclaimer.policy.evict_on_idle:
            self._evict_idle(name)
        else:
            self._offer(record)

    def evict(self, name: str) -> None:
        """Evict an idle resident adapter now."""
        record = self.get(name)
        if not record.resident:
            raise AdapterError(f"adapter {name!r} is not resident")
        if record.pins or not record.loaded:
            raise AdapterBusyError(f"adapter {name!r} is pinned by {record.pins} request(s) or loading")
        self.reclaimer.remove(ADAPTER, name)
        self._evict_idle(name)

    def take_effects(self) -> list:
        """The data movements decided since the last call, in order.

        One consumer only (the scheduler, when one drives this manager): effects taken are gone.
        """
        effects, self._effects = self._effects, []
        return effects

    def page_table(self, name: str) -> list[int]:
        record = self.get(name)
        if not record.resident:
            raise AdapterError(f"adapter {name!r} is not resident")
        return record.pages

    # -- internals -------------------------------------------------------
    def _loading(self, name: str) -> AdapterRecord:
        record = self.get(name)
        if not record.resident or record.loaded:
            raise AdapterError(f"adapter {name!r} has no load in flight")
        return record

    def _offer(self, record: AdapterRecord) -> None:
        self.reclaimer.add(Candidate(ADAPTER, record.name, record.num_pages, record.resident_since,
                                     record.last_used, record.uses, self._reload_cost(record)))

    def _reload_cost(self, record: AdapterRecord) -> float:
        lora = self.config.lora
        cost = record.nbytes / lora.h2d_bytes_per_s
        if record.name not in self.host:
            cost += record.info.file_bytes / lora.disk_bytes_per_s
        return cost

    def _evict_idle(self, name: str) -> None:
        """Reclaimer callback (and explicit eviction): give the pages back."""
        record = self._adapters[name]
        self._effects.append(EvictAdapter(name, record.slot, tuple(record.pages)))
        self.stats.evictions += 1
        self._release(record)
        if record.info.digest not in self._resident_digests:
            self.invalidate_kv(record.info.digest)

    def _release(self, record: AdapterRecord) -> None:
        digest = record.info.digest
        self._resident_digests[digest] -= 1
        if not self._resident_digests[digest]:
            del self._resident_digests[digest]
        self.pool.free(record.pages)
        heapq.heappush(self._free_slots, record.slot)
        record.pages = record.slot = None
        record.loaded = False

    def _take_slot(self) -> int:
        if self._free_slots:
            return heapq.heappop(self._free_slots)
        self._next_slot += 1
        return self._next_slot - 1

    def check(self) -> None:
        seen: set[int] = set()
        slots: set[int] = set()
        for r in self._adapters.values():
            idle = r.resident and r.loaded and r.pins == 0
            assert ((ADAPTER, r.name) in self.reclaimer) == idle, f"{r.name}: candidate != idle"
            if not r.resident:
                assert r.slot is None and not r.loaded and r.pins == 0, f"{r.name}: not resident but busy"
                continue
            assert len(r.pages) == r.num_pages and seen.isdisjoint(r.pages), f"{r.name}: pages shared"
            assert all(self.pool.kind(p) == PageKind.ADAPTER for p in r.pages)
            assert r.slot not in slots, f"slot {r.slot} held twice"
            seen.update(r.pages)
            slots.add(r.slot)
        assert len(seen) == self.pool.count(PageKind.ADAPTER), "an adapter page has no adapter"
        digests: dict[str, int] = {}
        for r in self._adapters.values():
            if r.resident:
                digests[r.info.digest] = digests.get(r.info.digest, 0) + 1
        assert digests == self._resident_digests, "resident digest counts out of step"
        self.host.check()
