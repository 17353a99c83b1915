"""What one adapter puts in the LoRA tables: its rows, and the launch shapes it needs.

Shape legend: L = layers, J = slices of a dense group (q, k, v: 3), F = expert-LoRA fields
(`FIELDS`), G = the dense groups qkv, o, gate_up, down (the last two only in dense-MLP layers).

`model_groups` fixes from the model alone which dense groups each layer has and their slice
geometry: every dense target is one slice of the model's output width (what PEFT adapters
give), so the geometry never depends on which adapters are resident.  `layout_rows` turns one
adapter's `AdapterLayout` into

    values  [n] int32   in `TableBuffer` region order: per layer, per dense group rank [J],
                        a_offset [J], b_offset [J]; in an MoE layer then its `FIELDS` row [F]
                        and its flag (1: the adapter has expert LoRA in this layer)
    marks   `Marks`     per layer: each group's largest rank, the buffer size, expert-LoRA maxima

in O(layers x targets) of that one adapter, whatever else is resident — and `RowsCache` does it
once per layout, so that loading an adapter whose layout another adapter shares is a lookup.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from unipage.config import ModelConfig
from unipage.kernels.lora_meta import dense_slot_row
from unipage.kernels.moe_align import FIELDS
from unipage.kernels.moe_align import slot_fields as moe_slot_fields
from unipage.lora_layout import AdapterLayout

QKV = ("q_proj", "k_proj", "v_proj")
O = ("o_proj",)
GATE_UP = ("gate_proj", "up_proj")
DOWN = ("down_proj",)
GROUPS = (("qkv", QKV), ("o", O), ("gate_up", GATE_UP), ("down", DOWN))  # index = column of Marks.ranks
F_GU_ROWS, F_S0_RANK, F_S1_RANK = FIELDS.index("gu_rows"), FIELDS.index("s0_rank"), FIELDS.index("s1_rank")
F_DOWN_RANK = FIELDS.index("down_rank")


@dataclass(frozen=True, slots=True)
class DenseGroup:
    """One dense LoRA call of a layer: its targets, one slice each."""

    index: int  # position in GROUPS
    targets: tuple[str, ...]  # [J]
    d_in: int
    cols: tuple[int, ...]  # [J] output columns of each slice
    starts: tuple[int, ...]  # [J] first column of each slice

    @property
    def width(self) -> int:
        return len(self.cols)


@dataclass(frozen=True, slots=True)
class LayerGroups:
    dense: tuple[DenseGroup, ...]  # qkv, o (+ gate_up, down in a dense-MLP layer)
    moe: bool  # an MoE layer: one expert-LoRA row per slot

    @property
    def size(self) -> int:
        """Values one slot has in this layer."""
        return sum(3 * g.width for g in self.dense) + (len(FIELDS) + 1 if self.moe else 0)


def _group(model: ModelConfig, layer: int, index: int) -> DenseGroup:
    targets = GROUPS[index][1]
    dims = [model.target_dims(t, layer) for t in targets]
    d_in = {d for d, _ in dims}
    if len(d_in) != 1:
        raise ValueError(f"targets {targets} of layer {layer} must share one input width, got {sorted(d_in)}")
    cols = tuple(d for _, d in dims)
    return DenseGroup(index, targets, d_in.pop(), cols, tuple(accumulate(cols[:-1], initial=0)))


def model_groups(model: ModelConfig) -> tuple[LayerGroups, ...]:
    """The dense groups and MoE flag of every layer (fixed by the model)."""
    out = []
    for layer in range(model.num_layers):
        moe = model.is_moe_layer(layer)
        out.append(LayerGroups(tuple(_group(model, layer, g) for g in ((0, 1) if moe else (0, 1, 2, 3))), moe))
    return tuple(out)


@dataclass(slots=True)
class Marks:
    """What launch shapes an adapter (or every adapter seen) needs, per layer."""

    ranks: np.ndarray  # [L, 4] int64: largest rank of each dense group (column = GROUPS index)
    elems: np.ndarray  # [L] int64: buffer elements used in the layer
    moe: np.ndarray  # [L, 3] int64: gate/up A rows, gate/up slice rank, down rank
    moe_slots: np.ndarray  # [L] int64: slots with expert LoRA (an adapter: 0 or 1)

    @classmethod
    def zeros(cls, layers: int) -> Marks:
        z = np.zeros
        return cls(z((layers, 4), np.int64), z(layers, np.int64), z((layers, 3), np.int64), z(layers, np.int64))

    def raise_to(self, other: Marks) -> bool:
        """Element-wise ``max(self, other)`` in place; whether anything rose."""
        rose = False
        for mine, theirs in zip(self.arrays(), other.arrays()):
            if (theirs > mine).any():
                np.maximum(mine, theirs, out=mine)
                rose = True
        return rose

    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.ranks, self.elems, self.moe, self.moe_slots


@dataclass(frozen=True, slots=True)
class SlotRows:
    pages: np.ndarray  # [n_pages] int32 page ids
    values: np.ndarray  # [n] int32, see the module docstring (shared by the slots of one layout: read only)
    marks: Marks  # (shared likewise: read only)


def layout_rows(groups: tuple[LayerGroups, ...], layout: AdapterLayout) -> tuple[np.ndarray, Marks]:
    """An adapter layout's values and marks (ValueError if it does not fit the model's groups)."""
    if len(layout.layers) != len(groups):
        raise ValueError(f"adapter layout has {len(layout.layers)} layers, the tables {len(groups)}")
    values: list[int] = []
    marks = Marks.zeros(len(groups))
    for layer, layer_groups in enumerate(groups):
        marks.elems[layer] = layout.layers[layer].size
        for group in layer_groups.dense:
            marks.ranks[layer, group.index] = _dense_values(values, layout, layer, group)
        if layer_groups.moe:
            _moe_values(values, marks, layout, layer)
    return np.asarray(values, dtype=np.int32), marks


class RowsCache:
    """`SlotRows` of adapters, their layout's part computed once per layout object.

    Layouts are immutable, and adapters of one shape share one (`cached_layout`), so a load
    usually costs no walk over the layout at all.  Holds the ``size`` most recent layouts.
    """

    def __init__(self, groups: tuple[LayerGroups, ...], size: int = 256) -> None:
        self.groups, self.size = groups, size
        self._by_id: dict[int, tuple[AdapterLayout, np.ndarray, Marks]] = {}  # keeps the layout: ids stay unique

    def slot_rows(self, pages, layout: AdapterLayout) -> SlotRows:
        hit = self._by_id.pop(id(layout), None)
        if hit is None:
            hit = (layout, *layout_rows(self.groups, layout))
        self._by_id[id(layout)] = hit  # most recent last
        if len(self._by_id) > self.size:
            del self._by_id[next(iter(self._by_id))]
        return SlotRows(np.asarray(pages, dtype=np.int32), hit[1], hit[2])


def _dense_values(values: list[int], layout: AdapterLayout, layer: int, group: DenseGroup) -> int:
    """Append the group's rank, a_offset and b_offset rows; return its largest rank."""
    targets = layout.layers[layer].targets
    for target in group.targets:
        entry = targets.get((target, -1))
        if entry is not None and entry.a.cols != group.d_in:
            raise ValueError(f"{target!r} in layer {layer}: input width {entry.a.cols}, the model's {group.d_in}")
    row = dense_slot_row(layout, layer, group.targets, [[c] for c in group.cols])
    ranks, a_offsets, b_offsets = zip(*row)
    values += ranks
    values += a_offsets
    values += b_offsets
    return max(ranks)


def _moe_values(values: list[int], marks: Marks, layout: AdapterLayout, layer: int) -> None:
    fields = moe_slot_fields(layout.layers[layer]) or [0] * len(FIELDS)
    flag = int(fields[F_GU_ROWS] > 0 or fields[F_DOWN_RANK] > 0)
    values += fields
    values.append(flag)
    marks.moe[layer] = (fields[F_GU_ROWS], max(fields[F_S0_RANK], fields[F_S1_RANK]), fields[F_DOWN_RANK])
    marks.moe_slots[layer] = flag
