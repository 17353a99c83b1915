"""PoolStorage's reads as on CUDA: reader processes packing into the shared ring, and the host copies
(kept files, host buffers) a reload reads, through evictions, drops and failures in flight."""

import os
import time

import pytest
import torch

from test_storage import (Gate, _kept_in_a_file_then_evicted, _kept_then_evicted, _loaded_through_a_file_then_evicted,
                          _poll_reads, _wait_loads, assert_resident_equals_files, assert_resident_equals_packed, setup,
                          shared_reads, sync_load)
from unipage.adapter_reader import read_and_pack
from unipage.adapters import DropHostCopy, EvictAdapter
from unipage.host_copies import HostRead
from unipage.pinned import ALIGN, PinnedRing


def test_reads_pack_into_the_shared_ring_and_host_copies_are_their_own(tmp_path):
    with shared_reads(tmp_path) as (memory, storage):
        for name in ("a0", "a1"):
            memory.adapters.request(name)
        effects = memory.adapters.take_effects()
        storage.start_reads(effects)
        assert all(piece is not None for _, _, piece in storage._reads.values())  # both went to the ring
        storage.apply(effects)
        assert _poll_reads(storage) == []
        for name in ("a0", "a1"):
            memory.adapters.load_done(name)
            assert_resident_equals_files(memory, storage, name)
            host = storage._host[name]  # the reader kept the host copy in a file of its own
            assert os.path.dirname(host) == storage._host_dir
            record = memory.adapters.get(name)
            packed = read_and_pack(record.info, record.layout, memory.config.model, memory.config.page_elems,
                                   storage.dtype)
            with open(host, "rb") as f:
                assert f.read() == packed.view(-1).view(torch.uint8).numpy().tobytes()
        assert storage._ring.reserve(storage._ring.capacity) is not None  # every slice came back
    assert not os.path.exists(storage._host_dir)


@pytest.mark.parametrize("ring_bytes", [1 << 20, ALIGN])
def test_a_reload_reads_the_kept_host_file_and_a_drop_removes_it(tmp_path, ring_bytes):
    """From the file into a ring slice on a thread, copied in by a poll (or, when the ring has no room, into a
    buffer of its own within the load), the disk copy gone."""
    with shared_reads(tmp_path) as (memory, storage):
        host = _kept_then_evicted(memory, storage, "a1")
        storage.pool.normal_()
        os.remove(tmp_path / "a1" / "adapter_model.safetensors")
        storage._ring = PinnedRing(ring_bytes, pin=False, shared=True)
        done = sync_load(memory, storage, "a1").done
        if ring_bytes == ALIGN:
            assert done == ["a1"] and storage._reads == {}  # read within the load
        else:
            assert done == [] and isinstance(storage._reads["a1"][0], HostRead)
            assert _poll_reads(storage) == []
            memory.adapters.load_done("a1")
        assert storage._host["a1"] == host and storage.reads.count == 1  # nothing read from the files
        assert storage._ring.reserve(storage._ring.capacity) is not None  # its slice came back
        assert memory.adapters.stats.loads_from_host == 1
        assert_resident_equals_packed(memory, storage, "a1", host)
        storage.apply([DropHostCopy("a1")])
        assert not storage.has_host_copy("a1") and not os.path.exists(host)


def test_a_host_read_in_flight_survives_its_eviction_and_a_drop_of_its_copy(tmp_path):
    """Evicted while its file is read: the slice comes back once the read is over and the host copy stays;
    host copy dropped while it is read: the load completes and keeps no copy."""
    with shared_reads(tmp_path) as (memory, storage):
        host = _kept_then_evicted(memory, storage, "a0")
        memory.adapters.request("a0")
        (load,) = memory.adapters.take_effects()
        storage.apply([load])
        read, _, piece = storage._reads["a0"]
        assert isinstance(read, HostRead)
        storage.apply([EvictAdapter("a0", load.slot, load.pages)])
        deadline = time.monotonic() + 60
        while not piece.released and time.monotonic() < deadline:
            storage.poll()
            time.sleep(0.01)
        assert piece.released
        assert storage._host["a0"] == host and os.path.exists(host) and "a0" not in storage._reads
        memory.adapters.load_done("a0")  # (the manager did not see that eviction: let it evict too)
        memory.adapters.evict("a0")
        storage.apply(memory.adapters.take_effects())
        memory.adapters.request("a0")
        storage.apply(memory.adapters.take_effects())
        storage.apply([DropHostCopy("a0")])
        assert not storage.has_host_copy("a0")
        assert _poll_reads(storage) == []
        memory.adapters.load_done("a0")
        assert_resident_equals_files(memory, storage, "a0")
        assert storage.reads.count == 1  # read from the host file still (its files were not read again)
        assert not storage.has_host_copy("a0") and not os.path.exists(host)  # and the file went after
        assert storage._unkept == set()


