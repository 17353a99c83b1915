"""Per-slot LoRA tables of the resident adapters: page table and per-layer kernel metadata.

The adapter manager gives every resident adapter a slot; the kernels index a
``page_table [S, max_pages]`` int32 by slot and read, per layer and target
group, the offsets and ranks in a `DenseLoraMeta` (q/k/v together, o, gate/up
together, down) or a `MoeLoraMeta` (the experts).

Updates are per slot: `assign` / `release` compute that one adapter's rows
(`lora_rows`: O(layers x its targets), once per layout) and write them into a host
buffer (`lora_buffer.TableBuffer`) of which every table is a view; `refresh`
(before a forward pass) sends the slots changed since the last refresh to the
device in one copy.  Only a capacity growth rewrites every slot.

The tables' launch-relevant shape — the *signature*: capacities, slice widths,
rank blocks, which layers have LoRA — is kept stable, so that a CUDA graph
captured over the tables (`unipage.graphs`) serves any adapter mix:

* ``S`` and ``max_pages`` are capacities (powers of two, at least MIN_SLOTS and
  MIN_PAGES, or set from the ``slots`` / ``max_rank`` and ``page_elems`` given)
  that never shrink; S grows by GROWTH and max_pages doubles only when an
  adapter needs it;
* slice widths come from the model;
* every value that depends on all slots (max ranks and rank blocks, MoE pads,
  pair-mode tile heights and dims, ``buffer_elems``, whether a group has LoRA at
  all) is a high-water mark: what a full build over every adapter assigned so
  far would give.  It rises with a larger adapter and never falls, so a release
  changes no launch shape (a rank block above the ranks is still correct: ranks
  are masked).
  Given ``max_rank``, the marks start at those of the largest adapter allowed.

`generation` changes only when the signature does; then graphs are captured again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from unipage.config import EXPERT_TARGETS, ModelConfig
from unipage.kernels import DenseLoraMeta, MoeLoraMeta
from unipage.kernels.moe_lora_plan import lora_pads, tile_ranks
from unipage.kernels.lora_meta import COL_TILE_WIDTHS, HostRows, next_pow2
from unipage.lora_layout import AdapterLayout, TargetSpec, build_layout
from unipage.models.lora_buffer import TableBuffer
from unipage.models.lora_rows import (
    DenseGroup,
    LayerGroups,
    Marks,
    RowsCache,
    SlotRows,
    layout_rows,
    model_groups,
)

MIN_SLOTS = 8  # slot capacity of the tables at least this
MIN_PAGES = 4  # page-table width at least this
GROWTH = 4  # factor of a slot-capacity growth (each is a new signature: keep them rare)


@dataclass
class LayerLora:
    qkv: DenseLoraMeta
    o: DenseLoraMeta
    gate_up: DenseLoraMeta | None  # dense MLP layers
    down: DenseLoraMeta | None
    moe: MoeLoraMeta | None  # MoE layers


def largest_layout(model: ModelConfig, max_rank: int) -> AdapterLayout:
    """The largest adapter of rank <= ``max_rank``: every target at that rank, expert gate/up as
    separate gate and up slices (2 x max_rank A rows).  Its pages and launch values bound every
    adapter the adapter manager accepts."""
    def spec(target: str) -> TargetSpec:
        return TargetSpec(target, (max_rank,) * (2 if target == EXPERT_TARGETS[0] else 1))

    return build_layout(model, [tuple(spec(t) for t in model.targets(layer)) for layer in range(model.num_layers)])


class LoraTables:
    """Slot -> (pages, layout), and the tensors built from it, kept in step one slot at a time."""

    def __init__(self, model: ModelConfig, device: torch.device, *, slots: int | None = None,
                 max_rank: int | None = None, page_elems: int | None = None) -> None:
        """Capacities known up front keep the signature fixed from the start: ``slots``, the most
        adapters resident at once; ``max_rank`` (the configured maximum), which sets every launch
        value as if `largest_layout` had been assigned, and with ``page_elems`` (elements of a pool
        page) the page-table width.  Unknown, they grow on demand."""
        self.model, self.device = model, torch.device(device)
        self._groups = model_groups(model)
        self._cache = RowsCache(self._groups)
        self._rows: dict[int, SlotRows] = {}  # resident slot -> its rows
        self._capacity = max(MIN_SLOTS, next_pow2(slots or 1))
        self._width = MIN_PAGES
        self._seen = Marks.zeros(model.num_layers)  # high-water marks (moe_slots: most slots at once)
        if max_rank is not None:
            largest = largest_layout(model, max_rank)
            self._seen.raise_to(layout_rows(self._groups, largest)[1])
            if page_elems is not None:
                self._width = max(MIN_PAGES, next_pow2(largest.num_pages(page_elems)))
        self._live_moe = np.zeros(model.num_layers, np.int64)  # slots with expert LoRA now, per layer
        self._buffer: TableBuffer | None = None
        self._changed: set[int] = set()  # slots written on the host since the last upload
        self._stale = True  # the metadata objects lag the marks or the buffer
        self._col_tiles: dict[tuple, dict] = {}  # slice geometry -> col-tile tables, made once (graphs use them)
        self.page_table: torch.Tensor | None = None  # [S, max_pages] int32; None until an adapter is resident
        self.layers: list[LayerLora] = []
        self.generation = 0  # changes whenever the tables' signature changes
        self._signature: tuple | None = None

    # -- slot updates: O(layers x targets) of one adapter ------------------------------
    def assign(self, slot: int, pages, layout: AdapterLayout) -> None:
        rows = self._cache.slot_rows(pages, layout)
        self.release(slot)
        self._rows[slot] = rows
        self._live_moe += rows.marks.moe_slots
        self._stale |= self._seen.raise_to(rows.marks)
        if (self._live_moe > self._seen.moe_slots).any():
            np.maximum(self._seen.moe_slots, self._live_moe, out=self._seen.moe_slots)
            self._stale = True
        if slot >= self._capacity:
            self._capacity = max(self._capacity * GROWTH, next_pow2(slot + 1))
        self._width = max(self._width, next_pow2(len(rows.pages)))
        self._write(slot)

    def release(self, slot: int) -> None:
        rows = self._rows.pop(slot, None)
        if rows is not None:
            self._live_moe -= rows.marks.moe_slots
            self._write(slot)

    @property
    def any_moe_lora(self) -> bool:
        """Whether some MoE layer's tables hold expert LoRA (as of `refresh`)."""
        return any(layer.moe is not None and layer.moe.any_lora for layer in self.layers)

    @property
    def num_slots(self) -> int:
        """Rows of the tables (after `refresh`): the slot capacity."""
        return self._capacity

    def refresh(self) -> bool:
        """Bring the tensors up to date; False when no adapter is resident.  Once made, the
        tensors stay (with every slot empty they read as no LoRA)."""
        if self._buffer is None and not self._rows:
            return False
        if self._fits():
            self._buffer.upload(sorted(self._changed))
        else:
            self._new_buffer()
        self._changed.clear()
        if self._stale:
            self._set_layers()
        return bool(self._rows)

    # -- buffer ------------------------------------------------------------------------
    def _fits(self) -> bool:
        buf = self._buffer
        return buf is not None and (buf.slots, buf.width) == (self._capacity, self._width)

    def _write(self, slot: int) -> None:
        if self._fits():  # else the next refresh makes a new buffer from every slot's rows
            self._buffer.write(slot, self._rows.get(slot))
            self._changed.add(slot)

    def _new_buffer(self) -> None:
        buf = TableBuffer(self._groups, self._capacity, self._width, self.device)
        for slot, rows in self._rows.items():
            buf.write(slot, rows)
        buf.upload_all()
        self._buffer, self._stale = buf, True

    # -- metadata objects: views of the buffer, launch values from the marks ----------------
    def _set_layers(self) -> None:
        regions = iter(self._buffer.regions[1:])
        self.layers = [self._layer(layer, groups, regions) for layer, groups in enumerate(self._groups)]
        self.page_table = self._buffer.regions[0][0]
        signature = (tuple(self.page_table.shape), tuple(_layer_signature(layer) for layer in self.layers))
        if signature != self._signature:
            self._signature = signature
            self.generation += 1
        self._stale = False

    def _layer(self, layer: int, groups: LayerGroups, regions) -> LayerLora:
        dense = {g.index: self._dense(layer, g, next(regions), next(regions), next(regions)) for g in groups.dense}
        moe = self._moe(layer, next(regions)[0], next(regions)[0].view(-1)) if groups.moe else None
        return LayerLora(dense[0], dense[1], dense.get(2), dense.get(3), moe)

    def _dense(self, layer: int, group: DenseGroup, rank, a_offset, b_offset) -> DenseLoraMeta:
        key = (group.cols, group.starts)
        tiles = self._col_tiles.get(key)
        meta = DenseLoraMeta(
            targets=group.targets, d_in=group.d_in, slice_cols=group.cols, slice_starts=group.starts,
            ranks=HostRows(rank[1]), a_offsets=HostRows(a_offset[1]), b_offsets=HostRows(b_offset[1]),
            buffer_elems=int(self._seen.elems[layer]), max_rank=int(self._seen.ranks[layer, group.index]),
            rank=rank[0], a_offset=a_offset[0], b_offset=b_offset[0], col_tiles={} if tiles is None else tiles)
        if tiles is None:
            for block_n in COL_TILE_WIDTHS:
                meta.col_tile_table(block_n)
            self._col_tiles[key] = meta.col_tiles
        return meta

    def _moe(self, layer: int, table: torch.Tensor, flags: torch.Tensor) -> MoeLoraMeta:
        seen = self._seen
        has = bool(seen.moe_slots[layer])
        hidden, gate_up = self.model.target_dims(EXPERT_TARGETS[0], layer) if has else (0, 0)
        gu_rows, gu_rank, down_rank = (int(v) for v in seen.moe[layer])
        return MoeLoraMeta(table, flags, hidden, gate_up // 2, self.model.num_experts if has else 0,
                           gu_rows, gu_rank, down_rank, int(seen.moe_slots[layer]))


# -- signature: what the kernels' launches depend on besides tensor contents --------


def _dense_signature(meta: DenseLoraMeta | None) -> tuple | None:
    if meta is None:
        return None
    return meta.targets, meta.d_in, meta.slice_cols, meta.slice_starts, meta.rank_block, meta.max_rank > 0


def _moe_signature(meta: MoeLoraMeta | None) -> tuple | None:
    if meta is None:
        return None
    # pair mode's register tiles follow the ranks below the pads' 16 rows (`tile_ranks`)
    return meta.hidden, meta.inter, meta.num_experts, lora_pads(meta), tile_ranks(meta, 1), meta.any_lora


def _layer_signature(layer: LayerLora) -> tuple:
    dense = tuple(_dense_signature(m) for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
    return dense, _moe_signature(layer.moe)
