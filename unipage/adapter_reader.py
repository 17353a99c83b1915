"""Adapter files read and packed in helper processes, off the serving process's GIL.

Reading an adapter (hash check, safetensors parse, transposes) and packing it
into its page layout is a few hundred to a few thousand small torch calls.  In
a thread of the serving process each of them competes for the GIL with the
step loop, which holds it almost always: a load that takes milliseconds alone
took hundreds of them while decoding.  `ReaderPool` runs the same work in
``python -m unipage.adapter_reader`` processes instead — plain subprocesses,
so the parent's ``__main__`` is never re-imported.

The parent runs no thread for them: whatever a thread of the serving process
does, it does holding the GIL now and then, and each time the step loop's
next call waits for it (a prefill step's launches slowed by milliseconds while
reads were in flight).  `ReaderPool.submit` queues the request and hands it
to the least busy worker with room (at most `PIPELINE` requests each; a worker
serves its pipe in order), writing only what the non-blocking pipe takes, so
it never waits for a busy worker; `ReaderPool.poll`, called by the step loop,
writes the rest, picks up the replies that are there (``poll``, no waiting)
and hands queued requests to the workers that have room again; a worker
silent on one read past `READ_TIMEOUT_S` is killed and replaced, and that
read fails.  The packed buffer does not come back through
the pipe: the worker writes it straight into a `SharedTarget` — a slice of the
caller's pinned ring, a file in shared memory that the worker maps — so the
step loop copies nothing; or, given no target, into a file of the pool's
temporary directory that ``poll`` reads back.

Protocol, over each worker's stdin/stdout: frames of an 8-byte little-endian
length and a pickle.  A request is ``(info, layout, model, page_elems,
dtype_name, dest)``, the layout and the model each a pickle of its own (the
parent pickles one once for every adapter that shares it), ``dest`` either
``("file", path)`` or ``("shared", path, offset, nbytes, keep)``; a reply is
``("ok", shape, dtype_name, seconds, kept)`` once the bytes are in place
(seconds: the read and pack alone; kept: whether the ``keep`` file, if any,
was written) or ``("error", exception type name, message)``.  The worker
sends stray prints of imported code to stderr, so they never corrupt a frame.
"""

from __future__ import annotations

import functools
import itertools
import mmap
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
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from unipage.errors import AdapterError
from unipage.pinned import remove_file

_LENGTH = struct.Struct("<Q")
PICKLE_CACHE = 64  # layouts and models kept pickled (parent) and unpickled (worker)
PIPELINE = 2  # requests a worker holds at once: the one it works on and the next, already in its pipe
MAX_RESENDS = 3  # dead workers a read may go through unstarted before it fails
# A worker that has not replied this long to the read it works on is taken for stuck (a hung mount, a file
# that never ends) and killed: that read fails, the ones behind it go to the others.  A 640 MiB adapter
# takes about 7 s (eight at once, H200 host); at 32 MiB/s, 20 s.  A read of more than
# READ_TIMEOUT_S x SLOWEST_READ_BYTES_PER_S bytes of files gets longer, at that rate.
READ_TIMEOUT_S = 300.0
SLOWEST_READ_BYTES_PER_S = 8 << 20
KILL_WAIT_S = 0.2  # how long a killed worker is waited for (at most) before it is left to be reaped later


def read_and_pack(info, layout, model, page_elems: int, dtype: torch.dtype) -> torch.Tensor:
    """The adapter's files packed into a host page buffer ``[L, n, P]`` of ``dtype`` (a dense adapter whose
    targets lie alike in every layer a target at a time: `unipage.dense_pack`)."""
    from unipage.adapter_pack import pack_adapter
    from unipage.dense_pack import pack_dense
    from unipage.peft_io import load_adapter_weights

    buf = pack_dense(info, layout, model, page_elems, dtype)
    if buf is not None:
        return buf
    return pack_adapter(layout, load_adapter_weights(info, model), page_elems, dtype)


@dataclass(frozen=True)
class SharedTarget:
    """Where a worker puts a packed buffer: ``nbytes`` at ``offset`` of the shared-memory file ``path``,
    seen in this process as ``view`` (uint8, ``nbytes`` long); and, given ``keep``, into that new file
    too (a host copy that costs this process nothing; kept unless the worker could not write it)."""

    path: str
    offset: int
    view: torch.Tensor
    keep: str | None = None

    @property
    def nbytes(self) -> int:
        return self.view.numel()


