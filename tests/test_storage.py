"""PoolStorage: the manager's effects performed on a real pool tensor, from real PEFT files."""

import contextlib
import os
import time

import pytest
import torch

from unipage.config import LoRAConfig, ModelConfig, PoolConfig, UnipageConfig
from unipage.memory import UnifiedMemory
from unipage.peft_io import load_adapter_weights
from unipage.peft_write import write_random_adapter
from unipage.pinned import ALIGN, PinnedRing
from unipage.storage import RING_START_BYTES, PoolStorage

MODEL = ModelConfig(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32, num_experts=4,
                    top_k=2, expert_intermediate_size=32, dtype="float32")  # page_elems = 4*2*32 = 256


def setup(tmp_path, dtype="float32", device="cpu", pages=200, host_bytes=1 << 30):
    tmp_path.mkdir(parents=True, exist_ok=True)
    model = ModelConfig(**{**MODEL.__dict__, "dtype": dtype})
    config = UnipageConfig(model, PoolConfig(block_tokens=4, num_pages=pages),
                           LoRAConfig(max_rank=16, host_cache_bytes=host_bytes, adapter_roots=(tmp_path,)))
    memory, storage = UnifiedMemory(config), PoolStorage(config, device)
    storage.pool.normal_()  # noise everywhere: a page the load misses shows
    for index, (rank, fmt) in enumerate(((4, "per_expert"), (8, "fused"))):
        path = write_random_adapter(tmp_path / f"a{index}", model, rank=rank, alpha=16, expert_format=fmt,
                                    seed=index)
        memory.register_adapter(f"a{index}", path)
    return memory, storage


def sync_load(memory, storage, name):
    memory.adapters.request(name)
    result = storage.apply(memory.adapters.take_effects())
    for done in result.done:
        memory.adapters.load_done(done)
    return result


