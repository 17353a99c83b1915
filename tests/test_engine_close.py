"""`Engine.close` / `LLM.close`: the pool storage's shared-memory ring, its host-copy directory and its
reader processes go, at once, whether the owner closes after work, twice, or fails halfway through
construction; after close, work is refused with `ClosedError`.

On CPU a storage has no readers and no shared ring, so these engines get the CUDA storage's parts
(real reader processes, a real ring file in /dev/shm, unpinned) through `shared_storages`.
"""

from __future__ import annotations

import os
import time

import pytest
import test_server_support as ss
from test_storage import with_shared_reads
from unipage.scheduler import Request, SamplingParams

from unipage.config import PoolConfig
from unipage.engine import Engine
from unipage.errors import ClosedError
from unipage.llm import LLM
from unipage.storage import PoolStorage

POOL = PoolConfig(num_pages=256)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ss.tiny_model(tmp_path_factory.mktemp("close-model"))


def shared_storages(monkeypatch, module) -> list[tuple[PoolStorage, str]]:
    """Have ``module``'s `PoolStorage` read like the CUDA one (reader processes, a shared ring); the
    storages made, in order, each with its ring's file."""
    made = []

    def make(config, device="cpu"):
        storage = with_shared_reads(PoolStorage(config, device))
        assert os.path.exists(storage._ring.path) and storage._reader.workers[0].proc.poll() is None
        made.append((storage, storage._ring.path))
        return storage

    monkeypatch.setattr(module, "PoolStorage", make)
    return made


def released(storage: PoolStorage, ring: str) -> bool:
    """Whether the ring's file is gone, the host-copy directory (if any) too, and every reader has exited."""
    host_dir = storage._host_dir
    return (not os.path.exists(ring) and not (host_dir and os.path.exists(host_dir))
            and all(worker.proc.poll() is not None for worker in storage._reader.workers))


def load_through_the_readers(engine: Engine, name: str) -> str:
    """Load ``name`` as the CUDA storage does (read and packed by a reader process, which keeps the host
    copy as a file in shared memory); that file."""
    storage, adapters = engine.storage, engine.memory.adapters
    adapters.request(name)
    storage.apply(adapters.take_effects())
    deadline = time.monotonic() + 120
    while storage._reads and time.monotonic() < deadline:
        assert storage.poll().failed == []
        time.sleep(0.01)
    host = storage._host[name]
    assert os.path.dirname(host) == storage._host_dir and os.path.exists(host)
    return host


def test_close_releases_the_storage_and_a_second_close_is_fine(tiny, monkeypatch):
    import unipage.engine

    made = shared_storages(monkeypatch, unipage.engine)
    engine = Engine(tiny.model_dir, device="cpu", pool=POOL)
    engine.add_adapter("qv-r4", tiny.adapters["qv-r4"])
    ((storage, ring),) = made
    host = load_through_the_readers(engine, "qv-r4")
    engine.add_request(Request("r0", [5, 6, 7], None, SamplingParams(temperature=0), 4))
    assert not released(storage, ring)
    engine.close()
    assert released(storage, ring) and not os.path.exists(host)
    engine.close()
    storage.close()
    assert engine.closed and storage.closed


def test_work_after_close_is_a_closed_error(tiny, monkeypatch):
    import unipage.engine

    shared_storages(monkeypatch, unipage.engine)
    with Engine(tiny.model_dir, device="cpu", pool=POOL) as engine:
        pass
    with pytest.raises(ClosedError, match="closed"):
        engine.add_request(Request("r0", [5, 6, 7], None, SamplingParams(temperature=0), 4))
    with pytest.raises(ClosedError):
        engine.step()
    with pytest.raises(ClosedError):
        engine.storage.apply([])
    with pytest.raises(ClosedError):
        engine.storage.poll()
    for call in (lambda: engine.add_adapter("late", tiny.adapters["qv-r4"]), lambda: engine.remove_adapter("x"),
                 engine.capture_graphs):
        with pytest.raises(ClosedError):
            call()


def test_close_with_a_read_in_flight(tiny, monkeypatch):
    """A read still queued or running when the engine closes is abandoned: everything is released anyway."""
    import unipage.engine

    made = shared_storages(monkeypatch, unipage.engine)
    engine = Engine(tiny.model_dir, device="cpu", pool=POOL)
    engine.add_adapter("qv-r4", tiny.adapters["qv-r4"])
    ((storage, ring),) = made
    engine.memory.adapters.request("qv-r4")
    storage.apply(engine.memory.adapters.take_effects())
    assert storage._reads  # the read is queued or running in a reader process
    engine.close()
    assert released(storage, ring)


def test_a_constructor_that_fails_after_the_storage_releases_it(tiny, monkeypatch):
    import unipage.engine

    made = shared_storages(monkeypatch, unipage.engine)
    with pytest.raises(ValueError, match="cuda_graphs"):  # raised after the storage is made
        Engine(tiny.model_dir, device="cpu", pool=POOL, cuda_graphs=True)
    ((storage, ring),) = made
    assert storage.closed and released(storage, ring)


def test_llm_closes_its_engine_in_a_with_block_and_on_a_failed_start(tiny, monkeypatch):
    import unipage.engine

    made = shared_storages(monkeypatch, unipage.engine)
    with LLM(tiny.model_dir, device="cpu", pool=POOL) as llm:
        out = llm.generate([5, 6, 7], SamplingParams(temperature=0), max_tokens=3, ignore_eos=True)
        assert len(out[0].token_ids) == 3
        assert not released(*made[0])
    assert released(*made[0])
    with pytest.raises(ClosedError):
        llm.generate([5, 6, 7], max_tokens=3)
    llm.close()
    with pytest.raises(ValueError):  # an adapter directory that is not there
        LLM(tiny.model_dir, {"missing": os.path.join(tiny.root, "missing")}, device="cpu", pool=POOL)
    assert made[1][0].closed and released(*made[1])
