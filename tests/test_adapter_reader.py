"""Adapter reads in helper processes (`unipage.adapter_reader`, used on CUDA): the same packed
buffer as packing in-process (through a file or straight into a shared ring), failures reported as
`AdapterError`, and a dead worker replaced."""

import dataclasses
import os
import shutil
import signal
import time

import pytest
import torch
from test_storage import setup

from unipage.adapter_reader import ReaderPool, SharedTarget, read_and_pack
from unipage.errors import AdapterError
from unipage.pinned import PinnedRing


@pytest.fixture
def pool():
    readers = ReaderPool(2)
    yield readers
    readers.shutdown()


def _args(memory, name, dtype):
    record = memory.adapters.get(name)
    return record.info, record.layout, memory.config.model, memory.config.page_elems, dtype


def _done(readers, read, timeout=120):
    return readers.wait(read, timeout).result()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_worker_packs_what_the_process_packs(tmp_path, pool, dtype):
    memory, _ = setup(tmp_path)
    reads = {name: pool.submit(*_args(memory, name, dtype)) for name in ("a0", "a1")}  # both formats at once
    for name, read in reads.items():
        buf, seconds = _done(pool, read)
        want = read_and_pack(*_args(memory, name, dtype))
        assert buf.dtype == dtype and torch.equal(buf, want) and seconds > 0


def _target(ring, nbytes):
    piece = ring.reserve(nbytes)
    return SharedTarget(ring.path, piece.start, ring.view(piece))


def test_a_worker_packs_straight_into_a_shared_ring(tmp_path, pool):
    """With a target the buffer is a view of the ring's slice, written by the worker."""
    memory, _ = setup(tmp_path)
    ring = PinnedRing(1 << 20, pin=False, shared=True)
    wants = {name: read_and_pack(*_args(memory, name, torch.bfloat16)) for name in ("a0", "a1")}
    reads = {name: pool.submit(*_args(memory, name, torch.bfloat16), _target(ring, want.numel() * 2))
             for name, want in wants.items()}
    for name, read in reads.items():
        buf, _ = _done(pool, read)
        assert torch.equal(buf, wants[name]) and buf.shape == wants[name].shape
        assert buf.data_ptr() == read.target.view.data_ptr()
    assert os.listdir(pool._dir) == []  # nothing went through a file


def test_a_target_of_the_wrong_size_fails_the_read_and_the_worker_lives_on(tmp_path, pool):
    memory, _ = setup(tmp_path)
    ring = PinnedRing(1 << 20, pin=False, shared=True)
    with pytest.raises(AdapterError, match="reserved for it"):
        _done(pool, pool.submit(*_args(memory, "a0", torch.float32), _target(ring, 4096)))
    buf, _ = _done(pool, pool.submit(*_args(memory, "a0", torch.float32)))
    assert torch.equal(buf, read_and_pack(*_args(memory, "a0", torch.float32)))


def test_a_failed_read_is_an_adapter_error_and_the_worker_lives_on(tmp_path, pool):
    memory, _ = setup(tmp_path)
    weights = tmp_path / "a0" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)  # same size, other content
    with pytest.raises(AdapterError, match="changed since they were inspected"):
        _done(pool, pool.submit(*_args(memory, "a0", torch.float32)))
    buf, _ = _done(pool, pool.submit(*_args(memory, "a1", torch.float32)))
    assert torch.equal(buf, read_and_pack(*_args(memory, "a1", torch.float32)))


def _kill_first(readers: ReaderPool):
    """Kill the pool's first worker while it is idle; that worker."""
    first = readers.workers[0]
    first.proc.kill()
    first.proc.wait()
    return first


def test_a_worker_dead_while_idle_is_replaced_and_the_read_goes_to_the_new_one(tmp_path):
    """The broken pipe of a worker that died idle is not the next read's failure: it is sent again."""
    memory, _ = setup(tmp_path)
    readers = ReaderPool(1)
    try:
        first = _kill_first(readers)
        buf, _ = _done(readers, readers.submit(*_args(memory, "a0", torch.float32)))
        assert torch.equal(buf, read_and_pack(*_args(memory, "a0", torch.float32)))
        assert readers.workers[0] is not first and len(readers.workers) == 1
    finally:
        readers.shutdown()


