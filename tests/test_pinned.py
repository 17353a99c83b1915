"""PinnedRing: slices handed out first in, first out, reused only after their copy's event completes."""

import pytest
import torch

from unipage.pinned import ALIGN, PinnedRing


class Event:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def _src(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 255, (nbytes,), generator=g, dtype=torch.uint8)


def _start(ring: PinnedRing, staged: torch.Tensor) -> int:
    return staged.data_ptr() - ring.buf.data_ptr()


def test_stage_copies_shape_dtype_and_values():
    ring = PinnedRing(4 * ALIGN, pin=False)
    src = torch.randn(3, 5, 7).to(torch.float16)
    staged = ring.stage(src)
    assert staged.shape == src.shape and staged.dtype == src.dtype and torch.equal(staged, src)
    ring.hold(Event())
    src2 = torch.randn(2, 3)
    staged2 = ring.stage(src2)
    assert _start(ring, staged2) == ALIGN and torch.equal(staged2, src2)
    assert torch.equal(staged, src)  # the first slice is untouched


def test_slices_come_back_first_in_first_out_and_wrap():
    ring = PinnedRing(4 * ALIGN, pin=False)
    events = []
    for i in range(2):  # ALIGN + 1 bytes take two units each
        assert ring.stage(_src(ALIGN + 1, i)) is not None
        events.append(Event())
        ring.hold(events[-1])
    assert ring.in_use == 2 and ring.head == 0  # [0, 2) and [2, 4) units: full, head wrapped
    assert ring.stage(_src(1, 9)) is None  # nothing free until the oldest copy completes
    events[1].done = True  # a younger copy done does not free the older slice
    assert ring.stage(_src(1, 9)) is None
    events[0].done = True
    staged = ring.stage(_src(ALIGN, 3))
    assert staged is not None and _start(ring, staged) == 0  # the freed head of the ring
    ring.hold(Event())
    assert ring.in_use == 1  # both done slices were dropped


def test_no_room_at_the_end_wraps_to_the_freed_start():
    ring = PinnedRing(5 * ALIGN, pin=False)
    first, second = Event(), Event()
    ring.stage(_src(2 * ALIGN, 0))
    ring.hold(first)
    ring.stage(_src(2 * ALIGN, 1))
    ring.hold(second)  # held: [0, 4) units; head 4
    assert ring.stage(_src(2 * ALIGN, 2)) is None  # one unit at the end, none at the start
    first.done = True  # free: [4, 5) and [0, 2)
    staged = ring.stage(_src(2 * ALIGN, 2))
    assert staged is not None and _start(ring, staged) == 0
    ring.hold(Event())  # held: [2, 4) and [0, 2); the unit [4, 5) left by the wrap is not reused yet
    assert ring.stage(_src(ALIGN, 4)) is None
    second.done = True  # held: [0, 2); free: [2, 5)
    staged = ring.stage(_src(3 * ALIGN, 4))
    assert staged is not None and _start(ring, staged) == 2 * ALIGN
    assert ring.in_use == 2


def test_too_large_is_refused_and_an_empty_ring_restarts_at_zero():
    ring = PinnedRing(2 * ALIGN, pin=False)
    assert ring.stage(_src(2 * ALIGN + 1, 0)) is None
    event = Event()
    ring.stage(_src(ALIGN, 1))
    ring.hold(event)
    event.done = True
    staged = ring.stage(_src(2 * ALIGN, 2))  # all free again: the whole ring from 0
    assert staged is not None and _start(ring, staged) == 0


def test_rejects_a_tiny_ring():
    with pytest.raises(ValueError, match="at least"):
        PinnedRing(ALIGN - 1, pin=False)


def test_one_hold_covers_every_slice_staged_since_the_last():
    ring = PinnedRing(4 * ALIGN, pin=False)
    first, second = Event(), Event()
    ring.stage(_src(ALIGN, 0))
    ring.hold(first)
    ring.stage(_src(ALIGN, 1))
    ring.stage(_src(ALIGN, 2))
    ring.hold(second)  # both slices staged after the first hold
    first.done = True
    assert ring.stage(_src(2 * ALIGN, 3)) is None  # only the first unit is free: [0, 1)
    second.done = True
    assert ring.stage(_src(3 * ALIGN, 3)) is not None and ring.in_use == 1


def test_a_reserved_slice_is_held_until_released_or_its_copy_completes():
    ring = PinnedRing(4 * ALIGN, pin=False)
    first = ring.reserve(2 * ALIGN)
    second = ring.reserve(ALIGN + 1)  # two units
    assert (first.start, second.start) == (0, 2 * ALIGN) and ring.reserve(1) is None
    ring.release(second)  # done, but behind the first slice: nothing free yet
    assert ring.reserve(1) is None
    event = Event()
    ring.hold_slice(first, event)
    assert ring.reserve(1) is None
    event.done = True
    assert ring.reserve(4 * ALIGN) is not None and ring.in_use == 1


