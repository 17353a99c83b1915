"""Adapter files read and packed in helper processes, off the serving process's GIL.

Reading an adapter (hash check, safetensors parse, transposes) and packing it
into its page layout is a few hundred to a few thousand small torch calls.  In
a thread of the serving process each of them competes for the GIL with the
step loop, which holds it almost always: a load that takes milliseconds alone
took hundreds of them while decoding.  `ReaderPool` runs the same work in
``python -m unipage.adapter_reader`` processes instead — plain subprocesses,
so the parent's ``__main__`` is never re-imported — and hands back the packed
host buffer ``[L, n, P]`` (unpinned: the caller stages it through its pinned ring).

The parent has no threads for this: reader threads, waking for every reply and
every 64 KiB piece of a buffer, took the GIL from the step loop while loads were
in flight.  `ReaderPool.poll`, called by the storage each step, checks the
workers' pipes without blocking; the buffer itself comes back through a file in
the pool's temporary directory, read with one ``readinto``.

Protocol, over each worker's stdin/stdout: frames of an 8-byte little-endian
length and a pickle.  A request is ``(info, layout, model, page_elems,
dtype_name, path)``; a reply is ``("ok", shape, dtype_name, seconds)`` with the
raw bytes written to ``path`` (seconds: the read and pack alone) or ``("error",
exception type name, message)``.  The worker sends stray prints of imported code
to stderr, so they never corrupt a frame.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import pickle
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import weakref
from concurrent.futures import Future

import torch

from unipage.errors import AdapterError

_LENGTH = struct.Struct("<Q")


def read_and_pack(info, layout, model, page_elems: int, dtype: torch.dtype) -> torch.Tensor:
    """The adapter's files packed into a host page buffer ``[L, n, P]`` of ``dtype``."""
    from unipage.adapter_pack import pack_adapter
    from unipage.peft_io import load_adapter_weights

    return pack_adapter(layout, load_adapter_weights(info, model), page_elems, dtype)


def _send(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
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
    """One ``python -m unipage.adapter_reader`` process and the read it is doing, if any."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # modules as found here
        self.proc = subprocess.Popen([sys.executable, "-m", "unipage.adapter_reader"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self.job: tuple[Future, str] | None = None  # (future, path) of the read in flight

    def send(self, request, future: Future) -> None:
        self.job = (future, request[-1])
        _send(self.proc.stdin, request)

    def finish(self) -> None:
        """Take the reply of the read in flight (its frame has arrived) and complete its future."""
        future, path = self.job
        self.job = None
        try:
            reply = _receive(self.proc.stdout)
            if reply[0] == "error":
                future.set_exception(AdapterError(f"{reply[1]}: {reply[2]}"))
                return
            _, shape, dtype_name, seconds = reply
            buf = torch.empty(shape, dtype=getattr(torch, dtype_name))
            with open(path, "rb") as f:
                if f.readinto(buf.view(-1).view(torch.uint8).numpy()) != buf.numel() * buf.element_size():
                    raise EOFError(f"the adapter reader process wrote a short buffer to {path}")
            future.set_result((buf, seconds))
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
    starts), the others when reads overlap.  No threads: `poll` (which the storage calls every
    step) takes the replies that have arrived and hands waiting reads to idle workers, without
    blocking.  The processes exit when the pool is shut down or collected."""

    def __init__(self, workers: int) -> None:
        self.max_workers = workers
        self._workers: list[_Worker] = [_Worker()]
        self._waiting: collections.deque[tuple[tuple, Future]] = collections.deque()
        self._dir = tempfile.mkdtemp(prefix="unipage-reads-")  # the packed buffers on their way back
        self._names = itertools.count()
        self._finalizer = weakref.finalize(self, _close, self._workers, self._waiting, self._dir)

    def submit(self, info, layout, model, page_elems: int, dtype: torch.dtype) -> Future:
        """A future of ``(packed buffer, seconds the worker spent)``, completed by a later `poll`;
        it raises `AdapterError` for a failed read."""
        path = os.path.join(self._dir, f"{next(self._names)}.bin")
        future: Future = Future()
        self._waiting.append(((info, layout, model, page_elems, str(dtype).removeprefix("torch."), path), future))
        self._dispatch()
        return future

    def poll(self) -> None:
        """Complete the futures of the reads whose worker has replied; start waiting reads."""
        busy = [w for w in self._workers if w.job is not None]
        if busy:
            ready, _, _ = select.select([w.proc.stdout for w in busy], [], [], 0)
            for worker in busy:
                if worker.proc.stdout in ready:
                    self._finish(worker)
        self._dispatch()

    def wait(self, future: Future, timeout: float) -> tuple[torch.Tensor, float]:
        """Poll until ``future`` is done (at most ``timeout`` seconds); its result."""
        deadline = time.monotonic() + timeout
        while not future.done() and time.monotonic() < deadline:
            busy = [w.proc.stdout for w in self._workers if w.job is not None]
            select.select(busy, [], [], min(0.05, max(0.0, deadline - time.monotonic())))
            self.poll()
        return future.result(timeout=0)

    def _finish(self, worker: _Worker) -> None:
        future = worker.job[0]
        try:
            worker.finish()
        except (EOFError, OSError) as err:  # the process died: replace it, fail this read
            future.set_exception(AdapterError(f"the adapter reader process failed: {err}"))
            self._replace(worker)

    def _dispatch(self) -> None:
        while self._waiting:
            worker = next((w for w in self._workers if w.job is None), None)
            if worker is None:
                if len(self._workers) >= self.max_workers:
                    return
                worker = _Worker()
                self._workers.append(worker)
            request, future = self._waiting.popleft()
            try:
                worker.send(request, future)
            except OSError as err:  # the process died: replace it, fail this read
                worker.job = None
                future.set_exception(AdapterError(f"the adapter reader process failed: {err}"))
                self._replace(worker)

    def _replace(self, worker: _Worker) -> None:
        worker.close()
        self._workers[self._workers.index(worker)] = _Worker()

    def shutdown(self) -> None:
        self._finalizer()


def _close(workers: list[_Worker], waiting: collections.deque, directory: str) -> None:
    for worker in workers:
        if worker.job is not None:
            worker.job[0].cancel()
        worker.close()
    for _, future in waiting:
        future.cancel()
    shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    """Serve read requests from stdin until it closes (the parent's exit closes it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is the parent's to handle
    requests, replies = sys.stdin.buffer, os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints go to stderr, not into a frame
    torch.set_num_threads(1)
    while True:
        try:
            info, layout, model, page_elems, dtype_name, path = _receive(requests)
        except EOFError:
            return
        start = time.perf_counter()
        try:
            buf = read_and_pack(info, layout, model, page_elems, getattr(torch, dtype_name)).contiguous()
            buf.view(-1).view(torch.uint8).numpy().tofile(path)
            reply = ("ok", tuple(buf.shape), dtype_name, time.perf_counter() - start)
        except Exception as err:  # noqa: BLE001 - any failure is this load's, reported; the worker lives on
            reply = ("error", type(err).__name__, str(err))
        _send(replies, reply)


if __name__ == "__main__":
    main()
