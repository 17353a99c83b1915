"""Entries of a stack of adapters' LoRA weights kept beside the pool (`shrink_stack`, `moe_stacks`): which adapter
slot sits in which of a fixed number of entries, least recently used first, on the host and, for the kernels
and the CUDA graphs that read it, on the device (``entry_of_slot``, made once, never moved).

`EntryTable.prepare` gives every slot of a step an entry: a slot not in the stack takes a free entry, else the
least recently used one the step does not need, and the subclass's ``_fill(entry, slot, tables, pool,
layer_rows)`` copies its weights there from the pool's pages (on the current stream, so after whatever the GPU
still runs of earlier steps); ``entry_of_slot`` is uploaded when it changed.  `forget` drops a slot's entry when
its adapter is loaded or evicted, so a slot reused by another adapter is copied again.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class StackError(RuntimeError):
    """An engine invariant broken: more adapters in a step than entries, or a slot out of range."""


class Entries:
    """Which adapter slot holds which of ``count`` entries, least recently used first."""

    def __init__(self, count: int, name: str = "the stack") -> None:
        self.count, self.name = count, name
        self._of: OrderedDict[int, int] = OrderedDict()  # slot -> entry

    def items(self):
        return self._of.items()

    def take(self, needed: set[int]) -> list[tuple[int, int]]:
        """Mark ``needed`` used now; ``(slot, entry)`` of those without an entry, each given a free one or
        the least recently used one that ``needed`` does not hold (recorded at once: `forget` undoes)."""
        if len(needed) > self.count:
            raise StackError(f"{len(needed)} adapters in one step, but {self.name} holds {self.count}")
        for slot in sorted(needed & self._of.keys()):
            self._of.move_to_end(slot)
        moves = []
        for slot in sorted(needed - self._of.keys()):
            taken = set(self._of.values())
            free = [e for e in range(self.count) if e not in taken]
            entry = free[0] if free else self._of.pop(next(s for s in self._of if s not in needed))
            self._of[slot] = entry
            moves.append((slot, entry))
        return moves

    def forget(self, slot: int) -> None:
        self._of.pop(slot, None)


class EntryTable:
    """The entries of a stack and their device map; a subclass fills an entry (``_fill``)."""

    def __init__(self, entries: int, device: torch.device, name: str) -> None:
        if entries < 1:
            raise ValueError(f"{name} needs at least one entry, got {entries}")
        self.entries, self.device, self.name = Entries(entries, name), device, name
        self.entry_of_slot: torch.Tensor | None = None  # [max_slots] int32 (device), from `set_slots`
        self._host: torch.Tensor | None = None  # its host copy (pinned on CUDA)
        self._uploaded = None  # CUDA event: the last upload has left the host copy
        self._stale = False  # entry_of_slot lags the entries (a prepare raised before its upload)
        self.fills = 0  # entries filled so far (one per adapter brought into the stack)

    def set_slots(self, max_slots: int) -> None:
        """Make ``entry_of_slot`` for slots ``[0, max_slots)`` (once: CUDA graphs read it, so it never
        moves).  Slots are reused lowest first, so the pool's page count bounds them."""
        if self.entry_of_slot is not None:
            raise StackError("set_slots is called once")
        self.entry_of_slot = torch.full((max_slots,), -1, dtype=torch.int32, device=self.device)
        self._host = torch.full((max_slots,), -1, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self._uploaded = torch.cuda.Event() if self.device.type == "cuda" else None

    def prepare(self, slots, tables, pool: torch.Tensor, layer_rows) -> None:
        """Give every slot in ``slots`` an entry (copying those new to the stack from ``tables``' pages of
        ``pool [L, N, P]``, layer ``i`` in row ``layer_rows[i]``); after ``tables.refresh()``."""
        needed = set(slots)
        if self._host is None:
            raise StackError("set_slots before prepare")
        if max(needed) >= self._host.shape[0]:
            raise StackError(f"adapter slot {max(needed)} beyond {self.name}'s {self._host.shape[0]}")
        moves = self.entries.take(needed)
        self._stale |= bool(moves)  # (stays set if a fill raises: the next prepare uploads)
        done = 0
        try:
            for slot, entry in moves:
                self._fill(entry, slot, tables, pool, layer_rows)
                self.fills += 1
                done += 1
        except BaseException:  # a fill that raised leaves its slot and those after it without an entry
            for slot, _ in moves[done:]:
                self.entries.forget(slot)
            raise
        if self._stale:
            self._upload()
            self._stale = False

    def forget(self, slot: int) -> None:
        """Slot ``slot`` now holds another adapter, or none: its entry is free."""
        self.entries.forget(slot)

    def _fill(self, entry: int, slot: int, tables, pool: torch.Tensor, layer_rows) -> None:
        raise NotImplementedError

    def _upload(self) -> None:
        if self._uploaded is not None:
            self._uploaded.synchronize()  # (the last upload left long ago: uploads come with new adapters)
        self._host.fill_(-1)
        for slot, entry in self.entries.items():
            self._host[slot] = entry
        self.entry_of_slot.copy_(self._host, non_blocking=self._uploaded is not None)
        if self._uploaded is not None:
            self._uploaded.record()