def assert_resident_equals_files(memory, storage, name):
    record = memory.adapters.get(name)
    expect = load_adapter_weights(record.info, memory.config.model)
    got = storage.gather(record)
    assert got.keys() == expect.keys()
    for key, mats in expect.items():
        torch.testing.assert_close(got[key].a.float().cpu(), mats.a.to(storage.dtype).float(), rtol=0, atol=0)
        for have, want in zip(got[key].b, mats.b):
            torch.testing.assert_close(have.float().cpu(), want.to(storage.dtype).float(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_into_scattered_pages_and_gather_back(tmp_path, dtype):
    memory, storage = setup(tmp_path, dtype)
    kv = memory.kv
    for seq in range(6):  # interleave KV blocks so the adapter's pages are not contiguous
        kv.open(seq)
        kv.grow(seq, 4 * (seq + 1))
    for seq in (1, 3, 5):
        kv.free(seq)
    assert sync_load(memory, storage, "a0").done == ["a0"]
    pages = memory.adapters.page_table("a0")
    assert pages != sorted(pages) or pages[-1] - pages[0] != len(pages) - 1
    assert_resident_equals_files(memory, storage, "a0")
    assert sync_load(memory, storage, "a1").done == ["a1"]
    assert_resident_equals_files(memory, storage, "a0")
    assert_resident_equals_files(memory, storage, "a1")
    memory.check()


def test_reload_comes_from_the_host_copy(tmp_path):
    memory, storage = setup(tmp_path)
    sync_load(memory, storage, "a1")
    read, finish = storage.loop.read, storage.loop.finish
    assert read > 0 and finish > 0  # the files read and the pages copied on this thread (`LoopTimes`)
    before = storage.gather(memory.adapters.get("a1"))
    memory.adapters.evict("a1")
    storage.apply(memory.adapters.take_effects())
    storage.pool.normal_()
    os.remove(tmp_path / "a1" / "adapter_model.safetensors")  # the disk copy is gone
    assert storage.has_host_copy("a1")
    assert sync_load(memory, storage, "a1").done == ["a1"]
    assert memory.adapters.stats.loads_from_host == 1
    assert storage.loop.read == read and storage.loop.finish > finish  # no file read this time
    after = storage.gather(memory.adapters.get("a1"))
    assert all(torch.equal(after[k].a, before[k].a) and all(map(torch.equal, after[k].b, before[k].b))
               for k in before)


def test_changed_files_fail_the_load_and_return_the_pages(tmp_path):
    memory, storage = setup(tmp_path)
    weights = tmp_path / "a0" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)  # same size, other content
    result = sync_load(memory, storage, "a0")
    assert result.done == [] and result.failed[0][0] == "a0"
    assert "digest" in result.failed[0][1] or "changed" in result.failed[0][1]
    memory.adapters.load_failed("a0")
    assert memory.occupancy()["adapter"] == 0
    memory.check()


def test_host_budget_drops_copies(tmp_path):
    memory, storage = setup(tmp_path, host_bytes=memory_bytes_of_one(tmp_path))
    sync_load(memory, storage, "a0")
    sync_load(memory, storage, "a1")
    assert not storage.has_host_copy("a0")  # DropHostCopy was performed


def memory_bytes_of_one(tmp_path) -> int:
    memory, _ = setup(tmp_path / "probe")
    return max(memory.adapters.get(n).nbytes for n in ("a0", "a1"))


@pytest.mark.gpu
def test_cuda_load_runs_on_a_side_stream(tmp_path):
    memory, storage = setup(tmp_path, "bfloat16", device="cuda")
    result = sync_load(memory, storage, "a0")
    assert result.done == []  # the file is read in the background, then copied on the side stream
    deadline, done = time.monotonic() + 60, []
    while not done and time.monotonic() < deadline:
        poll = storage.poll()
        assert poll.failed == []
        done = poll.done
        time.sleep(0.01)
    assert done == ["a0"] and storage.load_event("a0") is None
    memory.adapters.load_done("a0")
    assert_resident_equals_files(memory, storage, "a0")


def _wait_loads(storage, names, seconds=60):
    deadline, done = time.monotonic() + seconds, set()
    while done != set(names) and time.monotonic() < deadline:
        poll = storage.poll()
        assert poll.failed == []
        done.update(poll.done)
        time.sleep(0.01)
    return done


@pytest.mark.gpu
@pytest.mark.parametrize("ring_bytes", [RING_START_BYTES, ALIGN])
def test_cuda_loads_pass_through_the_pinned_ring(tmp_path, ring_bytes):
    """Both adapters staged in one ring (or, in a ring too small for them, pinned on their own)."""
    memory, storage = setup(tmp_path, "bfloat16", device="cuda")
    storage._ring = PinnedRing(ring_bytes)
    for name in ("a0", "a1"):
        sync_load(memory, storage, name)
    assert _wait_loads(storage, ["a0", "a1"]) == {"a0", "a1"}
    for name in ("a0", "a1"):
        memory.adapters.load_done(name)
        assert_resident_equals_files(memory, storage, name)
    torch.cuda.synchronize()
    assert storage._ring.stage(torch.zeros(ALIGN, dtype=torch.uint8)) is not None  # both slices came back
    assert storage._ring.in_use == 1


@pytest.mark.gpu
def test_cuda_auto_ring_grows_for_an_adapter_too_large_for_it(tmp_path):
    """The default ring (`staging_ring_bytes` None), here started tiny: the first load replaces it with a
    registered shared ring that holds two of the adapter, and both loads pass through it."""
    memory, storage = setup(tmp_path, "bfloat16", device="cuda")
    assert storage._ring_auto and storage.ring_bytes == 256 << 20
    storage._ring.close()
    storage._ring = PinnedRing(ALIGN, shared=True)
    for name in ("a0", "a1"):
        sync_load(memory, storage, name)
    assert _wait_loads(storage, ["a0", "a1"]) == {"a0", "a1"}
    assert ALIGN < storage.ring_bytes <= 4 << 20 and storage._ring.path is not None
    for name in ("a0", "a1"):
        memory.adapters.load_done(name)
        assert_resident_equals_files(memory, storage, name)
    storage.close()


def test_bad_adapter_directories_leave_the_registry_unchanged(tmp_path):
    memory, _ = setup(tmp_path / "ok")
    outside = write_random_adapter(tmp_path / "outside", memory.config.model, rank=4, alpha=4)
    (tmp_path / "ok" / "pickle").mkdir()
    (tmp_path / "ok" / "pickle" / "adapter_config.json").write_text("{}")
    (tmp_path / "ok" / "pickle" / "adapter_model.bin").write_bytes(b"not a pickle")
    for name, path, error in (("x", outside, "outside the adapter roots"),
                              ("y", tmp_path / "ok" / "pickle", "pickle"),
                              ("z", tmp_path / "ok" / "missing", "no adapter directory"),
                              ("a0", tmp_path / "ok" / "a1", "already registered")):
        with pytest.raises(ValueError, match=error):
            memory.register_adapter(name, path)
    assert memory.adapters.names() == ["a0", "a1"]
    memory.check()


def test_reads_started_before_apply_are_not_submitted_twice(tmp_path):
    """`start_reads` submits the file reads of the loads (not of an adapter the same effects evict); `apply`
    then submits only what was not submitted yet."""
    from types import SimpleNamespace

    from unipage.adapters import EvictAdapter

    memory, storage = setup(tmp_path)
    submitted = []
    storage._reader = SimpleNamespace(submit=lambda info, *rest: submitted.append(info.path) or object())
    memory.adapters.request("a0")
    memory.adapters.request("a1")
    a0, a1 = memory.adapters.take_effects()
    evict = EvictAdapter("a1", a1.slot, a1.pages)
    storage.start_reads([a0, evict, a1])
    assert submitted == [a0.info.path]
    storage.apply([a0])
    assert submitted == [a0.info.path]  # already in flight
    storage.apply([a1])
    assert submitted == [a0.info.path, a1.info.path]
    storage.start_reads([a0, a1])  # both in flight: nothing new
    assert len(submitted) == 2


def with_shared_reads(storage, ring_bytes=1 << 20, auto=False):
    """A CPU storage that reads like the CUDA one: reader processes packing into a shared ring (of a fixed
    size, or one that grows as `LoRAConfig.staging_ring_bytes` None's does: ``auto``)."""
    from unipage.adapter_reader import ReaderPool

    storage._reader = ReaderPool(2)
    storage._ring = PinnedRing(ring_bytes, pin=False, shared=True)
    storage._ring_auto = auto
    return storage


@contextlib.contextmanager
def shared_reads(tmp_path, ring_bytes=1 << 20, auto=False):
    """``(memory, storage)`` of `setup`, the storage reading as the CUDA one does; closed afterwards."""
    memory, storage = setup(tmp_path)
    with_shared_reads(storage, ring_bytes, auto)
    try:
        yield memory, storage
    finally:
        storage.close()


def _poll_reads(storage, seconds=120):
    deadline, failed = time.monotonic() + seconds, []
    while (storage._reads or storage._waiting) and time.monotonic() < deadline:
        failed += storage.poll().failed
        time.sleep(0.01)
    return failed


def _kept_then_evicted(memory, storage, name):
    """``name`` loaded through the readers (its host copy kept in a file), then evicted; its host file."""
    memory.adapters.request(name)
    storage.apply(memory.adapters.take_effects())
    assert _poll_reads(storage) == []
    memory.adapters.load_done(name)
    memory.adapters.evict(name)
    storage.apply(memory.adapters.take_effects())
    return storage._host[name]


def assert_resident_equals_packed(memory, storage, name, path):
    """The adapter's pages in the pool hold the packed bytes of ``path``."""
    record = memory.adapters.get(name)
    with open(path, "rb") as f:
        packed = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).view(storage.dtype)
    got = storage.pool[:, torch.tensor(record.pages)].contiguous().view(-1)
    assert torch.equal(got, packed)


