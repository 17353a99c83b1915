"""Adapter reads in helper processes (`unipage.adapter_reader`, used on CUDA): the same packed
buffer as packing in-process (through a file or straight into a shared ring), failures reported as
`AdapterError`, and a dead worker replaced."""

import os

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


def test_a_dead_worker_fails_its_reads_and_is_replaced(tmp_path):
    memory, _ = setup(tmp_path)
    readers = ReaderPool(1)
    try:
        first = readers.workers[0]
        first.proc.kill()
        first.proc.wait()
        with pytest.raises(AdapterError, match="reader process failed"):
            _done(readers, readers.submit(*_args(memory, "a0", torch.float32)))
        assert readers.workers[0] is not first and len(readers.workers) == 1
        buf, _ = _done(readers, readers.submit(*_args(memory, "a0", torch.float32)))
        assert torch.equal(buf, read_and_pack(*_args(memory, "a0", torch.float32)))
    finally:
        readers.shutdown()


def test_a_worker_dying_mid_read_fails_every_read_sent_to_it(tmp_path):
    memory, _ = setup(tmp_path)
    readers = ReaderPool(1)
    try:
        reads = [readers.submit(*_args(memory, name, torch.float32)) for name in ("a0", "a1")]
        readers.workers[0].proc.kill()
        for read in reads:
            readers.wait(read, 120)
        failed = [read for read in reads if read.error is not None]
        assert failed and all("reader process failed" in str(read.error) for read in failed)
        assert readers.in_flight == 0
    finally:
        readers.shutdown()


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
    assert readers.workers == [worker] and readers.poll() == []


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
