"""`PinnedRing`: one pinned host buffer that adapter page copies pass through.

Pinning a buffer (``cudaHostAlloc``) costs milliseconds per megabyte (6 ms for
2 MB on an H100 host), paid on the step loop's thread.  Pinning every adapter as
it arrives from the reader processes cost about 2 ms a load while serving — several milliseconds of a prefill step
that admits a few new adapters.  Instead the storage keeps one ring, pinned
once, and the device copy reads each adapter from a slice of it asynchronously.

Two ways into a slice:

- `stage` copies (``memcpy``) a host buffer into the ring's next free bytes, on
  the caller's thread; `hold` then names the event behind the copies that read
  what was staged.
- `reserve` hands out a slice for someone else to fill — with ``shared=True``
  the ring is a file in shared memory (``ring.path``) that the adapter reader
  processes map and pack straight into, so the step loop copies nothing — and
  the slice comes back with `hold_slice` (its event) or `release` (not copied).

Slices are freed first in, first out: a slice is reused only once it and every
slice handed out before it is done (released, or its event completed).

Sizes are in bytes; every slice starts 512-byte aligned.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import shutil
import tempfile
import time
import weakref
from collections import deque

import numpy as np
import torch

ALIGN = 512
SHM_DIR = "/dev/shm"  # where a shared ring's file lives (memory, not disk), if this system has it
RING_PREFIX = "unipage-ring-"  # a shared ring's file: RING_PREFIX + pid + "-" + a unique suffix
SWEEP_AGE_S = 60.0  # `sweep_dead` leaves younger entries alone (their maker may not hold its lock yet)


class RingSlice:
    """Bytes ``[start, start + nbytes)`` of a ring, held until released or ``event`` completes."""

    __slots__ = ("event", "nbytes", "released", "start")

    def __init__(self, start: int, nbytes: int) -> None:
        self.start = start
        self.nbytes = nbytes
        self.event = None  # behind the copy that reads the slice (``query() -> bool``)
        self.released = False  # done without a copy

    def done(self) -> bool:
        return self.released or (self.event is not None and self.event.query())


class PinnedRing:
    def __init__(self, nbytes: int, pin: bool = True, shared: bool = False) -> None:
        """``shared``: backed by a file in shared memory (`SHM_DIR`) that other processes may map
        (``path``); an `OSError` if there is no room for it."""
        if nbytes < ALIGN:
            raise ValueError(f"a pinned ring needs at least {ALIGN} bytes, got {nbytes}")
        self.capacity = nbytes // ALIGN * ALIGN
        self.path: str | None = None
        self._finalizer = None
        if shared:
            self.path, mapping, lock = _shared_file(self.capacity)
            self.buf = torch.frombuffer(mapping, dtype=torch.uint8)
            try:
                registered = pin and _register(self.buf)
            except OSError:
                remove_file(self.path)  # (the memory goes with the mapping)
                os.close(lock)
                raise
            # Unregistered before the mapping goes: the driver would take a later mapping at the same
            # address for registered memory, and refuse to register it.
            self._finalizer = weakref.finalize(self, _release_shared, self.path,
                                               self.buf.data_ptr() if registered else None, mapping, lock)
        else:
            self.buf = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=pin)
        self.head = 0  # where the next slice starts
        self._live: deque[RingSlice] = deque()  # slices held, oldest first
        self._staged: list[RingSlice] = []  # staged since the last `hold`

    def close(self) -> None:
        """A shared ring: unregister it and remove its file now (after the copies in flight), not when it is
        collected.  The ring must not be used after this."""
        if self._finalizer is not None:
            self._finalizer()

    def stage(self, src: torch.Tensor) -> torch.Tensor | None:
        """A copy of ``src`` (same shape and dtype) in the ring, or None when there is no room now.
        Call `hold` with the event behind the copies that read it once they are issued."""
        nbytes = src.numel() * src.element_size()
        piece = self.reserve(nbytes)
        if piece is None:
            return None
        dst = self.view(piece)
        copy_bytes(dst, src)
        self._staged.append(piece)
        return dst.view(src.dtype).view(src.shape)

    def hold(self, event) -> None:
        """The copies that read the slices staged since the last `hold` complete with ``event``
        (``query() -> bool``)."""
        for piece in self._staged:
            piece.event = event
        self._staged.clear()

    def reserve(self, nbytes: int) -> RingSlice | None:
        """``nbytes`` of the ring for the caller to fill, or None when there is no room now.  The slice
        is held until `hold_slice` or `release`."""
        size = -(-nbytes // ALIGN) * ALIGN
        start = self._room(size)
        if start is None:
            return None
        piece = RingSlice(start, nbytes)
        self._live.append(piece)
        self.head = start + size if start + size < self.capacity else 0
        return piece

    def view(self, piece: RingSlice) -> torch.Tensor:
        """The slice's bytes (uint8)."""
        return self.buf[piece.start:piece.start + piece.nbytes]

    @staticmethod
    def hold_slice(piece: RingSlice, event) -> None:
        """The copy that reads ``piece`` completes with ``event``."""
        piece.event = event

    @staticmethod
    def release(piece: RingSlice) -> None:
        """``piece`` is not read by any copy: it may be reused (once the slices before it are)."""
        piece.released = True

    @property
    def in_use(self) -> int:
        """Slices still held (their copies not known to be complete)."""
        return len(self._live)

    def idle(self) -> bool:
        """Whether no slice is held any more (the copies of the released ones complete)."""
        self._drop_done()
        return not self._live and not self._staged

    def _drop_done(self) -> None:
        """Forget the slices at the tail that are no longer held."""
        while self._live and self._live[0].done():
            self._live.popleft()

    def _room(self, size: int) -> int | None:
        """Start of ``size`` free bytes at the head, or at 0 after a wrap; None if they are not free."""
        self._drop_done()
        if size > self.capacity:
            return None
        if not self._live:
            self.head = 0
            return 0
        tail = self._live[0].start  # start of the oldest slice still held
        if self.head > tail:  # held: [tail, head); free: [head, capacity) and [0, tail)
            if self.head + size <= self.capacity:
                return self.head
            return 0 if size <= tail else None
        return self.head if self.head + size <= tail else None  # held wraps; free: [head, tail)


