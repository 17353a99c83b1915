"""PoolStorage: loads the pinned ring has no room for wait for room, in order, off the step loop (CPU, with
reader processes and a shared ring, as on CUDA)."""

import dataclasses
import os
import time

import pytest

from test_storage import _kept_then_evicted, _poll_reads, assert_resident_equals_files, shared_reads, sync_load
from unipage.adapters import DropHostCopy, EvictAdapter
from unipage.host_copies import HostRead
from unipage.peft_write import write_random_adapter
from unipage.pinned import ALIGN, PinnedRing


def _reload_with_the_ring_full(memory, storage, names, reload):
    """``names`` kept in files, then evicted, then those of ``reload`` loaded again while a slice holds the
    whole ring; that slice."""
    for name in names:
        _kept_then_evicted(memory, storage, name)
    full = storage._ring.reserve(storage._ring.capacity)
    assert full is not None
    for name in reload:
        assert sync_load(memory, storage, name).done == []
    return full


def test_a_reload_with_no_ring_room_waits_for_it_off_the_step_loop(tmp_path):
    """A host copy the ring has no room for now is not staged and pinned on the step loop's thread: its load
    waits, oldest first, and a poll starts its read once the ring has room; a load that comes after queues
    behind it even if room came back in between."""
    with shared_reads(tmp_path) as (memory, storage):
        full = _reload_with_the_ring_full(memory, storage, ["a0", "a1"], ["a0"])
        loop = (storage.loop.read, storage.loop.finish)
        assert list(storage._waiting) == ["a0"] and "a0" not in storage._reads
        assert storage.poll().done == [] and list(storage._waiting) == ["a0"]
        storage._ring.release(full)
        assert sync_load(memory, storage, "a1").done == []
        assert list(storage._waiting) == ["a0", "a1"]  # behind a0, though the ring has room now
        assert (storage.loop.read, storage.loop.finish) == loop  # nothing read or staged in the loads
        storage.poll()  # starts both (and may finish them: the threads copy little)
        assert storage._waiting == {}
        assert all(n not in storage._reads or isinstance(storage._reads[n][0], HostRead) for n in ("a0", "a1"))
        assert _poll_reads(storage) == []
        for name in ("a0", "a1"):
            memory.adapters.load_done(name)
            assert_resident_equals_files(memory, storage, name)
        assert storage.reads.count == 2  # each read from its files once, at the first load
        assert memory.adapters.stats.loads_from_host == 2


def test_a_read_with_no_ring_room_waits_for_it_instead_of_going_through_a_file(tmp_path):
    """A read of an adapter's files that the ring could hold, but has no room for now, waits for room (queued
    once by `start_reads` and `apply`) rather than coming back through a file to be staged on the step loop's
    thread; then it packs into a slice, and the reader keeps the host copy in a file."""
    with shared_reads(tmp_path) as (memory, storage):
        full = storage._ring.reserve(storage._ring.capacity)
        memory.adapters.request("a0")
        effects = memory.adapters.take_effects()
        storage.start_reads(effects)
        storage.apply(effects)
        assert list(storage._waiting) == ["a0"] and storage._reads == {} and storage._reader.in_flight == 0
        storage._ring.release(full)
        storage.poll()
        assert storage._waiting == {} and storage._reads["a0"][2] is not None  # into a ring slice
        assert _poll_reads(storage) == []
        memory.adapters.load_done("a0")
        assert_resident_equals_files(memory, storage, "a0")
        assert isinstance(storage._host["a0"], str) and storage.reads.count == 1