def test_a_worker_dying_mid_read_fails_that_read_alone(tmp_path):
    """The read the worker was working on fails; the one queued behind it goes to the new worker."""
    memory, _ = setup(tmp_path)
    readers = ReaderPool(1)
    try:
        reads = [readers.submit(*_args(memory, name, torch.float32)) for name in ("a0", "a1")]
        readers.workers[0].proc.kill()
        for read in reads:
            readers.wait(read, 120)
        failed = [read for read in reads if read.error is not None]
        assert len(failed) == 1 and "reader process failed" in str(failed[0].error)
        if failed[0] is reads[0]:
            assert torch.equal(reads[1].result()[0], read_and_pack(*_args(memory, "a1", torch.float32)))
        assert readers.in_flight == 0
    finally:
        readers.shutdown()


def test_a_read_without_a_reply_past_the_timeout_fails_and_its_worker_is_replaced(tmp_path):
    """A read that never ends (its weights file a FIFO no one writes: a hung mount) fails once the pool's
    timeout has passed, its worker is killed and replaced, and the read queued behind it is served."""
    memory, _ = setup(tmp_path)
    hung = tmp_path / "hung"
    shutil.copytree(memory.adapters.get("a0").info.path, hung)
    os.remove(hung / "adapter_model.safetensors")
    os.mkfifo(hung / "adapter_model.safetensors")
    info, *rest = _args(memory, "a0", torch.float32)
    readers = ReaderPool(1, timeout=5.0)  # (the new worker's start-up counts against the read behind)
    try:
        first = readers.workers[0].proc
        stuck = readers.submit(dataclasses.replace(info, path=str(hung)), *rest)
        behind = readers.submit(*_args(memory, "a1", torch.float32))
        for read in (stuck, behind):
            readers.wait(read, 120)
        assert isinstance(stuck.error, AdapterError) and "no reply in 5 s" in str(stuck.error)
        assert torch.equal(behind.result()[0], read_and_pack(*_args(memory, "a1", torch.float32)))
        assert first.poll() is not None and readers.workers[0].proc is not first and readers.in_flight == 0
    finally:
        readers.shutdown()
    with pytest.raises(ValueError, match="timeout"):
        ReaderPool(1, timeout=0)


def test_a_reply_left_by_a_dead_worker_counts(tmp_path):
    """A reply a worker wrote before it died is taken, not failed; a read sent to it after its death (a
    broken pipe) goes to the new worker."""
    memory, _ = setup(tmp_path)
    readers = ReaderPool(1)
    try:
        first = readers.submit(*_args(memory, "a0", torch.float32))
        worker = readers.workers[0]
        deadline = time.monotonic() + 120
        while _bytes_waiting(worker.out) < 8 and time.monotonic() < deadline:  # the reply's head
            time.sleep(0.05)
        time.sleep(0.5)  # the rest of it
        worker.proc.kill()
        worker.proc.wait()
        late = readers.submit(*_args(memory, "a1", torch.float32))
        assert readers.workers[0] is not worker and first.done() and first.error is None
        for read, name in ((first, "a0"), (late, "a1")):
            buf, _ = _done(readers, read)
            assert torch.equal(buf, read_and_pack(*_args(memory, name, torch.float32)))
    finally:
        readers.shutdown()


def _bytes_waiting(fd):
    import fcntl
    import struct
    import termios

    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


def test_reads_spread_over_the_workers_and_queue_in_order(tmp_path):
    """A read goes to an idle worker (started if under the limit), else queues behind the least busy one."""
    memory, _ = setup(tmp_path)
    readers = ReaderPool(2)
    try:
        reads = [readers.submit(*_args(memory, name, torch.float32)) for name in ("a0", "a1", "a0")]
        assert len(readers.workers) == 2 and readers.in_flight == 3
        for read in reads:
            readers.wait(read, 120)
        want = read_and_pack(*_args(memory, "a0", torch.float32))
        assert torch.equal(reads[0].result()[0], want) and torch.equal(reads[2].result()[0], want)
        assert readers.poll() == [] and readers.in_flight == 0
    finally:
        readers.shutdown()


def test_buffers_come_back_through_files_that_are_removed(tmp_path):
    """Without a target each packed buffer passes through one file of the pool's directory: gone once read,
    and the directory is gone after shutdown."""
    memory, _ = setup(tmp_path)
    readers = ReaderPool(2)
    directory = readers._dir
    try:
        reads = [readers.submit(*_args(memory, name, torch.bfloat16)) for name in ("a0", "a1", "a0")]
        for read in reads:
            _done(readers, read)
        assert os.listdir(directory) == []
    finally:
        readers.shutdown()
    assert not os.path.exists(directory)


