"""MoE LoRA stacks: the expert LoRA of up to M adapters held densely beside the pool, one stack per MoE layer
(`kernels.moe_lora_stack`), which the base expert GEMMs take as an extra K block in the steps that use them.

The paged MoE LoRA kernels find every pair's weights through its slot's metadata and page table, a chain of
dependent loads per program or tile; from a stack the LoRA is plain grouped-GEMM work.  A stack entry of
Qwen3-30B-A3B at rank 8 takes about 1 GB over its 48 layers (the gate/up A rows of both slices, every B
column of each, the down A and B: zeros where a slice has none), so the number of entries is a setting
(`LoRAConfig.moe_stack_entries`, 0 = none), and the buffers are made before the pool takes its share of the
free memory.

Entries (`entry_table.EntryTable`): before a step that may use the stacks (`covers` at its graph bucket and its
distinct adapters: `covers` grows with tokens and shrinks with adapters, and a graph's bucket and adapter class
are no smaller than its step's), the runner gives each of its adapter slots an entry, copying the weights of slots
new to the stacks from the pool's pages (`_fill`: every MoE layer, on the current stream). A step uses them
(`covers`) when its adapters (its graph's class bound in CUDA graphs) fit the entries and the routed pairs per
(adapter, expert) group reach `MIN_LOAD`: a stack's extra K block reads every entry's weights of each expert tile
holding it, where the paged kernels read one adapter's per pair, so at a few pairs per group the paged kernels win
(GPT-OSS-20B, 16 tokens of 8 adapters: 390.4 against 353.8 us a layer; Qwen3-30B-A3B, 256 tokens of 4 adapters:
353.2 against 370.9; `kernels-moe-h200.jsonl`). The rule counts every token of the step, those without an adapter
too: a step of many base-model tokens and a few with adapters takes the stacks, whose shrinks then run over all
its pairs (the paged kernels touch only the LoRA pairs). Entries are as wide as ``max_rank`` allows (the gate/up A
rows of two slices), whatever the adapters' own ranks. A fill gathers one slot's expert groups of a layer at a
time (about 17 MB at Qwen3-30B-A3B's rank 8) out of the memory the pool leaves free.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from unipage.config import ModelConfig
from unipage.kernels.moe_align import FIELDS, slot_fields
from unipage.kernels.moe_lora_stack import empty_stack, fill_entry
from unipage.lora_layout import AdapterLayout
from unipage.models.entry_table import EntryTable, StackError

MIN_LOAD = 2.0  # routed pairs per (adapter, expert) group from which a step takes the stacks


class MoeStacks(EntryTable):
    """The MoE layers' stacks (each layer's ``moe_stack``) and which adapter slot sits in which entry."""

    def __init__(self, layers: list, model: ModelConfig, entries: int, max_rank: int) -> None:
        """Gives every MoE layer of ``layers`` (`DecoderLM.layers`) a zeroed ``moe_stack`` of ``entries`` entries
        for adapters of rank at most ``max_rank``.  `set_slots` must follow."""
        moe = [layer for layer in layers if layer.router is not None]
        if not moe:
            raise ValueError("MoE LoRA stacks need a model with MoE layers")
        super().__init__(entries, moe[0].experts_gate_up.device, "the MoE LoRA stacks (moe_stack_entries)")
        self.layers, self.experts, self.top_k = moe, model.num_experts, model.top_k
        self.indices = [i for i, layer in enumerate(layers) if layer.router is not None]
        self._layouts: dict[int, AdapterLayout] = {}  # slot -> its adapter's layout
        placeholder = torch.empty(0, dtype=torch.int32, device=self.device)  # (`set_slots` sets the map)
        for layer in moe:
            experts, two_inter, hidden = layer.experts_gate_up.shape
            layer.moe_stack = empty_stack(entries, experts, hidden, two_inter // 2, 2 * max_rank, max_rank,
                                          placeholder, layer.experts_gate_up.dtype)

    def set_slots(self, max_slots: int) -> None:
        super().set_slots(max_slots)
        for layer in self.layers:
            layer.moe_stack = replace(layer.moe_stack, entry_of_slot=self.entry_of_slot)

    def covers(self, tokens: int, adapters: int | None) -> bool:
        """Whether a step (or graph) of ``tokens`` tokens over at most ``adapters`` adapters uses the stacks."""
        return bool(adapters) and adapters <= self.entries.count \
            and tokens * self.top_k >= MIN_LOAD * adapters * self.experts

    def assign(self, slot: int, layout: AdapterLayout) -> None:
        """Slot ``slot`` now holds the adapter of ``layout`` (in the pages the LoRA tables give): its entry, if
        any, is stale."""
        self._layouts[slot] = layout
        self.forget(slot)

    def release(self, slot: int) -> None:
        """Slot ``slot`` holds no adapter now."""
        self._layouts.pop(slot, None)
        self.forget(slot)

    def _fill(self, entry: int, slot: int, tables, pool: torch.Tensor, layer_rows) -> None:
        if slot not in self._layouts:
            raise StackError(f"adapter slot {slot} holds no adapter the MoE LoRA stacks know of")
        layout, pages = self._layouts[slot], tables.page_table[slot].long()
        for i, layer in zip(self.indices, self.layers):
            fields = slot_fields(layout.layers[i]) or [0] * len(FIELDS)
            fill_entry(layer.moe_stack, entry, pool[layer_rows[i]], pages, dict(zip(FIELDS, fields)))

