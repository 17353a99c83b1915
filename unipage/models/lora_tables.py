"""Per-slot LoRA tables of the resident adapters: page table and per-layer kernel metadata.

The adapter manager gives every resident adapter a slot; the kernels index a
``page_table [S, max_pages]`` int32 by slot and read, per layer and target
group, the offsets and ranks in a `DenseLoraMeta` (q/k/v together, o, gate/up
together, down) or a `MoeLoraMeta` (the experts).  `LoraTables` rebuilds all
of it when the slot assignment changes (a load or an eviction), never per step.

The tables are sized to capacities (slots and pages, powers of two) rather than
to the adapters resident now, and a rebuild whose launch-relevant shape — the
*signature*: capacities, slice widths, rank blocks, which layers have LoRA —
is unchanged writes the new values into the same device tensors.  A CUDA graph
captured over the tables (`unipage.graphs`) therefore serves any adapter mix;
`generation` changes only when the signature does, and then graphs are
captured again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from unipage.config import ModelConfig
from unipage.kernels import DenseLoraMeta, MoeLoraMeta, dense_lora_meta, moe_lora_meta
from unipage.kernels.fused_moe_lora import lora_pads
from unipage.kernels.lora_meta import next_pow2
from unipage.lora_layout import AdapterLayout

QKV = ("q_proj", "k_proj", "v_proj")
O = ("o_proj",)
GATE_UP = ("gate_proj", "up_proj")
DOWN = ("down_proj",)
MIN_SLOTS = 8  # slot capacity of the tables at least this (then doubling)
MIN_PAGES = 4


@dataclass
class LayerLora:
    qkv: DenseLoraMeta
    o: DenseLoraMeta
    gate_up: DenseLoraMeta | None  # dense MLP layers
    down: DenseLoraMeta | None
    moe: MoeLoraMeta | None  # MoE layers


class LoraTables:
    """Slot -> (pages, layout) and the tensors built from it."""

    def __init__(self, model: ModelConfig, device: torch.device) -> None:
        self.model, self.device = model, device
        self._slots: dict[int, tuple[tuple[int, ...], AdapterLayout]] = {}
        self._dirty = True
        self.page_table: torch.Tensor | None = None  # [S, max_pages] int32, S and max_pages capacities
        self.layers: list[LayerLora] = []
        self.generation = 0  # changes whenever the tables' signature (and so their tensors) change
        self._signature: tuple | None = None

    def assign(self, slot: int, pages, layout: AdapterLayout) -> None:
        self._slots[slot] = (tuple(pages), layout)
        self._dirty = True

    def release(self, slot: int) -> None:
        if self._slots.pop(slot, None) is not None:
            self._dirty = True

    @property
    def num_slots(self) -> int:
        """Rows of the tables: the slot capacity (a power of two >= MIN_SLOTS covering every slot)."""
        return max(MIN_SLOTS, next_pow2(1 + max(self._slots, default=-1)))

    def refresh(self) -> bool:
        """Rebuild after slot changes; False when no adapter is resident (no LoRA at all)."""
        if not self._slots:
            if self.page_table is not None:
                self.generation += 1
            self.page_table, self.layers, self._dirty, self._signature = None, [], False, None
            return False
        if self._dirty:
            self._build()
            self._dirty = False
        return True

    def _build(self) -> None:
        slots = self.num_slots
        width = max(MIN_PAGES, next_pow2(max(len(pages) for pages, _ in self._slots.values())))
        table = torch.zeros(slots, width, dtype=torch.int32)
        layouts: list[AdapterLayout | None] = [None] * slots
        for slot, (pages, layout) in self._slots.items():
            table[slot, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
            layouts[slot] = layout
        page_table = table.to(self.device)
        layers = [self._layer(layouts, layer) for layer in range(self.model.num_layers)]
        signature = (tuple(page_table.shape), tuple(_layer_signature(layer) for layer in layers))
        if signature == self._signature:
            self.page_table.copy_(page_table)
            self.layers = [_keep_tensors(new, old) for new, old in zip(layers, self.layers)]
        else:
            self.page_table, self.layers, self._signature = page_table, layers, signature
            self.generation += 1

    def _layer(self, layouts, layer: int) -> LayerLora:
        def meta(targets):
            return dense_lora_meta(layouts, layer, targets, self.device, self.model)

        if self.model.is_moe_layer(layer):
            return LayerLora(meta(QKV), meta(O), None, None, moe_lora_meta(layouts, layer, self.device))
        return LayerLora(meta(QKV), meta(O), meta(GATE_UP), meta(DOWN), None)


# -- signature: what the kernels' launches depend on besides tensor contents --------


def _dense_signature(meta: DenseLoraMeta | None) -> tuple | None:
    if meta is None:
        return None
    return meta.targets, meta.d_in, meta.slice_cols, meta.slice_starts, meta.rank_block, meta.max_rank > 0


def _moe_signature(meta: MoeLoraMeta | None) -> tuple | None:
    if meta is None:
        return None
    return meta.hidden, meta.inter, meta.num_experts, lora_pads(meta), meta.any_lora


def _layer_signature(layer: LayerLora) -> tuple:
    dense = tuple(_dense_signature(m) for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
    return dense, _moe_signature(layer.moe)


def _keep_tensors(new: LayerLora, old: LayerLora) -> LayerLora:
    """``new``'s values written into ``old``'s tensors (same signature): the metadata of ``new``
    with the device tensors a captured graph already points at."""
    def dense(n: DenseLoraMeta | None, o: DenseLoraMeta | None):
        if n is None:
            return None
        for name in ("rank", "a_offset", "b_offset"):
            getattr(o, name).copy_(getattr(n, name))
        return dataclasses.replace(n, rank=o.rank, a_offset=o.a_offset, b_offset=o.b_offset, col_tiles=o.col_tiles)

    def moe(n: MoeLoraMeta | None, o: MoeLoraMeta | None):
        if n is None:
            return None
        o.table.copy_(n.table)
        o.slot_flags.copy_(n.slot_flags)
        return dataclasses.replace(n, table=o.table, slot_flags=o.slot_flags)

    return LayerLora(dense(new.qkv, old.qkv), dense(new.o, old.o), dense(new.gate_up, old.gate_up),
                     dense(new.down, old.down), moe(new.moe, old.moe))