def test_a_removed_directory_is_made_again(tmp_path):
    """A temporary-file cleaner may remove the pool's directory while the server idles."""
    memory, _ = setup(tmp_path)
    readers = ReaderPool(1)
    try:
        os.rmdir(readers._dir)
        buf, _ = _done(readers, readers.submit(*_args(memory, "a1", torch.float32)))
        assert torch.equal(buf, read_and_pack(*_args(memory, "a1", torch.float32)))
    finally:
        readers.shutdown()


def test_after_shutdown_reads_fail_and_no_reader_is_started_again(tmp_path):
    """A read in flight at the shutdown fails, and so does a read submitted after it, at once."""
    memory, _ = setup(tmp_path)
    readers = ReaderPool(1)
    worker = readers.workers[0]
    read = readers.submit(*_args(memory, "a0", torch.float32))
    readers.shutdown()
    assert worker.proc.poll() is not None
    with pytest.raises(AdapterError, match="shut down"):
        read.result()
    late = readers.submit(*_args(memory, "a1", torch.float32))
    with pytest.raises(AdapterError, match="shut down"):
        late.result()
    assert readers.workers == [worker] and readers.poll() == [] and readers.in_flight == 0


def test_shutdown_with_a_request_half_written_fails_it_and_poll_still_works(tmp_path):
    memory, _ = setup(tmp_path)
    readers = ReaderPool(1)
    os.kill(readers.workers[0].proc.pid, signal.SIGSTOP)
    _, layout, model, page_elems, dtype = _args(memory, "a0", torch.float32)
    read = readers.submit(BIG, layout, model, page_elems, dtype)
    assert readers.workers[0].outgoing  # more than the pipe holds
    readers.shutdown()
    assert readers.poll() == [] and readers.in_flight == 0
    with pytest.raises(AdapterError, match="shut down"):
        read.result()


def test_a_read_in_flight_is_not_a_result():
    from unipage.adapter_reader import Read

    with pytest.raises(RuntimeError, match="in flight"):
        Read(None, None).result()


def test_request_parts_pickle_whole(tmp_path):
    """The slots dataclasses of a read request pickle field by field (`__reduce__`): every field comes back,
    and the layout and model shared by adapters are pickled once per pool."""
    import dataclasses
    import pickle

    from unipage.adapter_info import LoraModule
    from unipage.lora_layout import TargetSpec

    for obj in (LoraModule("m.layers.1.mlp.experts.gate_up_proj", 1, "experts.gate_up", 3, 1, 8, 0.5, True),
                TargetSpec("experts.gate_up", (8, 8), True)):
        assert len(obj.__reduce__()[1]) == len(dataclasses.fields(obj))
        assert pickle.loads(pickle.dumps(obj)) == obj
    memory, _ = setup(tmp_path)
    readers = ReaderPool(1)
    try:
        _, layout, model, _, _ = _args(memory, "a0", torch.float32)
        assert readers._pickled(layout) is readers._pickled(layout)
        assert pickle.loads(readers._pickled(layout)) == layout and pickle.loads(readers._pickled(model)) == model
    finally:
        readers.shutdown()


def test_workers_import_this_process_package_not_the_working_directory(tmp_path, monkeypatch):
    """A ``unipage`` folder in the working directory does not stand in for the package in the workers."""
    memory, _ = setup(tmp_path / "adapters")
    fake = tmp_path / "cwd" / "unipage"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise SystemExit("the wrong unipage was imported")\n')
    monkeypatch.chdir(fake.parent)
    readers = ReaderPool(1)
    try:
        buf, _ = _done(readers, readers.submit(*_args(memory, "a0", torch.float32)))
        assert torch.equal(buf, read_and_pack(*_args(memory, "a0", torch.float32)))
    finally:
        readers.shutdown()


