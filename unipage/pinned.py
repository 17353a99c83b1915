"""`PinnedRing`: one pinned host buffer that adapter page copies pass through.

Pinning a buffer (``cudaHostAlloc``) costs milliseconds per megabyte (6 ms for
2 MB on an H100 host), paid on the step loop's thread.  Pinning every adapter as
it arrives from the reader processes cost about 2 ms a load while serving — several milliseconds of a prefill step
that admits a few new adapters.  Instead the storage keeps one ring, pinned
once: a host buffer is copied (``memcpy``) into the ring's next free bytes and
the device copy reads it from there asynchronously.  Copies run in order on
one side stream, so slices are freed first in, first out: a slice is reused
only after the event recorded behind its copy has completed.

Sizes are in bytes; every slice starts 512-byte aligned.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

ALIGN = 512


class PinnedRing:
    def __init__(self, nbytes: int, pin: bool = True) -> None:
        if nbytes < ALIGN:
            raise ValueError(f"a pinned ring needs at least {ALIGN} bytes, got {nbytes}")
        self.capacity = nbytes // ALIGN * ALIGN
        self.buf = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=pin)
        self.head = 0  # where the next slice starts
        self._live: deque[list] = deque()  # [start, event or None] of held slices, oldest first

    def stage(self, src: torch.Tensor) -> torch.Tensor | None:
        """A copy of ``src`` (same shape and dtype) in the ring, or None when there is no room now.
        Call `hold` with the event behind the copies that read it once they are issued."""
        nbytes = src.numel() * src.element_size()
        size = -(-nbytes // ALIGN) * ALIGN
        start = self._room(size)
        if start is None:
            return None
        dst = self.buf[start:start + nbytes]
        # One thread, the GIL released: torch's copy_ splits a copy over its intra-op threads, and
        # with the reader processes busy on some cores the split copy waited on descheduled
        # threads (3 ms for 2 MB while serving, 0.03 ms alone).
        np.copyto(dst.numpy(), src.contiguous().view(-1).view(torch.uint8).numpy())
        dst = dst.view(src.dtype).view(src.shape)
        self._live.append([start, None])
        self.head = start + size if start + size < self.capacity else 0
        return dst

    def hold(self, event) -> None:
        """The copies that read the slices staged since the last `hold` complete with ``event``
        (``query() -> bool``)."""
        for live in reversed(self._live):
            if live[1] is not None:
                break
            live[1] = event

    @property
    def in_use(self) -> int:
        """Slices still held (their copies not known to be complete)."""
        return len(self._live)

    def _room(self, size: int) -> int | None:
        """Start of ``size`` free bytes at the head, or at 0 after a wrap; None if they are not free."""
        while self._live and self._live[0][1] is not None and self._live[0][1].query():
            self._live.popleft()
        if size > self.capacity:
            return None
        if not self._live:
            self.head = 0
            return 0
        tail = self._live[0][0]  # start of the oldest slice still held
        if self.head > tail:  # held: [tail, head); free: [head, capacity) and [0, tail)
            if self.head + size <= self.capacity:
                return self.head
            return 0 if size <= tail else None
        return self.head if self.head + size <= tail else None  # held wraps; free: [head, tail)