def _sized_for_one(storage, effects):
    """A shared ring with room for the larger of ``effects``' loads but not for two."""
    sizes = sorted(storage._packed_bytes(e) for e in effects)
    assert sizes[-1] < sizes[0] + sizes[1] - ALIGN
    storage._ring.close()
    storage._ring = PinnedRing(-(-sizes[-1] // ALIGN) * ALIGN, pin=False, shared=True)


def test_loads_wait_in_the_order_they_came(tmp_path):
    """A file read that comes while a reload waits queues behind it, even with room back; and with room for
    one of two waiting loads the older starts; `close` drops the loads still waiting."""
    with shared_reads(tmp_path) as (memory, storage):
        full = _reload_with_the_ring_full(memory, storage, ["a0"], ["a0"])
        storage._ring.release(full)
        memory.adapters.request("a1")
        storage.apply(memory.adapters.take_effects())
        assert list(storage._waiting) == ["a0", "a1"] and storage._reads == {}
    with shared_reads(tmp_path / "one") as (memory, storage):
        for name in ("a1", "a0"):
            memory.adapters.request(name)
        effects = memory.adapters.take_effects()
        _sized_for_one(storage, effects)
        full = storage._ring.reserve(storage._ring.capacity)
        storage.apply(effects)
        storage._ring.release(full)
        storage.poll()
        assert list(storage._waiting) == ["a0"] and list(storage._reads) == ["a1"]
        storage.close()
        assert storage._waiting == {}


def test_a_load_that_waits_too_long_goes_the_step_loops_way(tmp_path, monkeypatch, caplog):
    """With the ring held past `RING_WAIT_S` (a stuck read), a waiting reload is read and staged on this
    thread and a waiting file read comes back through a file, as before the queue: slower, but done."""
    monkeypatch.setattr("unipage.storage.RING_WAIT_S", 0.0)
    with shared_reads(tmp_path) as (memory, storage):
        _reload_with_the_ring_full(memory, storage, ["a0"], ["a0"])  # the ring never comes back
        memory.adapters.request("a1")
        storage.apply(memory.adapters.take_effects())
        assert list(storage._waiting) == ["a0", "a1"]
        with caplog.at_level("WARNING", logger="unipage.storage"):
            storage.poll()
        assert storage._waiting == {} and "a0" not in storage._reads and storage._reads["a1"][2] is None
        assert sum("waited" in r.getMessage() for r in caplog.records) == 2
        assert _poll_reads(storage) == []
        for name in ("a0", "a1"):
            memory.adapters.load_done(name)
            assert_resident_equals_files(memory, storage, name)


def test_a_large_read_holds_the_ring_longer_before_a_load_gives_up(tmp_path, monkeypatch, caplog):
    """While a read in flight fills a slice that would take longer than `RING_WAIT_S` at
    `SLOW_READ_BYTES_PER_S`, a waiting load does not go the step loop's way before that time."""
    monkeypatch.setattr("unipage.storage.RING_WAIT_S", 1.0)
    with shared_reads(tmp_path) as (memory, storage):
        full = _reload_with_the_ring_full(memory, storage, ["a0"], ["a0"])
        reading = type("Reading", (), {"done": lambda self: False})()  # a read still filling `full`
        storage._reads["big"] = (reading, None, full)
        storage._waiting["a0"] = dataclasses.replace(storage._waiting["a0"], since=time.monotonic() - 5)
        storage._ring_moved = time.monotonic() - 5  # the ring has stood still for 5 s
        with caplog.at_level("WARNING", logger="unipage.storage"):
            monkeypatch.setattr("unipage.storage.SLOW_READ_BYTES_PER_S", full.nbytes / 10)  # 10 s to fill
            assert storage._wait_limit() == pytest.approx(10.0)
            storage.poll()
            assert list(storage._waiting) == ["a0"] and not caplog.records
            monkeypatch.setattr("unipage.storage.SLOW_READ_BYTES_PER_S", full.nbytes / 2)  # 2 s: past it
            storage.poll()
        assert storage._waiting == {} and sum("waited" in r.getMessage() for r in caplog.records) == 1
        del storage._reads["big"]
        storage._ring.release(full)
        assert _poll_reads(storage) == []
        memory.adapters.load_done("a0")
        assert_resident_equals_files(memory, storage, "a0")


@pytest.mark.parametrize("full", [False, True])
def test_a_drop_applied_before_a_load_is_of_an_older_copy(tmp_path, full):
    """The engine submits a step's reads before it performs its effects: a drop of the adapter's old host
    copy, applied after its new read was submitted (or queued) but before its load, leaves the new read's
    copy kept."""
    with shared_reads(tmp_path) as (memory, storage):
        _kept_then_evicted(memory, storage, "a0")
        memory.adapters.request("a0")
        (load,) = memory.adapters.take_effects()
        load = dataclasses.replace(load, from_host=False, cache_on_host=True)  # e.g. its copy was stale
        effects = [DropHostCopy("a0"), load]
        ring = storage._ring.reserve(storage._ring.capacity) if full else None
        storage.start_reads(effects)
        assert ("a0" in storage._waiting) == full
        for effect in effects:
            storage.apply([effect])
        if full:
            storage._ring.release(ring)
        assert _poll_reads(storage) == []
        memory.adapters.load_done("a0")
        assert storage.has_host_copy("a0") and storage._unkept == set()


def test_a_waiting_reload_leaves_the_queue_when_evicted_or_its_copy_dropped(tmp_path):
    """Evicted: it is never started, and its host copy stays.  Its host copy dropped: it stays in the queue,
    and once the ring has room its files are read into it, no host copy kept of them."""
    with shared_reads(tmp_path) as (memory, storage):
        full = _reload_with_the_ring_full(memory, storage, ["a0", "a1"], ["a0", "a1"])
        host = storage._host["a0"]
        storage.apply([EvictAdapter("a0", 0, [])])
        storage.apply([DropHostCopy("a1")])
        assert list(storage._waiting) == ["a1"] and storage._waiting["a1"].unkept
        assert not storage.has_host_copy("a1")
        storage._ring.release(full)
        storage.poll()
        read, _, piece = storage._reads["a1"]
        assert not isinstance(read, HostRead) and piece is not None and read in storage._unkept
        assert _poll_reads(storage) == []
        memory.adapters.load_done("a1")
        assert_resident_equals_files(memory, storage, "a1")
        assert storage.reads.count == 3 and not storage.has_host_copy("a1") and storage._unkept == set()
        assert "a0" not in storage._reads and storage._host["a0"] == host and os.path.exists(host)
        assert os.listdir(storage._host_dir) == [os.path.basename(host)]  # the reader kept no file for a1


def test_the_wait_limit_counts_only_time_the_ring_stood_still(tmp_path, monkeypatch, caplog):
    """A load queued behind others waits past `RING_WAIT_S` without going the step loop's way while the ring
    moves: a poll that comes late (the step loop busy) first finishes the reads that completed, and a
    waiting load that starts, or a read that finishes, restarts the clock of those behind it."""
    monkeypatch.setattr("unipage.storage.RING_WAIT_S", 0.5)
    with shared_reads(tmp_path) as (memory, storage):
        model = storage.config.model
        memory.register_adapter("a2", write_random_adapter(tmp_path / "a2", model, rank=8, alpha=16,
                                                           expert_format="fused", seed=2))
        for name in ("a1", "a0", "a2"):
            memory.adapters.request(name)
        effects = memory.adapters.take_effects()
        _sized_for_one(storage, effects[:2])
        assert all(storage._packed_bytes(e) <= storage._ring.capacity for e in effects)
        storage.start_reads(effects)
        storage.apply(effects)
        assert list(storage._reads) == ["a1"] and list(storage._waiting) == ["a0", "a2"]
        deadline = time.monotonic() + 120
        while not storage._reads["a1"][0].done() and time.monotonic() < deadline:
            storage._reader.poll()
            time.sleep(0.01)
        time.sleep(0.6)  # the step loop was away: both waited past the limit, the ring moved meanwhile
        with caplog.at_level("WARNING", logger="unipage.storage"):
            storage.poll()
        assert storage._reads["a0"][2] is not None  # a1 finished first, so a0 took its slice
        assert list(storage._waiting) == ["a2"]  # and a2 waits on: the ring just moved
        assert not any("waited" in r.getMessage() for r in caplog.records)
        monkeypatch.setattr("unipage.storage.RING_WAIT_S", 600.0)  # (a slow machine's reads may take 0.5 s)
        assert _poll_reads(storage) == []
        for name in ("a0", "a1", "a2"):
            memory.adapters.load_done(name)
            assert_resident_equals_files(memory, storage, name)


def test_an_auto_sized_ring_grows_to_hold_two_of_an_adapter_too_large_for_it(tmp_path, caplog):
    """`LoRAConfig.staging_ring_bytes` None: a load of an adapter larger than the ring, while no load uses
    the ring, first replaces it with one that holds two of it (whole MiB) and passes through it; its old
    file goes.  While a slice is held the ring stays (that load is staged on the step loop's thread, warned
    of) and a later load grows it."""
    with shared_reads(tmp_path, ring_bytes=ALIGN, auto=True) as (memory, storage):
        held, first = storage._ring.reserve(ALIGN), storage._ring
        with caplog.at_level("WARNING", logger="unipage.storage"):
            sync_load(memory, storage, "a0")
        assert storage._ring is first and any("staging ring" in r.getMessage() for r in caplog.records)
        assert _poll_reads(storage) == []
        first.release(held)
        sync_load(memory, storage, "a1")
        _, effect, piece = storage._reads["a1"]
        nbytes = storage._packed_bytes(effect)
        assert first.capacity < nbytes and storage._ring is not first and not os.path.exists(first.path)
        assert storage._ring.capacity == -(-2 * nbytes // (1 << 20)) << 20
        assert piece is not None  # the read packs into a slice of the new ring
        assert _poll_reads(storage) == []
        for name in ("a0", "a1"):
            memory.adapters.load_done(name)
            assert_resident_equals_files(memory, storage, name)
