"""Adapter reads in helper processes (`unipage.adapter_reader`, used on CUDA): the same packed
buffer as packing in-process, failures reported as `AdapterError`, and a dead worker replaced."""

import os

import pytest
import torch
from test_storage import setup

from unipage.adapter_reader import ReaderPool, read_and_pack
from unipage.errors import AdapterError


@pytest.fixture
def pool():
    readers = ReaderPool(2)
    yield readers
    readers.shutdown()


def _args(memory, name, dtype):
    record = memory.adapters.get(name)
    return record.info, record.layout, memory.config.model, memory.config.page_elems, dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_worker_packs_what_the_process_packs(tmp_path, pool, dtype):
    memory, _ = setup(tmp_path)
    futures = {name: pool.submit(*_args(memory, name, dtype)) for name in ("a0", "a1")}  # both formats at once
    for name, future in futures.items():
        buf, seconds = future.result(timeout=120)
        want = read_and_pack(*_args(memory, name, dtype))
        assert buf.dtype == dtype and torch.equal(buf, want) and seconds > 0


def test_a_failed_read_is_an_adapter_error_and_the_worker_lives_on(tmp_path, pool):
    memory, _ = setup(tmp_path)
    weights = tmp_path / "a0" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)  # same size, other content
    with pytest.raises(AdapterError, match="changed since they were inspected"):
        pool.submit(*_args(memory, "a0", torch.float32)).result(timeout=120)
    buf, _ = pool.submit(*_args(memory, "a1", torch.float32)).result(timeout=120)
    assert torch.equal(buf, read_and_pack(*_args(memory, "a1", torch.float32)))


def test_a_dead_worker_fails_its_read_and_is_replaced(tmp_path):
    memory, _ = setup(tmp_path)
    readers = ReaderPool(1)
    try:
        readers._all[0].proc.kill()
        readers._all[0].proc.wait()
        with pytest.raises(AdapterError, match="reader process failed"):
            readers.submit(*_args(memory, "a0", torch.float32)).result(timeout=120)
        buf, _ = readers.submit(*_args(memory, "a0", torch.float32)).result(timeout=120)
        assert torch.equal(buf, read_and_pack(*_args(memory, "a0", torch.float32)))
    finally:
        readers.shutdown()


def test_buffers_come_back_through_files_that_are_removed(tmp_path):
    """Each packed buffer passes through one file of the pool's directory: gone once read, and the
    directory is gone after shutdown."""
    memory, _ = setup(tmp_path)
    readers = ReaderPool(2)
    directory = readers._dir
    try:
        futures = [readers.submit(*_args(memory, name, torch.bfloat16)) for name in ("a0", "a1", "a0")]
        for future in futures:
            future.result(timeout=120)
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
        buf, _ = readers.submit(*_args(memory, "a1", torch.float32)).result(timeout=120)
        assert torch.equal(buf, read_and_pack(*_args(memory, "a1", torch.float32)))
    finally:
        readers.shutdown()



def test_after_shutdown_reads_fail_and_no_reader_is_started_again(tmp_path):
    """A read caught by the shutdown (its worker closed under it) fails without starting a
    replacement process, and a read after the shutdown fails at once."""
    readers = ReaderPool(1)
    worker = readers._take()  # a read in flight holds the only worker
    readers.shutdown()
    assert worker.proc.poll() is not None
    path = str(tmp_path / "late.bin")
    with pytest.raises(AdapterError, match="reader process failed"):
        readers._call(worker, b"\0" * 8, path)
    assert readers._all == [worker] and worker.proc.poll() is not None
    with pytest.raises(AdapterError, match="shut down"):
        readers._run(b"\0" * 8, path)
    assert readers._all == [worker]


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
        buf, _ = readers.submit(*_args(memory, "a0", torch.float32)).result(timeout=120)
        assert torch.equal(buf, read_and_pack(*_args(memory, "a0", torch.float32)))
    finally:
        readers.shutdown()
