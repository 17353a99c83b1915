"""Adapter files read and packed in helper processes, off the serving process's GIL.

Reading an adapter (hash check, safetensors parse, transposes) and packing it
into its page layout is a few hundred to a few thousand small torch calls.  In
a thread of the serving process each of them competes for the GIL with the
step loop, which holds it almost always: a load that takes milliseconds alone
took hundreds of them while decoding.  `ReaderPool` runs the same work in
``python -m unipage.adapter_reader`` processes instead — plain subprocesses,
so the parent's ``__main__`` is never re-imported — and hands back the packed
host buffer ``[L, n, P]`` (unpinned: the caller stages it through its pinned ring).

The parent's threads that talk to the workers must hold the GIL as little as
possible: whenever one takes it, the step loop's next torch call waits for it.
So the request is pickled by the caller, and the buffer comes back through a
file in the pool's temporary directory, read with one ``readinto`` (the GIL
released), not through the pipe: megabytes through a pipe arrive in 64 KiB
pieces, and the thread took the GIL back for every piece.  (A design without
threads, polling the pipes from the step loop, measured worse: replies waited
for the next poll, so loads took longer.)

Protocol, over each worker's stdin/stdout: frames of an 8-byte little-endian
length and a pickle.  A request is ``(info, layout, model, page_elems,
dtype_name, path)``, the layout and the model each a pickle of its own (the
parent pickles one once for every adapter that shares it); a reply is ``("ok",
shape, dtype_name, seconds)`` with the raw bytes written to ``path`` (seconds:
the read and pack alone) or ``("error", exception type name, message)``.  The worker sends stray prints of imported code
to stderr, so they never corrupt a frame.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import pickle
import queue
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from unipage.errors import AdapterError

_LENGTH = struct.Struct("<Q")
PICKLE_CACHE = 64  # layouts and models kept pickled (parent) and unpickled (worker)


def read_and_pack(info, layout, model, page_elems: int, dtype: torch.dtype) -> torch.Tensor:
    """The adapter's files packed into a host page buffer ``[L, n, P]`` of ``dtype``."""
    from unipage.adapter_pack import pack_adapter
    from unipage.peft_io import load_adapter_weights

    return pack_adapter(layout, load_adapter_weights(info, model), page_elems, dtype)


def _frame(obj) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _send(stream, data: bytes) -> None:
    """One frame: ``data`` (a `_frame`) after its length."""
    stream.write(_LENGTH.pack(len(data)))
    stream.write(data)
    stream.flush()


def _receive(stream):
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError("the adapter reader process closed its pipe")
    (length,) = _LENGTH.unpack(head)
    data = stream.read(length)
    if len(data) < length:
        raise EOFError("the adapter reader process closed its pipe mid-frame")
    return pickle.loads(data)