def test_a_read_dropped_then_evicted_in_flight_is_forgotten_once_over(tmp_path):
    """Its host copy dropped, then the adapter evicted, while its read is in flight: once the read is over its
    slice comes back, the file it would have kept goes, and nothing of it is left in the storage."""
    with shared_reads(tmp_path) as (memory, storage):
        memory.adapters.request("a0")
        (load,) = memory.adapters.take_effects()
        storage.apply([load])
        read, _, piece = storage._reads["a0"]
        storage.apply([DropHostCopy("a0"), EvictAdapter("a0", load.slot, load.pages)])
        deadline = time.monotonic() + 60
        while storage._orphans and time.monotonic() < deadline:
            storage.poll()
            time.sleep(0.01)
        assert piece.released and storage._unkept == set() and storage._orphans == []
        assert not storage.has_host_copy("a0") and (read.kept is None or not os.path.exists(read.kept))


def test_close_waits_for_host_reads_before_the_ring_goes(tmp_path, monkeypatch):
    import threading

    started, go = threading.Event(), threading.Event()
    real = HostRead.run

    def slow(self, *args):  # a read still going when close() is called
        started.set()
        go.wait(60)
        real(self, *args)

    monkeypatch.setattr(HostRead, "run", slow)
    with shared_reads(tmp_path) as (memory, storage):
        _kept_then_evicted(memory, storage, "a0")
        memory.adapters.request("a0")
        storage.apply(memory.adapters.take_effects())
        read = storage._reads["a0"][0]
        assert started.wait(60) and not read.done()
        threading.Timer(0.2, go.set).start()
        storage.close()
        assert read.done() and read.error is None and storage._ring is None


@pytest.mark.parametrize("dropped", [False, True])
def test_an_unreadable_host_file_drops_the_copy_and_reads_the_files(tmp_path, dropped):
    """``dropped``: the host tier dropped the copy while the thread read it: the files read instead keep none."""
    with shared_reads(tmp_path) as (memory, storage):
        host = _kept_then_evicted(memory, storage, "a0")
        with open(host, "r+b") as f:
            f.truncate(100)  # short: the thread's read fails
        storage.pool.normal_()
        sync_load(memory, storage, "a0")
        assert isinstance(storage._reads["a0"][0], HostRead)
        if dropped:
            storage.apply([DropHostCopy("a0")])
        assert _poll_reads(storage) == []  # no load failed: the files were read instead
        memory.adapters.load_done("a0")
        assert_resident_equals_files(memory, storage, "a0")
        assert storage.reads.count == 2 and not os.path.exists(host) and storage._unkept == set()
        assert storage.has_host_copy("a0") != dropped and storage._host.get("a0") != host
        assert storage._ring.reserve(storage._ring.capacity) is not None  # the failed read's slice came back


def test_an_adapter_larger_than_the_ring_is_warned_of_once(tmp_path, caplog):
    with shared_reads(tmp_path, ring_bytes=ALIGN) as (memory, storage):
        with caplog.at_level("WARNING", logger="unipage.storage"):
            host = _kept_then_evicted(memory, storage, "a0")
            sync_load(memory, storage, "a0")
        warned = [r.getMessage() for r in caplog.records if "staging ring" in r.getMessage()]
        assert len(warned) == 1 and "adapter 'a0'" in warned[0] and "staging_ring_bytes" in warned[0]
        assert storage.has_host_copy("a0") and host is not None


