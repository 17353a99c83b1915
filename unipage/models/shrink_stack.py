"""Shrink stacks: the dense LoRA shrink of small steps folded into the projections' GEMMs.

For every layer's q/k/v and o projections, a `ShrinkStack` keeps the base weight W and the A rows
of up to K adapters in one buffer ``ext [n + K*J*RB, D]`` (layout in `unipage.kernels.lora_stack`);
the layer's weight and bias become views of ext's first n rows, so W is not held twice.  A step of
at most ``max_tokens`` tokens with LoRA (`covers`) then runs ``x @ ext.T`` — the projection and every
entry's ``h = x @ A.T`` in one GEMM (`Ops.linear`) — and `lora_expand_stacked`, instead of the paged shrink
kernel: one launch fewer per projection.  Larger steps take the paged shrink; B stays in the pool.

Entries.  `prepare`, before such a step's forward pass, gives each adapter slot of the step an entry
(`Entries`: a slot not in the stack takes a free entry, else the least recently used one the step does
not need) and copies the A rows of the slots new to the stack from the pool's pages (every layer, on the
current stream, so after whatever the GPU still runs of earlier steps); ``entry_of_slot`` (device) is
uploaded when it changed.  `forget` drops a slot's entry when its adapter is loaded or evicted, so a
slot reused by another adapter is copied again.  K = the scheduler's ``max_adapters_per_batch``: every
step fits.

A stack is made only where its rows are few beside W's (at most ``MAX_EXTRA`` of them, for q/k/v
and for o), so the GEMM reads little more than before; `build` returns None otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from unipage.kernels.lora_meta import next_pow2
from unipage.models.entry_table import EntryTable, StackError

MAX_TOKENS = 256  # steps of at most this many tokens use the stack (decode batches)
MAX_EXTRA = 0.25  # a stack's rows at most this fraction of W's rows
GROUPS = (("qkv", "w_qkv", "b_qkv", 3), ("o", "w_o", "b_o", 1))  # name, weight, bias, slices J


ShrinkStackError = StackError  # (the entries' errors: more adapters than entries, a slot out of range)


@dataclass
class StackedWeight:
    """One projection's ``ext`` (W in rows ``[0, n)``, then K entries of ``width = J*RB`` rows)."""

    ext: torch.Tensor  # [n + K*width, D]
    bias: torch.Tensor | None  # [n + K*width], zero past n; None if the projection has no bias
    n: int
    width: int

    def entry_rows(self, entry: int) -> torch.Tensor:
        start = self.n + entry * self.width
        return self.ext[start:start + self.width]


def rank_block(max_rank: int) -> int:
    """Rows per slice in an entry: the largest rank allowed, a power of two, at least 16."""
    return max(16, next_pow2(max_rank))


def fits(n_qkv: int, n_o: int, entries: int, max_rank: int) -> bool:
    """Whether a stack of ``entries`` entries is small enough beside q/k/v's and o's rows (`MAX_EXTRA`)."""
    rb = rank_block(max_rank)
    return entries * 3 * rb <= MAX_EXTRA * n_qkv and entries * rb <= MAX_EXTRA * n_o


class ShrinkStack(EntryTable):
    """The stacks of every layer's q/k/v and o, and which adapter slot sits in which entry."""

    def __init__(self, layers: list, entries: int, max_rank: int, fill: Callable,
                 max_tokens: int = MAX_TOKENS) -> None:
        """Moves each layer's ``w_qkv``/``b_qkv`` and ``w_o``/``b_o`` into stacks (`LayerWeights`: they
        become views) and sets the layer's ``qkv_stack`` and ``o_stack``.  ``fill``: `kernels.fill_entry`
        or its reference (the model's `Ops`).  `set_slots` must follow."""
        super().__init__(entries, layers[0].w_qkv.device, "the shrink stack (max_adapters_per_batch)")
        self.rank_block, self.max_tokens, self._fill_entry = rank_block(max_rank), max_tokens, fill
        self.layers = layers
        for layer in layers:
            for name, weight, bias, slices in GROUPS:
                setattr(layer, f"{name}_stack", self._stack(layer, weight, bias, slices))

    @classmethod
    def build(cls, layers: list, entries: int, max_rank: int, fill: Callable) -> ShrinkStack | None:
        """A stack over ``layers`` (`DecoderLM.layers`) if `fits`, else None (the layers untouched)."""
        if not fits(layers[0].w_qkv.shape[0], layers[0].w_o.shape[0], entries, max_rank):
            return None
        return cls(layers, entries, max_rank, fill)

    def covers(self, tokens: int) -> bool:
        """Whether a step (or graph bucket) of ``tokens`` tokens with LoRA runs through the stack."""
        return tokens <= self.max_tokens

    def _stack(self, layer, weight: str, bias: str, slices: int) -> StackedWeight:
        w, b = getattr(layer, weight), getattr(layer, bias)
        n, width = w.shape[0], slices * self.rank_block
        ext = torch.zeros(n + self.entries.count * width, w.shape[1], dtype=w.dtype, device=w.device)
        ext[:n] = w
        ext_bias = None
        if b is not None:
            ext_bias = torch.zeros(ext.shape[0], dtype=b.dtype, device=b.device)
            ext_bias[:n] = b
            setattr(layer, bias, ext_bias[:n])
        setattr(layer, weight, ext[:n])  # the old W goes with its last reference
        return StackedWeight(ext, ext_bias, n, width)

    def _fill(self, entry: int, slot: int, tables, pool: torch.Tensor, layer_rows) -> None:
        for i, layer in enumerate(self.layers):
            lora = tables.layers[i]
            for name, _, _, slices in GROUPS:
                meta = getattr(lora, name)
                if meta.num_slices != slices:
                    raise ShrinkStackError(f"layer {i} {name}: {meta.num_slices} LoRA slices, the stack has {slices}")
                self._fill_entry(getattr(layer, f"{name}_stack").entry_rows(entry), pool[layer_rows[i]],
                                 tables.page_table, meta, slot)
