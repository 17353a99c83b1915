"""`PoolStorage`: the pool tensor and the host tier's buffers; performs the
adapter manager's effects.

Shape legend: L = pool rows (`ModelConfig.pool_rows`), N = pages, P = page_elems,
n = one adapter's pages.

``pool [L, N, P]`` lives on the device (CPU in tests, CUDA when serving).  A
host copy of an adapter is its packed page buffer ``[L, n, P]`` (pinned when
CUDA exists), so bringing it onto the GPU is one page-wise ``index_copy_``
into the pages of its page table.  On CUDA the copy runs on a side stream and
records an event: ``poll()`` reports loads whose event has completed, and the
engine makes its compute stream wait on ``load_event(name)`` before a batch
that uses the adapter.  A load without a host copy first reads and packs the
adapter's files: on CUDA in a background thread (`READ_THREADS`), so a step
never waits on a disk read — ``poll()`` starts the page copy once the packed
buffer is ready, and reports a read that failed.  On CPU a load completes
inside ``apply``.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from unipage.adapter_pack import LoraWeights, gather_adapter, pack_adapter
from unipage.adapters import AdapterRecord, DropHostCopy, EvictAdapter, LoadAdapter
from unipage.config import UnipageConfig
from unipage.errors import AdapterError

log = logging.getLogger(__name__)
READ_THREADS = 2  # background readers of adapter files (CUDA)


@dataclass
class ApplyResult:
    done: list[str] = field(default_factory=list)  # loads complete: call load_done
    failed: list[tuple[str, str]] = field(default_factory=list)  # (name, reason): call load_failed


class PoolStorage:
    def __init__(self, config: UnipageConfig, device: str | torch.device = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = getattr(torch, config.model.dtype)
        shape = (config.model.pool_rows, config.num_pages, config.page_elems)
        self.pool = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._host: dict[str, torch.Tensor] = {}  # name -> [L, n, P] on the CPU
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._events: dict[str, torch.cuda.Event] = {}  # page copies in flight (CUDA)
        self._reads: dict[str, tuple[Future, LoadAdapter]] = {}  # file reads in flight (CUDA)
        self._reader = ThreadPoolExecutor(READ_THREADS, "unipage-adapter-read") if self._cuda else None

    def apply(self, effects) -> ApplyResult:
        """Perform the effects in order; report which loads completed or failed."""
        result = ApplyResult()
        for effect in effects:
            if isinstance(effect, LoadAdapter):
                self._load(effect, result)
            elif isinstance(effect, EvictAdapter):
                self._events.pop(effect.name, None)
                self._reads.pop(effect.name, None)  # a read still running is dropped when it ends
            elif isinstance(effect, DropHostCopy):
                self._host.pop(effect.name, None)
            else:
                raise TypeError(f"unknown effect {effect!r}")
        return result

    def poll(self) -> ApplyResult:
        """CUDA: start the page copies of reads that finished; report the loads whose copies
        have completed since the last poll, and the reads that failed."""
        result = ApplyResult()
        for name in [n for n, (future, _) in self._reads.items() if future.done()]:
            future, effect = self._reads.pop(name)
            try:
                buf = future.result()
            except (AdapterError, OSError) as err:
                log.warning("loading adapter %r failed: %s", name, err)
                result.failed.append((name, str(err)))
                continue
            self._finish_read(effect, buf)
        result.done = [name for name, event in self._events.items() if event.query()]
        for name in result.done:
            del self._events[name]
        return result

    def close(self) -> None:
        """Stop the background readers (reads in flight are abandoned)."""
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)

    def load_event(self, name: str):
        """The CUDA event of a load still in flight, or None."""
        return self._events.get(name)

    def has_host_copy(self, name: str) -> bool:
        return name in self._host

    def _load(self, effect: LoadAdapter, result: ApplyResult) -> None:
        buf = self._host.get(effect.name) if effect.from_host else None
        if buf is None and self._reader is not None:
            # The thread makes no CUDA call (no pinning there): a graph capture on the main thread
            # would fail on another thread's cudaHostAlloc.
            self._reads[effect.name] = (self._reader.submit(self.read_packed, effect, pin=False), effect)
            return
        try:
            buf = buf if buf is not None else self.read_packed(effect)
        except (AdapterError, OSError) as err:
            log.warning("loading adapter %r failed: %s", effect.name, err)
            result.failed.append((effect.name, str(err)))
            return
        self._finish_read(effect, buf)
        if not self._cuda:
            result.done.append(effect.name)

    def _finish_read(self, effect: LoadAdapter, buf: torch.Tensor) -> None:
        """Keep the host copy if asked, and copy the pages into the pool (on CUDA: on the side stream)."""
        if self._cuda and not buf.is_pinned():
            buf = buf.pin_memory()
        if effect.cache_on_host:
            self._host[effect.name] = buf
        if not self._cuda:
            self.pool.index_copy_(1, torch.tensor(effect.pages, dtype=torch.long), buf)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            # Allocated on the side stream, so their memory is not reused by the compute
            # stream before the copy has run.
            index = torch.tensor(effect.pages, dtype=torch.long).to(self.device, non_blocking=True)
            self.pool.index_copy_(1, index, buf.to(self.device, non_blocking=True))
            event = torch.cuda.Event()
            event.record(self._stream)
        self._events[effect.name] = event

    def read_packed(self, effect: LoadAdapter, pin: bool = True) -> torch.Tensor:
        """Read the adapter's files and pack them into a host page buffer ``[L, n, P]`` (pinned on CUDA
        if ``pin``)."""
        from unipage.peft_io import load_adapter_weights

        weights = load_adapter_weights(effect.info, self.config.model)
        buf = pack_adapter(effect.layout, weights, self.config.page_elems, self.dtype)
        if len(effect.pages) != buf.shape[1]:
            raise AdapterError(f"adapter {effect.name!r}: packed {buf.shape[1]} pages, "
                               f"{len(effect.pages)} assigned")
        return buf.pin_memory() if self._cuda and pin else buf

    def gather(self, record: AdapterRecord) -> LoraWeights:
        """Read a resident adapter's matrices back out of the pool through its page table."""
        if record.pages is None:
            raise AdapterError(f"adapter {record.name!r} is not resident")
        return gather_adapter(self.pool, record.pages, record.layout)