class _Worker:
    """One ``python -m unipage.adapter_reader`` process (with PYTHONSAFEPATH set)."""

    def __init__(self) -> None:
        # Modules as found here; PYTHONSAFEPATH (Python 3.11+, as -P): not the working directory first
        # (``-m`` would put it there), so a ``unipage`` folder in it cannot stand in for this package.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), PYTHONSAFEPATH="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "unipage.adapter_reader"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)

    def call(self, request: bytes, path: str) -> tuple[torch.Tensor, float]:
        try:
            _send(self.proc.stdin, request)
            reply = _receive(self.proc.stdout)
            if reply[0] == "error":
                raise AdapterError(f"{reply[1]}: {reply[2]}")
            _, shape, dtype_name, seconds = reply
            dtype = getattr(torch, dtype_name)
            buf = torch.empty(shape, dtype=dtype)
            try:  # an error here is the file's, not the worker's: it lives on
                with open(path, "rb") as f:
                    got = f.readinto(buf.view(-1).view(torch.uint8).numpy())
            except OSError as err:
                raise AdapterError(f"reading the packed buffer back from {path} failed: {err}") from err
            if got != buf.numel() * buf.element_size():
                raise AdapterError(f"the adapter reader process wrote a short buffer to {path}")
            return buf, seconds
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the worker exits at end of input
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class ReaderPool:
    """Up to ``workers`` reader processes: one started at once (it imports torch while the engine
    starts), the others when reads overlap.  They exit when the pool is shut down or collected;
    after that no process is started again and a read fails with `AdapterError`."""

    def __init__(self, workers: int) -> None:
        self.max_workers = workers
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: list[_Worker] = [_Worker()]
        self._idle.put(self._all[0])
        self._lock = threading.Lock()  # guards _all and _closed
        self._closed = threading.Event()
        self._threads = ThreadPoolExecutor(workers, "unipage-adapter-read")
        self._dir = tempfile.mkdtemp(prefix="unipage-reads-")  # the packed buffers on their way back
        self._names = itertools.count()
        self._pickles: dict[int, tuple[object, bytes]] = {}  # id -> (object, its pickle): `_pickled`
        self._finalizer = weakref.finalize(self, _close, self._lock, self._closed, self._all, self._threads,
                                           self._dir)

    def submit(self, info, layout, model, page_elems: int, dtype: torch.dtype) -> Future:
        """A future of ``(packed buffer, seconds the worker spent)``; it raises `AdapterError` for a failed read."""
        os.makedirs(self._dir, exist_ok=True)  # a temp-dir cleaner may have removed it
        path = os.path.join(self._dir, f"{next(self._names)}.bin")
        # Pickled here, on the caller's thread: a reader thread pickling it would hold the GIL
        # for a millisecond or more, and the step loop would wait for it.  The layout and the model
        # are shared by many adapters: each is pickled once.
        request = _frame((info, self._pickled(layout), self._pickled(model), page_elems,
                          str(dtype).removeprefix("torch."), path))
        return self._threads.submit(self._run, request, path)

    def _pickled(self, obj) -> bytes:
        """``obj`` pickled, from a small cache by identity (the entry keeps ``obj`` alive, so its id
        names it alone)."""
        hit = self._pickles.get(id(obj))
        if hit is None:
            if len(self._pickles) >= PICKLE_CACHE:
                self._pickles.clear()
            hit = self._pickles[id(obj)] = (obj, _frame(obj))
        return hit[1]

    def _take(self) -> _Worker:
        if self._closed.is_set():
            raise AdapterError("the adapter reader pool is shut down")
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            with self._lock:
                if self._closed.is_set():
                    raise AdapterError("the adapter reader pool is shut down") from None
                if len(self._all) < self.max_workers:
                    self._all.append(_Worker())
                    return self._all[-1]
            return self._idle.get()

    def _run(self, request: bytes, path: str) -> tuple[torch.Tensor, float]:
        return self._call(self._take(), request, path)

    def _call(self, worker: _Worker, request: bytes, path: str) -> tuple[torch.Tensor, float]:
        try:
            return worker.call(request, path)
        except (EOFError, OSError, ValueError) as err:  # the process died or its pipe was closed (shutdown):
            # replace it unless shut down, fail this read
            worker.close()
            with self._lock:
                if not self._closed.is_set():
                    self._all[self._all.index(worker)] = worker = _Worker()
            raise AdapterError(f"the adapter reader process failed: {err}") from err
        finally:
            self._idle.put(worker)

    def shutdown(self) -> None:
        self._finalizer()


def _close(lock: threading.Lock, closed: threading.Event, workers: list[_Worker], threads: ThreadPoolExecutor,
           directory: str) -> None:
    with lock:  # a read that fails from here on starts no replacement
        closed.set()
        current = list(workers)
    threads.shutdown(wait=False, cancel_futures=True)
    for worker in current:
        worker.close()
    shutil.rmtree(directory, ignore_errors=True)


@functools.lru_cache(maxsize=PICKLE_CACHE)
def _unpickled(data: bytes):
    """A layout or model the parent pickled once (`ReaderPool._pickled`), unpickled once here."""
    return pickle.loads(data)


def main() -> None:
    """Serve read requests from stdin until it closes (the parent's exit closes it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is the parent's to handle
    requests, replies = sys.stdin.buffer, os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints go to stderr, not into a frame
    torch.set_num_threads(1)
    while True:
        try:
            info, layout, model, page_elems, dtype_name, path = _receive(requests)
            layout, model = _unpickled(layout), _unpickled(model)
        except EOFError:
            return
        start = time.perf_counter()
        try:
            buf = read_and_pack(info, layout, model, page_elems, getattr(torch, dtype_name)).contiguous()
            buf.view(-1).view(torch.uint8).numpy().tofile(path)
            reply = ("ok", tuple(buf.shape), dtype_name, time.perf_counter() - start)
        except Exception as err:  # noqa: BLE001 - any failure is this load's, reported; the worker lives on
            reply = ("error", type(err).__name__, str(err))
        _send(replies, _frame(reply))


if __name__ == "__main__":
    main()
