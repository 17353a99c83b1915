"""One flat int32 buffer that holds every LoRA table; written and uploaded one slot at a time.

Shape legend: S = slot capacity, W = page-table width (pages), J = slices of a dense group,
F = expert-LoRA fields (`FIELDS`).  Regions, in this order (the layers' groups from
`model_groups`), each starting at a multiple of ALIGN elements::

    page_table                                           [S, W]
    per layer:  per dense group  rank, a_offset, b_offset    [S, J] each
                in an MoE layer  table [S, F], slot_flags    [S]

Slot ``s`` owns the elements ``base + s * stride`` (two index vectors fixed by S, W and the
model): its page ids zero-padded to W, then its `SlotRows.values`.  A released slot is all
zeros: no pages, rank 0, no expert LoRA.  On CPU the host array *is* the tables; on CUDA it
mirrors a device buffer, and `upload` sends the elements of the slots that changed as one
``[2, n]`` int64 host-to-device copy (positions, values) out of a persistent pinned staging
buffer, and one scatter.
"""

from __future__ import annotations

import numpy as np
import torch

from unipage.kernels.moe_align import FIELDS
from unipage.models.lora_rows import LayerGroups, SlotRows

ALIGN = 32  # int32 elements: region starts (Triton specialises pointers on 16-byte alignment)


def _region_cols(groups: tuple[LayerGroups, ...], width: int) -> list[int]:
    """Columns of every region, in buffer order (see the module docstring)."""
    cols = [width]
    for layer in groups:
        for group in layer.dense:
            cols += [group.width] * 3
        if layer.moe:
            cols += [len(FIELDS), 1]
    return cols


class TableBuffer:
    """The host (and, on CUDA, device) buffer of tables of ``slots`` rows and ``width`` pages."""

    def __init__(self, groups: tuple[LayerGroups, ...], slots: int, width: int, device: torch.device,
                 mirror: bool | None = None) -> None:
        """``mirror``: keep a separate device buffer (default: off the CPU; tests force it on CPU)."""
        self.slots, self.width = slots, width
        cols = np.asarray(_region_cols(groups, width), dtype=np.int64)
        sizes = -(-cols * slots // ALIGN) * ALIGN  # every region starts 128-byte aligned (as its own tensor would)
        self.offsets = np.concatenate(([0], np.cumsum(sizes)))  # [regions + 1]
        self.cols = cols
        self.base = np.concatenate([o + np.arange(c) for o, c in zip(self.offsets[:-1], cols)])  # [n]
        self.stride = np.repeat(cols, cols)  # [n]
        self.host = torch.zeros(int(self.offsets[-1]), dtype=torch.int32)
        self.np = self.host.numpy()
        mirror = device.type != "cpu" if mirror is None else mirror
        self.flat = torch.zeros_like(self.host, device=device) if mirror else self.host
        self.regions = [self._region(i) for i in range(len(cols))]  # (device [S, cols], host [S, cols]), made once
        self._stage: torch.Tensor | None = None  # [2 * capacity] int64 pinned: uploads pass through it (CUDA)
        self._copied = None  # CUDA event: the last upload's copy out of the staging buffer is done

    def positions(self, slot: int) -> np.ndarray:
        """``[n]`` int64: the slot's elements in the flat buffer."""
        return self.base + slot * self.stride

    def write(self, slot: int, rows: SlotRows | None) -> None:
        """Write the slot's values on the host (zeros for None: a released slot)."""
        values = np.zeros(len(self.base), dtype=np.int32)
        if rows is not None:
            values[:len(rows.pages)] = rows.pages
            values[self.width:] = rows.values
        self.np[self.positions(slot)] = values

    def upload(self, slots) -> None:
        """Send the host values of ``slots`` to the device (nothing to do on CPU)."""
        if self.flat is self.host or not slots:
            return
        index = np.concatenate([self.positions(slot) for slot in slots])
        values = np.stack([index, self.np[index].astype(np.int64)])  # [2, n] int64
        packed = self._staged(values) if self.flat.is_cuda else torch.from_numpy(values)
        moved = packed.to(self.flat.device, non_blocking=True)
        self.flat.index_copy_(0, moved[0], moved[1].to(torch.int32))
        if self.flat.is_cuda:
            self._copied.record()

    def _staged(self, values: np.ndarray) -> torch.Tensor:
        """``values`` in the persistent pinned staging buffer, once the copy out of it before is done.

        One pinned buffer, reused: allocating a pinned block per upload cost about a millisecond.
        The previous upload's copy ran in the step before, so the wait is normally none."""
        n = values.shape[1]
        if self._stage is None or self._stage.numel() < 2 * n:
            self._stage = torch.empty(2 * max(1024, 1 << (n - 1).bit_length()), dtype=torch.int64, pin_memory=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        self._copied.synchronize()
        staged = self._stage[:2 * n].view(2, n)  # contiguous: copied straight from pinned memory
        np.copyto(staged.numpy(), values)  # one thread (see unipage.pinned)
        return staged

    def upload_all(self) -> None:
        if self.flat is not self.host:
            self.flat.copy_(self.host)

    def _region(self, index: int) -> tuple[torch.Tensor, np.ndarray]:
        """Region ``index`` as ``[S, cols]`` views: of the device buffer and of the host array."""
        start, cols = int(self.offsets[index]), int(self.cols[index])
        end = start + self.slots * cols
        return self.flat[start:end].view(self.slots, cols), self.np[start:end].reshape(self.slots, cols)