def _shared_file(nbytes: int) -> tuple[str, mmap.mmap, int]:
    """A new file of ``nbytes`` in shared memory, its blocks allocated now (so that touching a page
    later cannot fail), mapped shared, and its descriptor, which holds a shared lock on it while open
    (`sweep_dead`); an `OSError` if this system has no shared memory directory (a file on disk would be
    written back).  The files of processes that died without removing theirs (SIGKILL, an OOM kill)
    are removed first."""
    if not os.path.isdir(SHM_DIR):
        raise OSError(f"no shared memory directory {SHM_DIR}")
    sweep_dead(SHM_DIR, RING_PREFIX)
    fd, path = tempfile.mkstemp(prefix=f"{RING_PREFIX}{os.getpid()}-", dir=SHM_DIR)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
        else:
            os.ftruncate(fd, nbytes)
        return path, mmap.mmap(fd, nbytes), fd
    except OSError:
        remove_file(path)
        os.close(fd)
        raise


def hold_lock(path: str) -> int:
    """Open ``path`` (a file or a directory) and hold a shared lock on it while the returned descriptor
    is open: `sweep_dead` leaves it alone."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def sweep_dead(directory: str, prefix: str) -> None:
    """Remove the entries ``<prefix>*`` of ``directory`` that no process holds a lock on (`hold_lock`),
    older than `SWEEP_AGE_S`: left by processes that died without removing them.  A lock goes with its
    process, in whatever pid namespace it ran."""
    try:
        names = [name for name in os.listdir(directory) if name.startswith(prefix)]
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            if time.time() - os.fstat(fd).st_mtime < SWEEP_AGE_S:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # locked: its process runs
            continue
        finally:
            os.close(fd)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            remove_file(path)


def _register(buf: torch.Tensor) -> bool:
    """Page-lock ``buf``'s memory for the device (``cudaHostRegister``); an `OSError` if that fails."""
    err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0))
    if err != 0:
        try:  # the failure is also the thread's last CUDA error: read (and so clear) it now, or the
            torch.zeros(1, device="cuda")  # next kernel launch would report it as its own
        except RuntimeError:
            pass
        raise OSError(f"cudaHostRegister of a {buf.numel()}-byte shared ring failed: CUDA error {err}")
    return True


def _release_shared(path: str, registered_ptr: int | None, mapping: mmap.mmap, lock: int) -> None:
    """A shared ring's end: wait for copies that may still read it, unregister it, remove its file (the
    mapping goes with its last view) and let go of its lock."""
    if registered_ptr is not None:
        try:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(registered_ptr)
        except RuntimeError:  # CUDA already torn down at exit
            pass
    remove_file(path)
    os.close(lock)
    del mapping


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src``'s bytes into the contiguous ``dst`` (as many bytes) on one thread, the GIL released:
    torch's ``copy_`` splits a copy over its intra-op threads, and with the reader processes busy on some
    cores the split copy waited on descheduled threads (3 ms for 2 MB while serving, 0.03 ms alone)."""
    np.copyto(dst.view(-1).view(torch.uint8).numpy(), src.contiguous().view(-1).view(torch.uint8).numpy())


def remove_file(path) -> None:
    """Remove the file ``path`` if it is still there (anything but a path: nothing to do)."""
    if isinstance(path, str):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
