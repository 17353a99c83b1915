"""`UnifiedMemory`: the page pool with its two tenants, wired from one config.

    PagePool  <--  Reclaimer (one eviction policy)  <--  KVManager or GroupedKV (cached blocks)
                                                    <--  AdapterManager (idle adapters)

Pure Python bookkeeping; `unipage.storage.PoolStorage` holds the tensors.
"""

from __future__ import annotations

from unipage.adapters import AdapterManager, AdapterRecord
from unipage.config import UnipageConfig
from unipage.eviction import make_policy
from unipage.kv_groups import make_kv
from unipage.pool import PagePool
from unipage.reclaim import Reclaimer


class UnifiedMemory:
    def __init__(self, config: UnipageConfig) -> None:
        self.config = config
        self.pool = PagePool(config.num_pages)
        self.reclaimer = Reclaimer(self.pool, make_policy(config.lora.eviction_policy))
        self.kv = make_kv(self.pool, self.reclaimer, config)
        self.adapters = AdapterManager(config, self.reclaimer, self.kv.invalidate)

    def register_adapter(self, name: str, path) -> AdapterRecord:
        """Inspect the PEFT directory ``path`` (checked against the allowed roots) and register it."""
        from unipage.peft_io import inspect_adapter  # reads files: keeps this module torch-free

        return self.adapters.register(name, inspect_adapter(path, self.config.model, self.config.lora))

    def occupancy(self) -> dict[str, int]:
        """Pages by owner kind: free, kv, cached_kv, adapter."""
        return self.pool.occupancy()

    def check(self) -> None:
        """Assert every invariant of the pool and of both tenants."""
        self.pool.check()
        self.reclaimer.check()
        self.kv.check()
        self.adapters.check()
