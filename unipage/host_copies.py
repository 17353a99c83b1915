"""Host copies of adapters (the host tier's buffers: ``[L, n, P]`` packed pages, held as a tensor of this
process or a file in shared memory) and `HostRead`, which copies one into a slice of the pinned ring on a
thread, for `unipage.storage.PoolStorage`."""

from __future__ import annotations

import time

import torch

from unipage.adapter_reader import Read
from unipage.errors import AdapterError
from unipage.pinned import copy_bytes


class HostRead(Read):
    """A host copy — a file, or a buffer of this process — copied into a ring slice on a thread
    (`PoolStorage._begin_host_read`): done once ``run`` has filled the slice (``buf``) or failed
    (``error``).  It stays the adapter's host copy: ``kept`` is None unless the host tier drops a file copy
    while it is read, when it names the file to remove once the read is over."""

    __slots__ = ("host_copy",)

    def __init__(self, host_copy: str | torch.Tensor) -> None:
        super().__init__(None, None)
        self.host_copy = host_copy

    @property
    def host_file(self) -> str | None:
        """The host copy's file (None: a buffer of this process)."""
        return self.host_copy if isinstance(self.host_copy, str) else None

    def run(self, dst: torch.Tensor, dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
        start = time.perf_counter()
        try:
            if isinstance(self.host_copy, str):
                read_into(self.host_copy, dst)
            else:
                nbytes = self.host_copy.numel() * self.host_copy.element_size()
                if nbytes != dst.numel():
                    raise ValueError(f"the host copy is {nbytes} bytes, its slice {dst.numel()}")
                copy_bytes(dst, self.host_copy)
        except Exception as err:  # (on a thread: whatever went wrong must reach `poll`, or the slice is lost)
            self.error = AdapterError(f"{type(err).__name__}: {err}")
            return
        self.seconds = time.perf_counter() - start
        self.buf = dst.view(dtype).view(shape)  # last: `done` from here on


def read_into(path: str, dst: torch.Tensor) -> None:
    """Fill ``dst`` (uint8) with the bytes of the file ``path``; `OSError` if it holds fewer."""
    with open(path, "rb") as f:
        if f.readinto(dst.numpy()) != dst.numel():
            raise OSError(f"{path} is short of {dst.numel()} bytes")


def same_copy(a: str | torch.Tensor | None, b: str | torch.Tensor) -> bool:
    """Whether two host copies are one: the same file, or the same buffer."""
    return a is b or (isinstance(a, str) and isinstance(b, str) and a == b)


def unpinned_copy(buf: torch.Tensor) -> torch.Tensor:
    """A copy of ``buf`` in ordinary host memory (`copy_bytes`)."""
    out = torch.empty(buf.shape, dtype=buf.dtype)
    copy_bytes(out, buf)
    return out