def test_a_lost_host_file_falls_back_to_reading_the_files(tmp_path):
    with shared_reads(tmp_path) as (memory, storage):
        memory.adapters.request("a0")
        storage.apply(memory.adapters.take_effects())
        assert _poll_reads(storage) == []
        memory.adapters.load_done("a0")
        os.remove(storage._host["a0"])
        memory.adapters.evict("a0")
        storage.apply(memory.adapters.take_effects())
        storage.pool.normal_()
        sync_load(memory, storage, "a0")
        assert "a0" in storage._reads  # read again from its files
        assert _poll_reads(storage) == []
        memory.adapters.load_done("a0")
        assert_resident_equals_files(memory, storage, "a0")
        assert os.path.exists(storage._host["a0"])  # kept anew


def test_a_read_dropped_by_an_eviction_gives_its_slice_back_once_over(tmp_path):
    from unipage.adapters import EvictAdapter

    with shared_reads(tmp_path) as (memory, storage):
        memory.adapters.request("a0")
        (load,) = memory.adapters.take_effects()
        storage.apply([load])
        read, _, piece = storage._reads["a0"]
        storage.apply([EvictAdapter("a0", load.slot, load.pages)])
        assert storage._reads == {} and storage._orphans == [(read, piece)]
        deadline = time.monotonic() + 120
        while storage._orphans and time.monotonic() < deadline:
            assert storage.poll().done == []
            time.sleep(0.01)
        assert storage._orphans == [] and piece.released and not storage.has_host_copy("a0")


def test_a_failed_read_into_the_ring_is_reported_and_gives_its_slice_back(tmp_path):
    with shared_reads(tmp_path) as (memory, storage):
        weights = tmp_path / "a0" / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)  # same size, other content
        memory.adapters.request("a0")
        memory.adapters.request("a1")
        effects = memory.adapters.take_effects()
        storage.apply(effects)
        pieces = {name: piece for name, (_, _, piece) in storage._reads.items()}
        failed = _poll_reads(storage)
        assert [name for name, _ in failed] == ["a0"] and "changed since" in failed[0][1]
        assert pieces["a0"].released and pieces["a1"].released  # a1's was copied (CPU: at once)
        memory.adapters.load_done("a1")
        assert_resident_equals_files(memory, storage, "a1")


def test_reads_go_through_files_when_the_ring_has_no_room(tmp_path):
    with shared_reads(tmp_path, ring_bytes=ALIGN) as (memory, storage):
        memory.adapters.request("a0")
        storage.apply(memory.adapters.take_effects())
        assert storage._reads["a0"][2] is None
        assert _poll_reads(storage) == []
        memory.adapters.load_done("a0")
        assert_resident_equals_files(memory, storage, "a0")


def test_a_reload_from_a_host_buffer_is_copied_into_the_ring_on_a_thread(tmp_path):
    """A host copy held in this process (its read came back through a file) is reloaded like a kept file: copied
    into a ring slice on a thread and finished by a poll, not staged on the step loop's thread; it stays the
    host copy, and the adapter's files are not read again."""
    with shared_reads(tmp_path) as (memory, storage):
        host = _loaded_through_a_file_then_evicted(memory, storage, "a1")
        storage.pool.normal_()
        finish = storage.loop.finish
        assert sync_load(memory, storage, "a1").done == []
        read = storage._reads["a1"][0]
        assert isinstance(read, HostRead) and read.host_copy is host and read.host_file is None
        assert _poll_reads(storage) == []
        memory.adapters.load_done("a1")
        assert_resident_equals_files(memory, storage, "a1")
        assert storage._host["a1"] is host and storage.reads.count == 1 and storage.loop.finish > finish
        assert memory.adapters.stats.loads_from_host == 1
        assert storage._ring.reserve(storage._ring.capacity) is not None  # its slice came back


def test_a_host_buffer_of_the_wrong_size_is_dropped_and_the_files_read(tmp_path):
    with shared_reads(tmp_path) as (memory, storage):
        _loaded_through_a_file_then_evicted(memory, storage, "a0")
        storage._host["a0"] = storage._host["a0"].view(-1)[:-1].clone()  # a short buffer
        sync_load(memory, storage, "a0")
        assert isinstance(storage._reads["a0"][0], HostRead)
        assert _poll_reads(storage) == []
        memory.adapters.load_done("a0")
        assert_resident_equals_files(memory, storage, "a0")
        assert storage.reads.count == 2  # read from the files again
        assert isinstance(storage._host["a0"], str)  # the new read's kept file


