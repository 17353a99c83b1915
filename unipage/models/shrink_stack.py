"""Shrink stacks: the dense LoRA shrink of small steps folded into the projections' GEMMs.

For every layer's q/k/v and o projections, a `ShrinkStack` keeps the base weight W and the A rows
of up to K adapters in one buffer ``ext [n + K*J*RB, D]`` (layout in `unipage.kernels.lora_stack`);
the layer's weight and bias become views of ext's first n rows, so W is not held twice.  A step of
at most ``max_tokens`` tokens with LoRA then runs ``x @ ext.T`` — the projection and every entry's
``h = x @ A.T`` in one cuBLAS GEMM — and `lora_expand_stacked`, instead of the paged shrink kernel:
one launch fewer per projection.  The paged shrink still serves larger steps, and B stays in the pool.

Entries.  `prepare`, before such a step's forward pass, gives each adapter slot of the step an entry:
a slot not in the stack gets the least recently used entry that the step does not need, and its A
rows are copied there from the pool's pages (every layer, on the current stream, so after whatever
the GPU still runs of earlier steps); ``entry_of_slot`` (device) is uploaded when it changed.  `forget`
drops a slot's entry when its adapter is loaded or evicted, so a slot reused by another adapter is
copied again.  K = the scheduler's ``max_adapters_per_batch``: every step fits.

A stack is made only where its rows are few beside W's (at most ``MAX_EXTRA`` of them, for q/k/v
and for o), so the GEMM reads little more than before; `build` returns None otherwise.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from unipage.kernels import fill_entry
from unipage.kernels.lora_meta import next_pow2

MAX_TOKENS = 256  # steps of at most this many tokens use the stack (decode batches)
MAX_EXTRA = 0.25  # a stack's rows at most this fraction of W's rows
GROUPS = (("qkv", "w_qkv", "b_qkv", 3), ("o", "w_o", "b_o", 1))  # name, weight, bias, slices J


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


class ShrinkStack:
    """The stacks of every layer's q/k/v and o, and which adapter slot sits in which entry."""

    def __init__(self, layers: list, entries: int, max_rank: int, max_slots: int,
                 max_tokens: int = MAX_TOKENS) -> None:
        """Moves each layer's ``w_qkv``/``b_qkv`` and ``w_o``/``b_o`` into stacks (`LayerWeights`: they
        become views) and sets the layer's ``qkv_stack`` and ``o_stack``.  ``max_slots`` bounds the adapter
        slots (slots are reused lowest first, so the pool's page count bounds them): ``entry_of_slot``
        is made once at that size, so the CUDA graphs that read it never see it move."""
        if entries < 1:
            raise ValueError(f"a shrink stack needs at least one entry, got {entries}")
        self.entries, self.rank_block, self.max_tokens = entries, rank_block(max_rank), max_tokens
        self.layers = layers
        for layer in layers:
            for name, weight, bias, slices in GROUPS:
                setattr(layer, f"{name}_stack", self._stack(layer, weight, bias, slices))
        self.entry_of_slot = torch.full((max_slots,), -1, dtype=torch.int32, device=layers[0].w_qkv.device)
        self._host = np.full(max_slots, -1, dtype=np.int32)
        self._entry: OrderedDict[int, int] = OrderedDict()  # slot -> entry, least recently used first
        self.fills = 0  # entries filled so far (one per adapter brought into the stack)

    @classmethod
    def build(cls, model, entries: int, max_rank: int, max_slots: int) -> ShrinkStack | None:
        """A stack over ``model``'s (`DecoderLM`) layers if `fits`, else None; the model then uses it."""
        first = model.layers[0]
        if not fits(first.w_qkv.shape[0], first.w_o.shape[0], entries, max_rank):
            return None
        model.stack = cls(model.layers, entries, max_rank, max_slots)
        return model.stack

    def _stack(self, layer, weight: str, bias: str, slices: int) -> StackedWeight:
        w, b = getattr(layer, weight), getattr(layer, bias)
        n, width = w.shape[0], slices * self.rank_block
        ext = torch.zeros(n + self.entries * width, w.shape[1], dtype=w.dtype, device=w.device)
        ext[:n] = w
        ext_bias = None
        if b is not None:
            ext_bias = torch.zeros(ext.shape[0], dtype=b.dtype, device=b.device)
            ext_bias[:n] = b
            setattr(layer, bias, ext_bias[:n])
        setattr(layer, weight, ext[:n])  # the old W goes with its last reference
        return StackedWeight(ext, ext_bias, n, width)

    # -- entries -----------------------------------------------------------------
    def prepare(self, slots, tables, pool: torch.Tensor, layer_rows) -> None:
        """Give every slot in ``slots`` an entry (filling those not in the stack from ``tables``' pages of
        ``pool [L, N, P]``, layer ``i`` in row ``layer_rows[i]``); after ``tables.refresh()``."""
        needed = set(slots)
        if len(needed) > self.entries:
            raise RuntimeError(f"{len(needed)} adapters in one step, but the shrink stack holds {self.entries} "
                               "(max_adapters_per_batch)")
        if max(needed) >= self._host.shape[0]:
            raise RuntimeError(f"adapter slot {max(needed)} beyond the shrink stack's {self._host.shape[0]}")
        changed = False
        for slot in sorted(needed - self._entry.keys()):
            entry = self._free_entry(needed)
            self._fill(entry, slot, tables, pool, layer_rows)
            self._entry[slot] = entry
            self._host[slot] = entry
            changed = True
        for slot in needed:
            self._entry.move_to_end(slot)
        if changed:
            self.entry_of_slot.copy_(torch.from_numpy(self._host))

    def forget(self, slot: int) -> None:
        """Slot ``slot`` now holds another adapter, or none: its entry is free."""
        self._entry.pop(slot, None)

    def _free_entry(self, needed: set[int]) -> int:
        taken = set(self._entry.values())
        free = [e for e in range(self.entries) if e not in taken]
        if free:
            return free[0]
        victim = next(s for s in self._entry if s not in needed)  # least recently used first
        return self._entry.pop(victim)

    def _fill(self, entry: int, slot: int, tables, pool: torch.Tensor, layer_rows) -> None:
        for i, layer in enumerate(self.layers):
            lora = tables.layers[i]
            for name, _, _, slices in GROUPS:
                meta = getattr(lora, name)
                if meta.num_slices != slices:
                    raise RuntimeError(f"layer {i} {name}: {meta.num_slices} LoRA slices, the stack has {slices}")
                fill_entry(getattr(layer, f"{name}_stack").entry_rows(entry), pool[layer_rows[i]],
                           tables.page_table, meta, slot)
        self.fills += 1