def test_pipes_numbered_past_1024_are_polled(tmp_path):
    """A server with many sockets: the workers' pipes get fds above 1024, past what ``select`` takes."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the fd limit ({hard}) is too low to number pipes past 1024")
    if soft != resource.RLIM_INFINITY and soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1200, hard))
    memory, _ = setup(tmp_path)
    held = []
    try:
        while not held or held[-1] < 1040:
            held.append(os.dup(0))
        readers = ReaderPool(2)
        try:
            reads = [readers.submit(*_args(memory, name, torch.float32)) for name in ("a0", "a1")]
            assert min(w.out for w in readers.workers) > 1024
            for read, name in zip(reads, ("a0", "a1")):
                buf, _ = _done(readers, read)
                assert torch.equal(buf, read_and_pack(*_args(memory, name, torch.float32)))
        finally:
            readers.shutdown()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


BIG = "x" * 300_000  # a request larger than a pipe holds (an MoE adapter's is ~206 KB); its read fails


def _big(readers, memory):
    _, layout, model, page_elems, dtype = _args(memory, "a0", torch.float32)
    return readers.submit(BIG, layout, model, page_elems, dtype)


def test_submit_does_not_wait_for_a_busy_worker(tmp_path):
    """Large requests to a worker that reads nothing (stopped) are queued: submit returns at once, and
    every read completes or fails exactly once when the worker goes on."""
    memory, _ = setup(tmp_path)
    readers = ReaderPool(1)
    worker = readers.workers[0]
    try:
        os.kill(worker.proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        reads = [_big(readers, memory) if i % 2 else readers.submit(*_args(memory, "a1", torch.float32))
                 for i in range(10)]
        assert time.monotonic() - start < 2.0 and readers.in_flight == 10
        os.kill(worker.proc.pid, signal.SIGCONT)
        seen = _poll_all(readers, reads)
        assert sorted(map(id, seen)) == sorted(map(id, reads))  # each once
        want = read_and_pack(*_args(memory, "a1", torch.float32))
        for i, read in enumerate(reads):
            if i % 2:
                assert read.error is not None and "reader process" not in str(read.error)
            else:
                assert torch.equal(read.result()[0], want)
        assert readers.workers == [worker]
    finally:
        os.kill(worker.proc.pid, signal.SIGCONT)
        readers.shutdown()


def _poll_all(readers, reads, seconds=120):
    seen, deadline = [], time.monotonic() + seconds
    while not all(read.done() for read in reads) and time.monotonic() < deadline:
        seen += readers.poll()
        time.sleep(0.01)
    return seen + readers.poll()


def test_many_more_reads_than_workers_complete_once_each(tmp_path):
    """Large and ordinary requests, many per worker: all spread over the workers, each reported once."""
    memory, _ = setup(tmp_path)
    readers = ReaderPool(3)
    try:
        reads = [_big(readers, memory) if i % 3 == 0 else readers.submit(*_args(memory, "a0", torch.bfloat16))
                 for i in range(30)]
        assert len(readers.workers) == 3
        assert all(len(w.sent) <= 2 for w in readers.workers)
        seen = _poll_all(readers, reads)
        assert sorted(map(id, seen)) == sorted(map(id, reads)) and readers.in_flight == 0
        want = read_and_pack(*_args(memory, "a0", torch.bfloat16))
        for i, read in enumerate(reads):
            if i % 3:
                assert torch.equal(read.result()[0], want)
            else:
                assert read.error is not None
    finally:
        readers.shutdown()


def test_shutdown_is_prompt_with_reads_queued(tmp_path):
    """Queued reads are abandoned: the workers are killed, not waited on one after another."""
    memory, _ = setup(tmp_path)
    readers = ReaderPool(2)
    for worker in readers.workers:
        os.kill(worker.proc.pid, signal.SIGSTOP)  # busy forever
    reads = [readers.submit(*_args(memory, "a0", torch.float32)) for _ in range(6)]
    os.kill(readers.workers[1].proc.pid, signal.SIGSTOP)
    start = time.monotonic()
    readers.shutdown()
    assert time.monotonic() - start < 2.0
    assert all(w.proc.poll() is not None for w in readers.workers)
    for read in reads:
        with pytest.raises(AdapterError, match="shut down"):
            read.result()


def test_no_worker_that_can_start_fails_the_reads_and_the_pool_recovers(tmp_path, monkeypatch):
    """A dead worker whose replacement cannot be started: the read fails (not submit), and a later read
    starts a worker again."""
    import subprocess

    from unipage import adapter_reader

    memory, _ = setup(tmp_path)
    readers = ReaderPool(1)
    try:
        _kill_first(readers)

        def no_process(*args, **kwargs):
            raise OSError("no more processes")

        real_popen = subprocess.Popen
        monkeypatch.setattr(adapter_reader.subprocess, "Popen", no_process)
        read = readers.submit(*_args(memory, "a0", torch.float32))
        assert readers.poll() == [read] and readers.workers == [] and readers.in_flight == 0
        with pytest.raises(AdapterError, match="could be started: no more processes"):
            read.result()
        monkeypatch.setattr(adapter_reader.subprocess, "Popen", real_popen)
        buf, _ = _done(readers, readers.submit(*_args(memory, "a0", torch.float32)))
        assert torch.equal(buf, read_and_pack(*_args(memory, "a0", torch.float32)))
    finally:
        readers.shutdown()