class Read:
    """A read submitted to a `ReaderPool`: done once a `poll` has seen its reply."""

    __slots__ = ("buf", "error", "kept", "path", "seconds", "target")

    def __init__(self, target: SharedTarget | None, path: str | None) -> None:
        self.target = target
        self.path = path  # the file the buffer comes back through (no target)
        self.buf: torch.Tensor | None = None
        self.seconds = 0.0
        self.error: AdapterError | None = None
        self.kept: str | None = None  # the target's ``keep`` file, once written

    def done(self) -> bool:
        return self.buf is not None or self.error is not None

    def result(self) -> tuple[torch.Tensor, float]:
        """``(packed buffer [L, n, P], seconds the worker spent)`` (a view of the target, if any); raises
        the read's `AdapterError`."""
        if self.error is not None:
            raise self.error
        if self.buf is None:
            raise RuntimeError("the read is still in flight: poll the pool until it is done")
        return self.buf, self.seconds

    def fail(self, message: str) -> None:
        self.error = AdapterError(message)
        remove_file(self.path)


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


def _read_exact(fd: int, n: int) -> bytes:
    parts, left = [], n
    while left:
        part = os.read(fd, left)
        if not part:
            raise EOFError("the adapter reader process closed its pipe")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


class _Request:
    """A read and its request frame (length and pickle), kept until a reply comes so that a read a dead
    worker never started can go to another; ``resends``: how many dead workers it has been through."""

    __slots__ = ("data", "read", "resends", "seconds")

    def __init__(self, read: Read, data: bytes, seconds: float) -> None:
        self.read = read
        self.data = data
        self.resends = 0
        self.seconds = seconds  # how long a worker may work on it without a reply (`ReaderPool.poll`)