def test_a_host_buffer_dropped_while_it_is_copied_is_not_kept(tmp_path):
    with shared_reads(tmp_path) as (memory, storage):
        _loaded_through_a_file_then_evicted(memory, storage, "a0")
        sync_load(memory, storage, "a0")
        assert isinstance(storage._reads["a0"][0], HostRead)
        storage.apply([DropHostCopy("a0")])
        assert _poll_reads(storage) == []
        memory.adapters.load_done("a0")
        assert_resident_equals_files(memory, storage, "a0")
        assert not storage.has_host_copy("a0")


@pytest.mark.gpu
def test_cuda_reads_pack_into_the_shared_pinned_ring(tmp_path):
    memory, storage = setup(tmp_path, "bfloat16", device="cuda")
    assert storage._ring.path is not None and storage._ring.buf.is_pinned()
    for name in ("a0", "a1"):
        sync_load(memory, storage, name)
    assert all(piece is not None for _, _, piece in storage._reads.values())
    assert _wait_loads(storage, ["a0", "a1"]) == {"a0", "a1"}
    for name in ("a0", "a1"):
        memory.adapters.load_done(name)
        assert_resident_equals_files(memory, storage, name)
    torch.cuda.synchronize()
    assert storage._ring.reserve(storage._ring.capacity) is not None  # every slice came back
    storage.close()


@pytest.mark.gpu
@pytest.mark.parametrize("held,full", [("file", False), ("buffer", False), ("buffer", True)])
def test_cuda_reload_from_a_host_copy_reads_it_on_a_thread(tmp_path, held, full):
    """The host copy of an evicted adapter — a file a reader kept, or a buffer of this process — copied into
    the pinned ring on a thread, then to the device by a poll: the pages hold the adapter again, the copy
    stays the host copy, and the adapter's files were not read again.  ``full``: a copy not yet over holds the
    whole ring, so the load waits until a poll finds it over."""
    memory, storage = setup(tmp_path, "bfloat16", device="cuda")
    evicted = _kept_in_a_file_then_evicted if held == "file" else _loaded_through_a_file_then_evicted
    host = evicted(memory, storage, "a0")
    storage.pool.normal_()
    gate = Gate()
    if full:
        storage._ring.hold_slice(storage._ring.reserve(storage._ring.capacity), gate)
    finish = storage.loop.finish
    sync_load(memory, storage, "a0")
    if full:
        assert list(storage._waiting) == ["a0"] and storage.loop.finish == finish  # nothing staged or pinned
        assert storage.poll().done == [] and list(storage._waiting) == ["a0"]
        gate.over = True
    else:
        assert isinstance(storage._reads["a0"][0], HostRead)
    assert _wait_loads(storage, ["a0"]) == {"a0"}
    memory.adapters.load_done("a0")
    assert_resident_equals_files(memory, storage, "a0")
    assert (storage._host["a0"] == host if held == "file" else storage._host["a0"] is host)
    assert storage.reads.count == 1
    torch.cuda.synchronize()
    assert storage._ring.reserve(storage._ring.capacity) is not None  # every slice came back
    storage.close()


@pytest.mark.parametrize("error", [OSError(11, "Resource temporarily unavailable"), TypeError("cannot pickle")])
def test_a_read_no_reader_can_take_fails_its_load_and_gives_its_slice_back(tmp_path, monkeypatch, error):
    with shared_reads(tmp_path) as (memory, storage):
        def no_process(*args, **kwargs):
            raise error

        monkeypatch.setattr(storage._reader, "submit", no_process)
        memory.adapters.request("a0")
        storage.apply(memory.adapters.take_effects())  # no exception escapes the step
        assert [name for name, _ in _poll_reads(storage)] == ["a0"]
        assert storage._ring.reserve(storage._ring.capacity) is not None  # its slice came back


def test_a_host_copy_dropped_while_its_read_is_in_flight_is_not_kept(tmp_path):
    from unipage.adapters import DropHostCopy

    with shared_reads(tmp_path) as (memory, storage):
        memory.adapters.request("a0")
        (load,) = memory.adapters.take_effects()
        assert load.cache_on_host
        storage.apply([load])
        storage.apply([DropHostCopy("a0")])  # the host tier let it go before the read came back
        assert _poll_reads(storage) == []
        assert not storage.has_host_copy("a0")
        assert storage._host_dir is None or os.listdir(storage._host_dir) == []  # its file went too
    assert storage._ring is None  # closed: the shared ring's file is gone