def _loaded_through_a_file_then_evicted(memory, storage, name):
    """``name`` read with a ring too small for it and of a fixed size (back through a file: its host copy a
    buffer of this process), then evicted, and the ring given room; that buffer."""
    ring, auto = storage._ring, storage._ring_auto
    storage._ring, storage._ring_auto = PinnedRing(ALIGN, pin=False, shared=True), False  # (an auto ring would grow)
    try:
        memory.adapters.request(name)
        storage.apply(memory.adapters.take_effects())
        assert storage._reads[name][2] is None and _poll_reads(storage) == []
        memory.adapters.load_done(name)
        memory.adapters.evict(name)
        storage.apply(memory.adapters.take_effects())
    finally:
        storage._ring.close()
        storage._ring, storage._ring_auto = ring, auto
    host = storage._host[name]
    assert isinstance(host, torch.Tensor)
    return host


def _kept_in_a_file_then_evicted(memory, storage, name):
    """``name`` loaded on CUDA through the readers (its host copy a file they kept), then evicted; that file."""
    sync_load(memory, storage, name)
    assert _wait_loads(storage, [name]) == {name}
    memory.adapters.load_done(name)
    memory.adapters.evict(name)
    storage.apply(memory.adapters.take_effects())
    return storage._host[name]


class Gate:
    """An event the test completes (`over`): what a ring slice waits for."""

    over = False

    def query(self) -> bool:
        return self.over
