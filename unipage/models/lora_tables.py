"""Per-slot LoRA tables of the resident adapters: page table and per-layer kernel metadata.

The adapter manager gives every resident adapter a slot; the kernels index a
``page_table [S, max_pages]`` int32 by slot and read, per layer and target
group, the offsets and ranks in a `DenseLoraMeta` (q/k/v together, o, gate/up
together, down) or a `MoeLoraMeta` (the experts).  `LoraTables` rebuilds all
of it when the slot assignment changes (a load or an eviction), never per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unipage.config import ModelConfig
from unipage.kernels import DenseLoraMeta, MoeLoraMeta, dense_lora_meta, moe_lora_meta
from unipage.lora_layout import AdapterLayout

QKV = ("q_proj", "k_proj", "v_proj")
O = ("o_proj",)
GATE_UP = ("gate_proj", "up_proj")
DOWN = ("down_proj",)


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
        self.page_table: torch.Tensor | None = None  # [S, max_pages] int32
        self.layers: list[LayerLora] = []

    def assign(self, slot: int, pages, layout: AdapterLayout) -> None:
        self._slots[slot] = (tuple(pages), layout)
        self._dirty = True

    def release(self, slot: int) -> None:
        if self._slots.pop(slot, None) is not None:
            self._dirty = True

    @property
    def num_slots(self) -> int:
        return 1 + max(self._slots, default=-1)

    def refresh(self) -> bool:
        """Rebuild after slot changes; False when no adapter is resident (no LoRA at all)."""
        if not self._slots:
            self.page_table, self.layers, self._dirty = None, [], False
            return False
        if self._dirty:
            self._build()
            self._dirty = False
        return True

    def _build(self) -> None:
        slots = self.num_slots
        width = max(len(pages) for pages, _ in self._slots.values())
        table = torch.zeros(slots, width, dtype=torch.int32)
        layouts: list[AdapterLayout | None] = [None] * slots
        for slot, (pages, layout) in self._slots.items():
            table[slot, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
            layouts[slot] = layout
        self.page_table = table.to(self.device)
        self.layers = [self._layer(layouts, layer) for layer in range(self.model.num_layers)]

    def _layer(self, layouts, layer: int) -> LayerLora:
        def meta(targets):
            return dense_lora_meta(layouts, layer, targets, self.device, self.model)

        if self.model.is_moe_layer(layer):
            return LayerLora(meta(QKV), meta(O), None, None, moe_lora_meta(layouts, layer, self.device))
        return LayerLora(meta(QKV), meta(O), meta(GATE_UP), meta(DOWN), None)