def test_staged_and_reserved_slices_keep_their_own_events():
    """A `hold` covers what was staged, never a reserved slice still being filled."""
    ring = PinnedRing(4 * ALIGN, pin=False)
    reserved = ring.reserve(ALIGN)
    ring.stage(_src(ALIGN, 0))
    staged_event = Event()
    ring.hold(staged_event)
    assert reserved.event is None
    staged_event.done = True
    assert ring.reserve(3 * ALIGN) is None  # the reserved slice at the front still holds the ring
    ring.release(reserved)
    assert ring.reserve(3 * ALIGN) is not None


def test_a_shared_ring_is_a_file_another_mapping_sees_and_removed_with_the_ring():
    import gc
    import mmap
    import os

    ring = PinnedRing(4 * ALIGN, pin=False, shared=True)
    path = ring.path
    piece = ring.reserve(ALIGN)
    with open(path, "r+b") as f:
        other = mmap.mmap(f.fileno(), 0)
    other[piece.start:piece.start + 3] = b"abc"
    assert bytes(ring.view(piece)[:3].numpy()) == b"abc"
    other.close()
    del ring, piece
    gc.collect()
    assert not os.path.exists(path)


def test_no_room_for_a_shared_ring_is_an_os_error(monkeypatch, tmp_path):
    import os

    from unipage import pinned

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pinned, "SHM_DIR", str(tmp_path))
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="No space"):
        PinnedRing(4 * ALIGN, pin=False, shared=True)
    assert list(tmp_path.iterdir()) == []  # the file was removed


def test_close_removes_a_shared_ring_at_once_and_a_failed_registration_leaves_no_file(monkeypatch, tmp_path):
    import os

    from unipage import pinned

    monkeypatch.setattr(pinned, "SHM_DIR", str(tmp_path))
    ring = PinnedRing(4 * ALIGN, pin=False, shared=True)
    assert os.path.basename(ring.path).startswith(f"{pinned.RING_PREFIX}{os.getpid()}-")
    ring.close()
    assert list(tmp_path.iterdir()) == []

    def refused(buf):
        raise OSError("cudaHostRegister of a shared ring failed: CUDA error 712")

    monkeypatch.setattr(pinned, "_register", refused)
    with pytest.raises(OSError, match="712"):
        PinnedRing(4 * ALIGN, pin=True, shared=True)
    assert list(tmp_path.iterdir()) == []


def test_no_shared_memory_directory_is_an_os_error_not_a_file_on_disk(monkeypatch, tmp_path):
    from unipage import pinned

    monkeypatch.setattr(pinned, "SHM_DIR", str(tmp_path / "missing"))
    with pytest.raises(OSError, match="no shared memory directory"):
        PinnedRing(4 * ALIGN, pin=False, shared=True)


def test_sweep_removes_old_entries_no_process_holds_a_lock_on(tmp_path):
    import os

    from unipage.pinned import SWEEP_AGE_S, hold_lock, sweep_dead

    old = os.path.getmtime(tmp_path) - 2 * SWEEP_AGE_S
    for name in ("unipage-ring-1-dead", "unipage-ring-2-live", "unipage-ring-3-young", "other"):
        (tmp_path / name).write_bytes(b"0")
    (tmp_path / "unipage-host-4-dead").mkdir()
    (tmp_path / "unipage-host-4-dead" / "0.bin").write_bytes(b"0")
    for name in ("unipage-ring-1-dead", "unipage-ring-2-live", "other", "unipage-host-4-dead"):
        os.utime(tmp_path / name, (old, old))
    live = hold_lock(str(tmp_path / "unipage-ring-2-live"))  # as a running process holds its ring's
    try:
        sweep_dead(str(tmp_path), "unipage-ring-")
        sweep_dead(str(tmp_path), "unipage-host-")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "unipage-ring-2-live",
                                                              "unipage-ring-3-young"]
    finally:
        os.close(live)


def test_idle_once_no_slice_is_held_and_their_copies_are_complete():
    """`idle`: a staged slice not yet held, a reserved one not released, or a held one whose event has not
    completed keeps the ring busy."""
    ring = PinnedRing(4 * ALIGN, pin=False)
    assert ring.idle()
    ring.stage(_src(ALIGN, 0))
    assert not ring.idle()  # staged, its copy not issued yet
    event = Event()
    ring.hold(event)
    assert not ring.idle()
    event.done = True
    assert ring.idle()
    piece = ring.reserve(ALIGN)
    assert not ring.idle()
    ring.release(piece)
    assert ring.idle() and ring.in_use == 0