class _Worker:
    """One ``python -m unipage.adapter_reader`` process (with PYTHONSAFEPATH set), its pipes unbuffered,
    its stdin non-blocking: what does not fit in the pipe waits in ``outgoing`` for the next `flush`.
    ``sent``: the requests given to it, oldest first, until their replies come (it serves them in order)."""

    def __init__(self) -> None:
        # Modules as found here; PYTHONSAFEPATH (Python 3.11+, as -P): not the working directory first
        # (``-m`` would put it there), so a ``unipage`` folder in it cannot stand in for this package.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), PYTHONSAFEPATH="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "unipage.adapter_reader"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, bufsize=0)
        self.out = self.proc.stdout.fileno()
        self.stdin = self.proc.stdin.fileno()
        os.set_blocking(self.stdin, False)
        self.sent: deque[_Request] = deque()
        self.outgoing = bytearray()
        self.head_since = 0.0  # monotonic time the oldest request in ``sent`` became the one it works on

    def give(self, request: _Request) -> None:
        """Queue ``request`` to this worker; `flush` writes it."""
        if not self.sent:
            self.head_since = time.monotonic()
        self.sent.append(request)
        self.outgoing += request.data

    def take_head(self) -> _Request:
        """The oldest request, replied to: the next one's clock starts."""
        request = self.sent.popleft()
        self.head_since = time.monotonic()
        return request

    def stuck(self) -> bool:
        """Whether the request it works on went whole into the pipe longer ago than that request may take,
        and no reply is waiting in the pipe."""
        return time.monotonic() - self.head_since > self.sent[0].seconds and self.oldest_written() \
            and not _readable({self.out: self}, 0)

    def flush(self) -> None:
        """Write what the pipe takes now, never waiting (`OSError`, e.g. a broken pipe, if the process died)."""
        while self.outgoing:
            try:
                written = os.write(self.stdin, self.outgoing)
            except BlockingIOError:
                return
            del self.outgoing[:written]

    def oldest_written(self) -> bool:
        """Whether the oldest request in ``sent`` went whole into the pipe."""
        later = sum(len(request.data) for request in itertools.islice(self.sent, 1, None))
        return bool(self.sent) and len(self.outgoing) <= later

    def receive(self):
        """The next reply (blocks until it is whole: call once the pipe is readable)."""
        (length,) = _LENGTH.unpack(_read_exact(self.out, _LENGTH.size))
        return pickle.loads(_read_exact(self.out, length))

    def leftover_replies(self) -> list:
        """The whole replies left in the pipe of a process that has exited."""
        data, replies, at = self.proc.stdout.read(), [], 0
        while at + _LENGTH.size <= len(data):
            (length,) = _LENGTH.unpack_from(data, at)
            if at + _LENGTH.size + length > len(data):
                break
            try:
                replies.append(pickle.loads(data[at + _LENGTH.size:at + _LENGTH.size + length]))
            except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError):
                break
            at += _LENGTH.size + length
        return replies

    def kill(self, wait: float | None = None) -> None:
        """End the process now (its reads are abandoned or given to another) and reap it, waiting at most
        ``wait`` seconds (None: until it has exited; a process in an uninterruptible read exits only when the
        read returns, and is then reaped by `subprocess` later)."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(wait)
        except subprocess.TimeoutExpired:
            pass

    def close(self, wait: float | None = None) -> None:
        self.kill(wait)
        self.proc.stdin.close()
        self.proc.stdout.close()


class ReaderPool:
    """Up to ``workers`` reader processes: one started at once (it imports torch while the engine
    starts), the others when reads overlap.  Submitted reads wait in this process's queue until a worker
    has room (at most `PIPELINE` requests each: the one it works on and the next), so `submit` never
    waits for a busy worker.  Replies are taken by `poll` (or `wait`), on the caller's thread.  A dead
    worker is replaced: its replies still in the pipe count, the read it was working on fails and the
    ones it never started go to the others; so is one that has not replied to the read it works on for
    ``timeout`` seconds (`READ_TIMEOUT_S`; longer for more than ``timeout`` x `SLOWEST_READ_BYTES_PER_S`
    bytes of files: stuck), killed first.  The workers exit when the pool is shut
    down or collected; after that a read fails with `AdapterError`."""

    def __init__(self, workers: int, timeout: float = READ_TIMEOUT_S) -> None:
        if workers < 1:
            raise ValueError(f"a reader pool needs at least 1 worker, got {workers}")
        if not timeout > 0:
            raise ValueError(f"a reader pool's read timeout must be > 0 seconds, got {timeout}")
        self.max_workers, self.timeout = workers, timeout
        self.workers: list[_Worker] = [_Worker()]
        self._closed = False
        self._queue: deque[_Request] = deque()  # submitted, not yet given to a worker
        self._finished: list[Read] = []  # done outside `poll` (failed at submit), for the next poll
        self._dir = tempfile.mkdtemp(prefix="unipage-reads-")  # buffers on their way back without a target
        self._names = itertools.count()
        self._pickles: dict[int, tuple[object, bytes]] = {}  # id -> (object, its pickle): `_pickled`
        self._finalizer = weakref.finalize(self, _close, self.workers, self._dir)

    def submit(self, info, layout, model, page_elems: int, dtype: torch.dtype,
               target: SharedTarget | None = None) -> Read:
        """Start a read: the packed buffer goes to ``target`` (its size must match), else through a file.
        Never waits: the request is queued here if no worker can take it now."""
        if target is None:
            os.makedirs(self._dir, exist_ok=True)  # a temp-dir cleaner may have removed it
            path = os.path.join(self._dir, f"{next(self._names)}.bin")
            read, dest = Read(None, path), ("file", path)
        else:
            read, dest = Read(target, None), ("shared", target.path, target.offset, target.nbytes, target.keep)
        if self._closed:
            read.fail("the adapter reader pool is shut down")
            return read
        # The layout and the model are shared by many adapters: each is pickled once.
        request = _frame((info, self._pickled(layout), self._pickled(model), page_elems,
                          str(dtype).removeprefix("torch."), dest))
        seconds = max(self.timeout, getattr(info, "file_bytes", 0) / SLOWEST_READ_BYTES_PER_S)
        self._queue.append(_Request(read, _LENGTH.pack(len(request)) + request, seconds))
        self._dispatch()
        return read

    def poll(self) -> list[Read]:
        """The reads done (ok or failed) since the last poll; never waits."""
        self._dispatch()
        while True:
            busy = {w.out: w for w in self.workers if w.sent}
            ready = _readable(busy, 0)
            if not ready:
                break
            for fd in ready:
                self._finished.extend(self._take_reply(busy[fd]))
            self._dispatch()
        for worker in [w for w in self.workers if w.sent and w.stuck()]:
            self._finished.extend(self._replace(worker, TimeoutError(
                f"no reply in {worker.sent[0].seconds:g} s to the read it worked on; the process was killed"),
                stuck=True))
        if self._queue:
            self._dispatch()
        finished, self._finished = self._finished, []
        return finished

    def wait(self, read: Read, timeout: float) -> Read:
        """Poll until ``read`` is done (`TimeoutError` after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while not read.done():
            self.poll()
            left = deadline - time.monotonic()
            if read.done():
                break
            if left <= 0:
                raise TimeoutError(f"no reply for a read in {timeout} s")
            _readable({w.out: w for w in self.workers if w.sent}, min(left, 0.05))
        return read

    @property
    def in_flight(self) -> int:
        return len(self._queue) + sum(len(w.sent) for w in self.workers)

    def _dispatch(self) -> None:
        """Give queued requests to workers with room, and write what their pipes take; a worker found
        dead on the way is replaced and its unstarted requests given again."""
        while True:
            while self._queue and not self._closed:
                try:
                    worker = self._least_busy()
                except OSError as err:  # no worker left, and none can be started
                    self._fail_queued(f"no adapter reader process could be started: {err}")
                    break
                if len(worker.sent) >= PIPELINE:
                    break
                worker.give(self._queue.popleft())
            if not self._flush():
                return

    def _flush(self) -> bool:
        """Write pending requests to every worker; whether one was found dead (and replaced)."""
        died = False
        if self._closed:  # the workers are gone, their pipes closed
            return died
        for worker in list(self.workers):
            try:
                worker.flush()
            except OSError as err:
                self._finished.extend(self._replace(worker, err))
                died = True
        return died

    def _least_busy(self) -> _Worker:
        """The worker with the fewest requests, or a new one if that one is busy and there is room
        (`OSError` only if there is no worker and none can be started)."""
        worker = min(self.workers, key=lambda w: len(w.sent), default=None)
        if worker is not None and not worker.sent or len(self.workers) >= self.max_workers:
            return worker
        try:
            started = _Worker()
        except OSError:
            if worker is None:
                raise
            return worker  # the others carry on
        self.workers.append(started)
        return started

    def _fail_queued(self, message: str) -> None:
        for request in self._queue:
            request.read.fail(message)
            self._finished.append(request.read)
        self._queue.clear()

    def _take_reply(self, worker: _Worker) -> list[Read]:
        try:
            reply = worker.receive()
        except (EOFError, OSError, pickle.UnpicklingError) as err:
            return self._replace(worker, err)
        read = worker.take_head().read
        _finish(read, reply)
        return [read]

    def _replace(self, worker: _Worker, err: Exception, stuck: bool = False) -> list[Read]:
        """``worker`` died (or is ``stuck``: killed now, no reply in its pipe): take the replies it left,
        fail the read it was working on, queue the ones it never started again (first, in order), and start
        a new process in its place unless shut down."""
        worker.kill(KILL_WAIT_S if stuck else None)
        done = []
        for reply in [] if stuck else worker.leftover_replies()[:len(worker.sent)]:
            read = worker.sent.popleft().read
            _finish(read, reply)
            done.append(read)
        if worker.oldest_written():
            read = worker.sent.popleft().read
            read.fail(f"the adapter reader process failed: {err}")
            done.append(read)
        for request in reversed(worker.sent):
            request.resends += 1
            if self._closed or request.resends > MAX_RESENDS:
                request.read.fail(f"the adapter reader process failed {request.resends} times: {err}")
                done.append(request.read)
            else:
                self._queue.appendleft(request)
        worker.sent.clear()
        worker.outgoing.clear()
        worker.close(0 if stuck else None)  # (a stuck one was waited for above)
        if not self._closed:
            self.workers.remove(worker)
            try:
                self.workers.append(_Worker())
            except OSError:  # the others carry on; with none, `_dispatch` fails the queued reads
                pass
        return done

    def _pickled(self, obj) -> bytes:
        """``obj`` pickled, from a small cache by identity (the entry keeps ``obj`` alive, so its id
        names it alone)."""
        hit = self._pickles.get(id(obj))
        if hit is None:
            if len(self._pickles) >= PICKLE_CACHE:
                self._pickles.clear()
            hit = self._pickles[id(obj)] = (obj, _frame(obj))
        return hit[1]

    def shutdown(self) -> None:
        """Stop the workers at once (killed: what they were doing is abandoned); reads in flight fail."""
        self._closed = True
        self._finalizer()  # the workers are gone before their reads' targets are given up
        pending = [request.read for request in self._queue]
        self._queue.clear()
        for worker in self.workers:
            pending.extend(request.read for request in worker.sent)
            worker.sent.clear()
            worker.outgoing.clear()
        for read in pending:
            read.fail("the adapter reader pool was shut down with the read in flight")


def _readable(workers: dict[int, _Worker], timeout: float) -> list[int]:
    """The fds of ``workers`` with something to read (a reply, or the end of a dead one's pipe), waiting
    up to ``timeout`` seconds; ``poll``, not ``select``: a server's fds may be numbered past 1024."""
    if not workers:
        return []
    poller = select.poll()
    for fd in workers:
        poller.register(fd, select.POLLIN)
    return [fd for fd, _ in poller.poll(timeout * 1000)]


def _finish(read: Read, reply: tuple) -> None:
    if reply[0] == "error":
        read.fail(f"{reply[1]}: {reply[2]}")
    else:
        _, shape, dtype_name, read.seconds, kept = reply
        read.kept = read.target.keep if kept and read.target is not None else None
        _collect(read, shape, getattr(torch, dtype_name))


def _collect(read: Read, shape: tuple, dtype: torch.dtype) -> None:
    """Give a read whose reply was ok its buffer: a view of its target, or what its file holds."""
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if read.target is not None:
        if nbytes != read.target.nbytes:
            read.fail(f"the packed buffer is {nbytes} bytes, its target {read.target.nbytes}")
            return
        read.buf = read.target.view.view(dtype).view(shape)
        return
    buf = torch.empty(shape, dtype=dtype)
    try:
        with open(read.path, "rb") as f:
            got = f.readinto(buf.view(-1).view(torch.uint8).numpy())
    except OSError as err:
        read.fail(f"reading the packed buffer back from {read.path} failed: {err}")
        return
    if got != nbytes:
        read.fail(f"the adapter reader process wrote a short buffer to {read.path}")
        return
    remove_file(read.path)
    read.buf = buf


def _close(workers: list[_Worker], directory: str) -> None:
    for worker in workers:
        worker.close(KILL_WAIT_S)  # (one stuck in an uninterruptible read does not hold the shutdown up)
    shutil.rmtree(directory, ignore_errors=True)


# -- the worker process ------------------------------------------------------------------
@functools.lru_cache(maxsize=PICKLE_CACHE)
def _unpickled(data: bytes):
    """A layout or model the parent pickled once (`ReaderPool._pickled`), unpickled once here."""
    return pickle.loads(data)


@functools.lru_cache(maxsize=1)
def _mapped(path: str) -> mmap.mmap:
    """A shared-memory file of the parent's, mapped once: its one ring (a ring grown in its place has a new
    file, whose mapping ends the old one's, so the old memory goes)."""
    with open(path, "r+b") as f:
        return mmap.mmap(f.fileno(), 0)


def _put(buf: torch.Tensor, dest: tuple) -> bool:
    """Write the packed buffer where the request says; whether its ``keep`` file was written."""
    data = buf.view(-1).view(torch.uint8).numpy()
    if dest[0] == "file":
        data.tofile(dest[1])
        return False
    _, path, offset, nbytes, keep = dest
    if data.size != nbytes:
        raise AdapterError(f"the packed buffer is {data.size} bytes, {nbytes} were reserved for it")
    np.frombuffer(_mapped(path), dtype=np.uint8, count=nbytes, offset=offset)[:] = data
    if keep is None:
        return False
    try:
        data.tofile(keep)
        return True
    except OSError:  # e.g. shared memory full: the parent keeps its own copy instead
        remove_file(keep)
        return False


def main() -> None:
    """Serve read requests from stdin until it closes (the parent's exit closes it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is the parent's to handle
    requests, replies = sys.stdin.buffer, os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints go to stderr, not into a frame
    torch.set_num_threads(1)
    while True:
        try:
            info, layout, model, page_elems, dtype_name, dest = _receive(requests)
            layout, model = _unpickled(layout), _unpickled(model)
        except EOFError:
            return
        start = time.perf_counter()
        try:
            buf = read_and_pack(info, layout, model, page_elems, getattr(torch, dtype_name)).contiguous()
            kept = _put(buf, dest)
            reply = ("ok", tuple(buf.shape), dtype_name, time.perf_counter() - start, kept)
        except Exception as err:  # noqa: BLE001 - any failure is this load's, reported; the worker lives on
            reply = ("error", type(err).__name__, str(err))
        _send(replies, _frame(reply))


if __name__ == "__main__":
    main()
