"""`PoolStorage`: the pool tensor and the host tier's buffers; performs the
adapter manager's effects.

Shape legend: L = pool rows (`ModelConfig.pool_rows`), N = pages, P = page_elems,
n = one adapter's pages.

``pool [L, N, P]`` lives on the device (CPU in tests, CUDA when serving).  A
host copy of an adapter is its packed page buffer ``[L, n, P]``, so bringing it
onto the GPU is one page-wise ``index_copy_`` into the pages of its page table.
On CUDA the copy runs on a side stream from a slice of one pinned ring
(`unipage.pinned`: nothing is pinned per adapter unless the ring is too small
for it, or has been held still for `RING_WAIT_S` with no room for it, or is
not in shared memory and has no room now) and records an event: ``poll()`` reports loads whose event has
completed, and only then does the engine tell the scheduler, so no batch reads
an adapter before its pages are written.  A load without a host copy first
reads and packs the adapter's files: on CUDA in helper processes
(`READ_WORKERS`, see `unipage.adapter_reader`: work in this process would fight
the step loop for the GIL), so a step never waits on a disk read.  The ring is
shared memory that the reader processes pack straight into (a slice reserved
when the read is submitted), so the step loop copies nothing on the way in —
``poll()`` only starts the page copy once a read's reply is in, and reports a
read that failed.  The reader writes the host copy too, as a file in shared
memory (under `SHM_DIR`): a host copy is a tensor or such a file, and a load from
one reads it into the ring on a thread.  A load the ring has no room for now
waits for some, first in, first out, and a ``poll()`` starts it, so the step
loop neither reads nor stages it (unless the whole ring is too small for it, or
the ring stays held, no read in it finishing, for `RING_WAIT_S`; longer for large reads).
A ring of the default size (`LoRAConfig.staging_ring_bytes` None) is replaced, while no
read or copy holds a slice of it, by one that holds two of an adapter too large for it (`_fit_ring`).
On CPU a load completes inside ``apply``.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from unipage.adapter_pack import LoraWeights, gather_adapter
from unipage.adapter_reader import Read, ReaderPool, SharedTarget, read_and_pack
from unipage.adapters import AdapterRecord, DropHostCopy, EvictAdapter, LoadAdapter
from unipage.config import UnipageConfig
from unipage.errors import AdapterError, ClosedError
from unipage.host_copies import HostRead, read_into, same_copy, unpinned_copy
from unipage.pinned import (
    SHM_DIR,
    PinnedRing,
    RingSlice,
    hold_lock,
    remove_file,
    sweep_dead,
)

log = logging.getLogger(__name__)
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 4  # ours to use
READ_WORKERS = min(8, max(2, CPUS // 2))  # processes that read and pack adapter files (CUDA)
HOST_READ_THREADS = 2  # threads that copy host copies (files, or buffers of this process) into the ring (CUDA)
# A load that has waited this long for ring room while no read holding a slice of the ring finished (or gave
# its slice back) and no waiting load took room goes the step loop's way (staged there, or read through a
# file), so none waits without bound behind reads that hold the ring and are stuck (a hung mount: a reader's
# read fails only after `adapter_reader.READ_TIMEOUT_S`).  A load queued behind many (setup b's warm-up: 16
# adapters of 640 MiB, 4 at a time) waits as long as the ring keeps moving.  Longer than a read of a large
# adapter (640 MiB: about 7 s, eight at once, H200 host).
RING_WAIT_S = 10.0
# ... or longer while a read in flight fills a slice its bytes would take longer to fill at this rate: a read is
# not presumed stuck before that (setup b's warm-up: four 640 MiB reads at once, about 10 s each, held the ring
# still for 10.2 s and sent 6 loads the step loop's way at 8558c15; at this rate they may take 20 s).
SLOW_READ_BYTES_PER_S = 32 << 20
# The ring of `LoRAConfig.staging_ring_bytes` None: this size at first, replaced (while no read or copy holds a
# slice of it) by one that holds two of an adapter too large for it, up to RING_MAX_BYTES: a Qwen3-30B-A3B
# adapter of rank 8 on every linear layer packs to about 640 MiB, more than the first ring, and would be staged
# on the step loop's thread.
RING_START_BYTES = 256 << 20
RING_MAX_BYTES = 4 << 30
HOST_PREFIX = "unipage-host-"  # the readers' host copies: a directory HOST_PREFIX + pid + "-" + a suffix


@dataclass
class ReadStats:
    """Adapter file reads completed: how many, their file bytes, and the seconds spent reading and packing."""

    count: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, effect: LoadAdapter, seconds: float) -> None:
        self.count += 1
        self.bytes += effect.info.file_bytes
        self.seconds += seconds


@dataclass
class LoopTimes:
    """Host seconds the caller's thread (the engine's step loop) spent on loads: reading files (a host copy
    the ring is too small for, or that waited too long for room; every read without reader processes) and
    finishing reads (the page copy launched, the host copy kept)."""

    read: float = 0.0
    finish: float = 0.0


@dataclass
class Waiting:
    """A load waiting for ring room (`PoolStorage._start_waiting`)."""

    effect: LoadAdapter
    unkept: bool  # keep no host copy of what it reads (the host tier dropped its copy meanwhile)
    since: float = field(default_factory=time.monotonic)


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
        self._host: dict[str, torch.Tensor | str] = {}  # name -> [L, n, P] on the CPU, or a file of its bytes
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._events: dict[str, torch.cuda.Event] = {}  # page copies in flight (CUDA)
        self._reads: dict[str, tuple[Read, LoadAdapter, RingSlice | None]] = {}  # file reads in flight (CUDA)
        self._orphans: list[tuple[Read, RingSlice | None]] = []  # reads of evicted adapters, still in flight
        self._unkept: set[Read] = set()  # reads in flight whose host copy was dropped meanwhile: not kept
        self._waiting: dict[str, Waiting] = {}  # loads waiting for ring room, oldest first (CUDA)
        self._ring_moved = time.monotonic()  # when a read holding the ring last finished or a load took room
        self._reader = ReaderPool(READ_WORKERS) if self._cuda else None
        self._ring_auto = config.lora.staging_ring_bytes is None  # the ring grows (`_fit_ring`)
        self._ring = _pinned_ring(config.lora.staging_ring_bytes or RING_START_BYTES) if self._cuda else None
        self._host_reads: ThreadPoolExecutor | None = None  # `_start_host_read`'s threads, made on first use
        self._oversized: set[str] = set()  # adapters warned of as larger than the ring
        self._host_dir: str | None = None  # the readers' host copies (`_keep_path`)
        self._host_end: weakref.finalize | None = None  # removes that directory
        self._host_names = itertools.count()
        self._fence: torch.cuda.Event | None = None  # `mark_step`: what a page copy waits for (CUDA)
        self.reads = ReadStats()
        self.loop = LoopTimes()
        self.closed = False  # `close`: loads and reads are refused from then on

    def apply(self, effects) -> ApplyResult:
        """Perform the effects in order; report which loads completed or failed."""
        self._check_open()
        result = ApplyResult()
        for effect in effects:
            if isinstance(effect, LoadAdapter):
                self._load(effect, result)
            elif isinstance(effect, EvictAdapter):
                self._events.pop(effect.name, None)
                self._waiting.pop(effect.name, None)
                dropped = self._reads.pop(effect.name, None)
                if dropped is not None:  # its ring slice comes back once the worker is done with it
                    self._orphans.append((dropped[0], dropped[2]))
            elif isinstance(effect, DropHostCopy):
                copy = self._host.pop(effect.name, None)
                read = self._reads.get(effect.name, (None,))[0]
                if read is not None:  # the copy it would keep is dropped too
                    self._unkept.add(read)
                if isinstance(read, HostRead) and isinstance(copy, str) and read.host_file == copy:
                    read.kept = copy  # the file it reads goes once the read is over
                else:
                    remove_file(copy)
                if effect.name in self._waiting:  # its files are read once it has room, keeping no copy
                    self._waiting[effect.name].unkept = True
            else:
                raise TypeError(f"unknown effect {effect!r}")
        return result

    def poll(self) -> ApplyResult:
        """CUDA: start the page copies of reads that finished; report the loads whose copies
        have completed since the last poll, and the reads that failed."""
        self._check_open()
        result = ApplyResult()
        if self._reads or self._orphans:
            self._reader.poll()
            self._release_orphans()
        for name in [n for n, (read, _, _) in self._reads.items() if read.done()]:
            read, effect, piece = self._reads.pop(name)
            if piece is not None:  # a read that held the ring is over: it moved
                self._ring_moved = time.monotonic()
            cache = effect.cache_on_host and read not in self._unkept
            self._unkept.discard(read)
            if not cache:
                remove_file(read.kept)
            keep = read.kept
            if isinstance(read, HostRead):
                if read.error is not None:  # the host copy is lost: read the adapter's files instead
                    self._host_copy_lost(effect, read, piece, cache)
                    continue
                keep = read.host_copy if cache else None
            try:
                buf, seconds = read.result()
                buf = self._check_pages(effect, buf)
                if not isinstance(read, HostRead):
                    self.reads.add(effect, seconds)
            except (AdapterError, OSError) as err:
                remove_file(read.kept)
                if piece is not None:
                    self._ring.release(piece)
                log.warning("loading adapter %r failed: %s", name, err)
                result.failed.append((name, str(err)))
                continue
            try:
                self._finish_read(effect, buf, piece, keep, cache)
            except (AdapterError, OSError) as err:
                if piece is not None and piece.event is None:  # no copy reads it
                    self._ring.release(piece)
                log.warning("loading adapter %r failed: %s", name, err)
                result.failed.append((name, str(err)))
        copied = [name for name, event in self._events.items() if event.query()]
        for name in copied:
            del self._events[name]
        if self._waiting:  # after the reads and copies that finished: their slices may be free now
            self._start_waiting(result)
        result.done += copied  # after any load `_start_waiting` completed here (CPU, in tests)
        return result

    @property
    def ring_bytes(self) -> int:
        """The staging ring's size now (CUDA; 0: none)."""
        return self._ring.capacity if self._ring is not None else 0

    @property
    def read_workers(self) -> int:
        """Reader processes adapter files may be read in at once (CUDA; 0: read in this process)."""
        return self._reader.max_workers if self._reader is not None else 0

    def mark_step(self) -> None:
        """Mark the device stream before a step's forward pass: page copies started from here on wait for
        the work queued before the mark, not for that step (CUDA; the engine's contract: no kernel of the
        step reads or writes the pages of a load it performs).  Without a mark a copy waits for all the
        work queued on the device's current stream."""
        if self._cuda:
            if self._fence is None:
                self._fence = torch.cuda.Event()
            self._fence.record(torch.cuda.current_stream(self.device))

    def close(self) -> None:
        """Stop the background readers (reads in flight are abandoned; host copies being read into the ring
        are read to the end first, those queued are not; loads waiting for ring room are dropped, never
        reported); the host copies kept in files and the shared ring's file go.  Safe to call again;
        `apply`, `start_reads` and `poll` then raise `ClosedError`."""
        self.closed = True
        self._waiting.clear()
        if self._reader is not None:
            self._reader.shutdown()
        if self._host_reads is not None:  # they write into the ring: over before it goes (queued ones dropped)
            self._host_reads.shutdown(wait=True, cancel_futures=True)
        if self._host_dir is not None:
            self._host = {name: buf for name, buf in self._host.items() if not isinstance(buf, str)}
            if self._host_end is not None:
                self._host_end()
        if self._ring is not None:
            if self._stream is not None:  # copies still reading the ring (on the copy stream) end first
                self._stream.synchronize()
            self._ring.close()
            self._ring = None

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError("the pool storage is closed: no adapter loads or reads after close()")

    def load_event(self, name: str):
        """The CUDA event of a load still in flight, or None."""
        return self._events.get(name)

    def has_host_copy(self, name: str) -> bool:
        return name in self._host

    def start_reads(self, effects) -> None:
        """Submit now the file reads of the loads among ``effects`` that `apply` would submit (CUDA: a load
        with no host copy).  A read takes longest of a load's parts, so the engine submits the reads first,
        once a step's forward pass is launched, and then performs the effects.  A load of an adapter that
        ``effects`` also evict is left to `apply`."""
        self._check_open()
        if self._reader is None:
            return
        evicted = {e.name for e in effects if isinstance(e, EvictAdapter)}
        for effect in effects:
            if isinstance(effect, LoadAdapter) and effect.name not in evicted and self._needs_read(effect):
                self._fit_ring(effect)
                self._submit(effect)

    def _needs_read(self, effect: LoadAdapter) -> bool:
        """Whether ``effect``'s file read is still to submit: no host copy to load from, no read of it in flight."""
        if effect.from_host and effect.name in self._host:
            return False
        if effect.name in self._waiting and self._waiting[effect.name].effect is effect:
            return False
        in_flight = self._reads.get(effect.name)
        return in_flight is None or in_flight[1] is not effect

    def _submit(self, effect: LoadAdapter, unkept: bool = False, piece: RingSlice | None = None,
                wait: bool = True) -> None:
        """Read and pack the adapter's files in a reader process, straight into a slice of the shared ring
        (``piece``, or one reserved here).  With no room there now the read waits for some, behind the loads
        already waiting (`_start_waiting`); through a file (staged by `poll` on this thread) where the ring
        can never hold it or is not shared, or it has waited too long (not ``wait``).  ``unkept``: keep no
        host copy of what it reads."""
        shared = self._ring is not None and self._ring.path is not None
        if piece is not None and not shared:  # (a waiting host-copy load whose copy was dropped)
            self._ring.release(piece)
            piece = None
        if piece is None and wait and shared and self._packed_bytes(effect) <= self._ring.capacity:
            piece = self._room_or_wait(effect, unkept)
            if piece is None:
                return
        target = None
        if piece is not None:
            keep = self._keep_path() if effect.cache_on_host and not unkept else None
            target = SharedTarget(self._ring.path, piece.start, self._ring.view(piece), keep)
        try:
            read = self._reader.submit(effect.info, effect.layout, self.config.model, self.config.page_elems,
                                       self.dtype, target)
        except Exception as err:  # e.g. no reader process could be started, or the request does not pickle:
            read = Read(target, None)  # the load fails at the next poll, and its slice comes back then
            read.fail(f"adapter {effect.name!r}: no reader could take its read: {err}")
        self._reads[effect.name] = (read, effect, piece)
        if unkept:
            self._unkept.add(read)

    def _release_orphans(self) -> None:
        """Give back the ring slices of dropped reads that are over."""
        keep = []
        for read, piece in self._orphans:
            if not read.done():
                keep.append((read, piece))
                continue
            remove_file(read.kept)
            self._unkept.discard(read)
            if piece is not None:
                self._ring.release(piece)
                self._ring_moved = time.monotonic()
        self._orphans = keep

    def _keep_path(self) -> str | None:
        """A new file for a reader to keep a host copy in (None: no directory for them)."""
        if self._host_dir is None:
            try:
                sweep_dead(SHM_DIR, HOST_PREFIX)  # those of processes that died without removing theirs
                self._host_dir = tempfile.mkdtemp(prefix=f"{HOST_PREFIX}{os.getpid()}-", dir=SHM_DIR)
                lock = hold_lock(self._host_dir)
            except OSError as err:
                log.warning("host copies stay in this process: no directory for them in %s (%s)", SHM_DIR, err)
                if self._host_dir:  # made, but not locked
                    shutil.rmtree(self._host_dir, ignore_errors=True)
                self._host_dir = ""
            else:
                self._host_end = weakref.finalize(self, _remove_dir, self._host_dir, lock)
        if not self._host_dir:
            return None
        return os.path.join(self._host_dir, f"{next(self._host_names)}.bin")

    def _load(self, effect: LoadAdapter, result: ApplyResult) -> None:
        self._fit_ring(effect)
        self._warn_oversized(effect)
        buf = self._host.get(effect.name) if effect.from_host else None
        if buf is not None and self._start_host_read(effect, buf):  # copied into the ring on a thread
            return
        self._load_here(effect, buf, result)

    def _load_here(self, effect: LoadAdapter, buf: str | torch.Tensor | None, result: ApplyResult) -> None:
        """Load from the host copy ``buf`` on this thread (read, or staged and pinned, here), or, with none,
        from the adapter's files (submitted to the readers, if any)."""
        piece = keep = None
        if isinstance(buf, str):  # a file a reader kept, read here: it stays the host copy
            keep = buf
            buf, piece = self._read_host_file(effect, keep)
            keep = keep if buf is not None else None
        if buf is None and self._reader is not None:
            if self._needs_read(effect):
                self._submit(effect)
            else:  # `start_reads` submitted it: a drop applied since was of an older host copy
                self._keep_what_it_reads(effect.name)
            return
        try:
            buf = buf if buf is not None else self.read_packed(effect)
            self._finish_read(effect, buf, piece, keep)
        except (AdapterError, OSError) as err:
            log.warning("loading adapter %r failed: %s", effect.name, err)
            result.failed.append((effect.name, str(err)))
            return
        if not self._cuda:
            result.done.append(effect.name)

    def _start_host_read(self, effect: LoadAdapter, host_copy: str | torch.Tensor) -> bool:
        """With reader processes (CUDA): copy the host copy — a file a reader kept, or a buffer of this
        process (a read that came back through a file: an adapter larger than the ring, a ring not in
        shared memory, a read that waited too long for room; or one kept with no directory for host
        files) — into a ring slice on a thread of this process (`HostRead`; `poll` copies the pages in
        once it is there), so the step loop does not wait for it (a 640 MiB adapter: about 60 ms of
        memory copy).  With no ring room now it waits for some, behind the loads already waiting (`poll`
        starts it once copies in flight give room back, or stages it once the ring has been held still
        for `RING_WAIT_S`): staging it here instead would pin it on this thread (about 1 s for four such
        adapters, in one step, on an H200 host).  False where the ring can never hold it, or no thread can
        be started: then it is read (`_read_host_file`) or staged (`_copy_pages`) on this thread."""
        if self._reader is None or self._ring is None or self._packed_bytes(effect) > self._ring.capacity:
            return False
        piece = self._room_or_wait(effect, False)
        return piece is None or self._begin_host_read(effect, host_copy, piece)

    def _room_or_wait(self, effect: LoadAdapter, unkept: bool) -> RingSlice | None:
        """A ring slice for ``effect``'s load, or None with the load queued (`Waiting`) behind those already
        waiting (none starts ahead of them, even if the ring has room now)."""
        piece = None if self._waiting else self._ring.reserve(self._packed_bytes(effect))
        if piece is None:
            self._waiting[effect.name] = Waiting(effect, unkept)
        return piece

    def _begin_host_read(self, effect: LoadAdapter, host_copy: str | torch.Tensor, piece: RingSlice) -> bool:
        """`HostRead` of ``host_copy`` into ``piece`` on a thread; False (``piece`` given back) if no thread
        can be started."""
        if self._host_reads is None:
            self._host_reads = ThreadPoolExecutor(HOST_READ_THREADS, thread_name_prefix="unipage-host-read")
        read = HostRead(host_copy)
        try:
            self._host_reads.submit(read.run, self._ring.view(piece), self.dtype, self._packed_shape(effect))
        except RuntimeError:  # no thread can be started (e.g. at interpreter shutdown): read it here
            self._ring.release(piece)
            return False
        self._reads[effect.name] = (read, effect, piece)
        return True

    def _start_waiting(self, result: ApplyResult) -> None:
        """Start the loads waiting for ring room, oldest first, while it has room (or the ring has not moved
        for `_wait_limit` of their wait): a host copy's on a thread, a file read in a reader process (also a
        host-copy load's whose copy was dropped meanwhile)."""
        now, limit = time.monotonic(), self._wait_limit()
        while self._waiting:
            name, wait = next(iter(self._waiting.items()))
            piece = self._ring.reserve(self._packed_bytes(wait.effect))
            still = now - max(wait.since, self._ring_moved)  # of its wait, the time the ring stood still
            if piece is None and still < limit:
                return
            del self._waiting[name]
            if piece is not None:
                self._ring_moved = now
            else:
                log.warning("adapter %r waited %.1f s for staging ring room, %.1f s of them with the ring "
                            "held still: loading it on the step loop's thread", name, now - wait.since, still)
            host_copy = self._host.get(name) if wait.effect.from_host else None
            if host_copy is None:
                self._submit(wait.effect, wait.unkept, piece, wait=False)
            elif piece is None or not self._begin_host_read(wait.effect, host_copy, piece):
                self._load_here(wait.effect, host_copy, result)

    def _wait_limit(self) -> float:
        """How long the ring may stand still before a waiting load goes the step loop's way: `RING_WAIT_S`, or
        the time the largest slice a read in flight fills would take at `SLOW_READ_BYTES_PER_S`."""
        held = max((piece.nbytes for _, _, piece in self._reads.values() if piece is not None), default=0)
        return max(RING_WAIT_S, held / SLOW_READ_BYTES_PER_S)

    def _keep_what_it_reads(self, name: str) -> None:
        """The file read submitted for ``name`` keeps its host copy after all (a drop of the host copy was
        applied after the read was submitted, but before its load: it was of an older copy)."""
        if name in self._waiting:
            self._waiting[name].unkept = False
        elif name in self._reads:
            self._unkept.discard(self._reads[name][0])

    def _host_copy_lost(self, effect: LoadAdapter, read: HostRead, piece: RingSlice, cache: bool) -> None:
        """A host copy could not be copied into the ring (`HostRead`): the copy goes and the adapter's files
        are read instead (a read whose host copy was dropped meanwhile keeps none this time either)."""
        log.warning("the host copy of adapter %r is lost (%s): reading its files", effect.name, read.error)
        if same_copy(self._host.get(effect.name), read.host_copy):
            remove_file(self._host.pop(effect.name))
        self._submit(effect, not cache, piece)  # into the slice the copy was to fill

    def _fit_ring(self, effect: LoadAdapter) -> None:
        """An auto-sized shared ring (`RING_START_BYTES`) too small for ``effect``'s adapter is replaced by
        one that holds two of it (whole MiB, at most `RING_MAX_BYTES`; none for an adapter larger than that)
        if no read or copy holds a slice of it now; else it stays (that load goes the step loop's way,
        `_warn_oversized`) and a later load tries again.  Making the new ring (its file allocated and
        registered) and closing the old one run on this thread, once per growth.  The readers map the new
        file; the old one's memory goes once each of them has read into the new one."""
        if self._ring is None:
            return
        nbytes = self._packed_bytes(effect)
        if nbytes <= self._ring.capacity or not self._can_grow(nbytes) or not self._ring_idle():
            return
        size = min(RING_MAX_BYTES, -(-2 * nbytes // (1 << 20)) << 20)
        try:
            ring = PinnedRing(size, pin=self._cuda, shared=True)
        except OSError as err:  # no room for it in shared memory, or not registered: the ring stays as it is
            log.warning("the staging ring stays at %.1f MiB: a shared ring of %.1f MiB could not be made (%s)",
                        self._ring.capacity / (1 << 20), size / (1 << 20), err)
            self._ring_auto = False
            return
        self._ring.close()
        self._ring, self._ring_moved = ring, time.monotonic()  # (loads waiting for room find it here)
        log.info("staging ring grown to %.1f MiB for adapter %r (%.1f MiB packed)", ring.capacity / (1 << 20),
                 effect.name, nbytes / (1 << 20))

    def _can_grow(self, nbytes: int) -> bool:
        """Whether the ring may be replaced by one that holds ``nbytes``: auto-sized, shared, within the cap."""
        return self._ring_auto and self._ring.path is not None and nbytes <= RING_MAX_BYTES

    def _ring_idle(self) -> bool:
        """Whether no read in flight (or dropped, still running) holds a slice of the ring and no copy out of
        it is pending (reads through files and loads waiting for room do not use it yet)."""
        holders = [piece for _, _, piece in self._reads.values()] + [piece for _, piece in self._orphans]
        return all(piece is None for piece in holders) and self._ring.idle()

    def _warn_oversized(self, effect: LoadAdapter) -> None:
        """Once per adapter: one larger than the ring cannot pass through it (CUDA), so its loads are
        staged and pinned on the step loop's thread."""
        if self._ring is None or effect.name in self._oversized:
            return
        nbytes = self._packed_bytes(effect)
        if nbytes > self._ring.capacity:
            self._oversized.add(effect.name)
            then = ("this load is staged on the step loop's thread; the ring grows for it once no read holds a "
                    "slice of it" if self._can_grow(nbytes) else "its loads are staged on the step loop's thread")
            log.warning("adapter %r packs to %.1f MiB, more than the %.1f MiB staging ring "
                        "(LoRAConfig.staging_ring_bytes): %s", effect.name, nbytes / (1 << 20),
                        self._ring.capacity / (1 << 20), then)

    def _read_host_file(self, effect: LoadAdapter, path: str) -> tuple[torch.Tensor | None, RingSlice | None]:
        """A host copy kept in a file, read into a slice of the ring (or, with no room there, into a new
        buffer); ``(None, None)`` if the file cannot be read (its host copy is dropped: read the adapter's
        files instead)."""
        nbytes = self._packed_bytes(effect)
        piece = self._ring.reserve(nbytes) if self._ring is not None else None
        dst = self._ring.view(piece) if piece is not None else torch.empty(nbytes, dtype=torch.uint8)
        start = time.perf_counter()
        try:
            read_into(path, dst)
        except OSError as err:
            log.warning("the host copy of adapter %r is lost (%s): reading its files", effect.name, err)
            if piece is not None:
                self._ring.release(piece)
            remove_file(self._host.pop(effect.name, None))
            return None, None
        finally:
            self.loop.read += time.perf_counter() - start
        return dst.view(self.dtype).view(self._packed_shape(effect)), piece

    def _packed_shape(self, effect: LoadAdapter) -> tuple[int, int, int]:
        """The shape ``[L, n, P]`` of the load's packed host buffer."""
        return self.config.model.pool_rows, len(effect.pages), self.config.page_elems

    def _packed_bytes(self, effect: LoadAdapter) -> int:
        rows, pages, elems = self._packed_shape(effect)
        return rows * pages * elems * self.pool.element_size()

    def _finish_read(self, effect: LoadAdapter, buf: torch.Tensor, piece: RingSlice | None = None,
                     keep: str | torch.Tensor | None = None, cache: bool | None = None) -> None:
        """Keep the host copy if asked (``keep``, if there is one already: a file, or the buffer of this
        process a `HostRead` copied from), and copy the pages into the pool (on CUDA: on the side stream,
        from the pinned ring — ``buf`` already lies in its slice ``piece``, or is staged into it here;
        pinned on its own only when the ring has no room for it).
        A copy that cannot be started (e.g. no device memory for it) is an `AdapterError`.  ``cache``: keep
        the host copy (default: as the load asks)."""
        cache = effect.cache_on_host if cache is None else cache
        start = time.perf_counter()
        try:
            if self._cuda:
                self._copy_pages(effect, buf, piece)
            else:
                self.pool.index_copy_(1, torch.tensor(effect.pages, dtype=torch.long), buf)
        finally:
            if cache:  # after the copy is launched: the device need not wait for it
                self._keep_host_copy(effect.name, keep if keep is not None else
                                     unpinned_copy(buf) if piece is not None else buf)
            if piece is not None and not self._cuda:  # copied already
                self._ring.release(piece)
            self.loop.finish += time.perf_counter() - start

    def _keep_host_copy(self, name: str, copy: torch.Tensor | str) -> None:
        old = self._host.get(name)
        if isinstance(old, str) and not (isinstance(copy, str) and copy == old):
            remove_file(old)  # a file it replaces
        self._host[name] = copy

    def _copy_pages(self, effect: LoadAdapter, buf: torch.Tensor, piece: RingSlice | None) -> None:
        pages = torch.tensor(effect.pages, dtype=torch.long)
        staged = buf if piece is not None else self._ring.stage(buf)
        if staged is None:
            src, index = buf.pin_memory(), pages
        else:
            src, index = staged, self._ring.stage(pages)
            index = pages if index is None else index
        if self._fence is not None:
            self._stream.wait_event(self._fence)
        else:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        failure = None
        with torch.cuda.stream(self._stream):
            # Allocated on the side stream, so their memory is not reused by the compute
            # stream before the copy has run.
            try:
                self.pool.index_copy_(1, index.to(self.device, non_blocking=True),
                                      src.to(self.device, non_blocking=True))
            except RuntimeError as err:  # torch.cuda.OutOfMemoryError among others
                failure = err
            event = torch.cuda.Event()
            event.record(self._stream)  # after whatever part of the copy was issued
        self._ring.hold(event)  # the slices come back either way
        if piece is not None:
            self._ring.hold_slice(piece, event)
        if failure is not None:
            raise AdapterError(f"adapter {effect.name!r}: copying its pages to the device failed: {failure}")
        self._events[effect.name] = event

    def read_packed(self, effect: LoadAdapter) -> torch.Tensor:
        """Read the adapter's files and pack them into a host page buffer ``[L, n, P]``, in this process
        (without CUDA; on CUDA the reader processes do it)."""
        start = time.perf_counter()
        try:
            buf = self._check_pages(effect, read_and_pack(effect.info, effect.layout, self.config.model,
                                                          self.config.page_elems, self.dtype))
        finally:
            seconds = time.perf_counter() - start
            self.loop.read += seconds
        self.reads.add(effect, seconds)
        return buf

    @staticmethod
    def _check_pages(effect: LoadAdapter, buf: torch.Tensor) -> torch.Tensor:
        if len(effect.pages) != buf.shape[1]:
            raise AdapterError(f"adapter {effect.name!r}: packed {buf.shape[1]} pages, "
                               f"{len(effect.pages)} assigned")
        return buf

    def gather(self, record: AdapterRecord) -> LoraWeights:
        """Read a resident adapter's matrices back out of the pool through its page table."""
        if record.pages is None:
            raise AdapterError(f"adapter {record.name!r} is not resident")
        return gather_adapter(self.pool, record.pages, record.layout)


def _pinned_ring(nbytes: int) -> PinnedRing:
    """The ring page copies pass through: in shared memory, so reader processes can pack into it, unless
    the system has no room for that."""
    try:
        return PinnedRing(nbytes, shared=True)
    except OSError as err:
        log.warning("no shared pinned ring (%s): packed adapters are staged on the step loop's thread", err)
        return PinnedRing(nbytes)


def _remove_dir(path: str, lock: int) -> None:
    """The host copies' directory goes, and its lock."""
    shutil.rmtree(path, ignore_errors=True)
    os.close(lock)
