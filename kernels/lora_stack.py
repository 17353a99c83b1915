"""The dense LoRA expand reading ``h`` from a *shrink stack* (the A rows of a few adapters under W).

A shrink stack keeps, for one projection, the A matrices of up to K adapters as extra rows under
the base weight: ``ext [n + K*J*RB, D]`` (``W`` in rows ``[0, n)``, then entry ``e``'s slice ``j`` in
rows ``n + e*J*RB + j*RB`` onward, rows past the slice's rank zero).  One GEMM ``x @ ext.T`` then
gives the projection in its first n columns and ``h = round(x @ A.T)`` of every entry in the rest,
the shrink without a launch of its own.  `lora_expand_stacked` adds ``h @ B`` of each token's entry
(``entry_of_slot[slot]``) into the projection, reading B from the pool's pages as `lora.lora_expand`
does (the same kernel, told where h lies); `fill_entry` copies a slot's A rows into an entry out of
the pool's pages (one launch; `fill_entry_ref` is the torch version, both used by the engine).

Math, for token ``t`` with slot ``s >= 0``, ``e = entry_of_slot[s]`` and slice ``j`` of rank ``r > 0``::

    y[t, c_j : c_j + n_j] = round(y[t, c_j:c_j+n_j] + scale * h[t, e*J*RB + j*RB : ... + r] @ B[s, j])

``h`` is already rounded to the model dtype (the GEMM's output), as PEFT rounds its intermediate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unipage.adapter_pack import gather_block
from unipage.kernels.lora import (LoraShrink, StackedH, _check_tensor, _expand, _fail, check_inputs, check_pages,
                                  launch_args)
from unipage.kernels.lora_meta import DenseLoraMeta, LoraBatch
from unipage.kernels.launch import launch
from unipage.lora_layout import Block, round_up


def _check_stacked(y, h, entry_of_slot, pool, page_table, token_slots, meta: DenseLoraMeta, rank_block: int,
                   entries: int) -> None:
    check_inputs(y, None, pool, page_table, token_slots, meta)
    if rank_block < meta.max_rank:
        _fail("rank_block", f">= the largest rank {meta.max_rank}", rank_block)
    _check_tensor("h", h, (y.shape[0], entries * meta.num_slices * rank_block), y.dtype, y.device)
    _check_tensor("entry_of_slot", entry_of_slot, (None,), torch.int32, y.device)  # (indexed by the batch's slots)


def _stack_entries(h: torch.Tensor, meta: DenseLoraMeta, rank_block: int) -> int:
    width = meta.num_slices * rank_block
    if h.dim() != 2 or h.shape[1] % width:
        _fail("h", f"[T, K * {width}]", tuple(h.shape))
    return h.shape[1] // width


def lora_expand_stacked(y: torch.Tensor, h: torch.Tensor, entry_of_slot: torch.Tensor, pool: torch.Tensor,
                        page_table: torch.Tensor, token_slots: torch.Tensor, meta: DenseLoraMeta, *,
                        rank_block: int, batch: LoraBatch | None = None, scale: float = 1.0) -> torch.Tensor:
    """``y[t, slice j] += scale * h[t, entry j] @ B[s, j]`` (module docstring); returns y.

    y: ``[T, C]`` model dtype (row stride free, columns contiguous): the projection, updated in place.
    h: ``[T, K*J*rank_block]`` model dtype (row stride free): every stack entry's ``x @ A.T``.
    entry_of_slot: ``[>= S]`` int32: the entry holding each slot's A rows (read only for the batch's slots;
        -1: none, its tokens get no delta).
    pool, page_table, token_slots, meta, batch, scale: as for `lora.lora_shrink_expand`.
    rank_block: rows per slice in an entry (>= every rank).
    """
    entries = _stack_entries(h, meta, rank_block)
    _check_stacked(y, h, entry_of_slot, pool, page_table, token_slots, meta, rank_block, entries)
    count = y.shape[0]
    if count == 0 or meta.max_rank == 0:
        return y
    batch, plan, args = launch_args(h, pool, page_table, token_slots, meta, batch, None, False)
    layout = StackedH(entry_of_slot, h.stride(0), rank_block, meta.num_slices * rank_block)
    shrunk = LoraShrink(h, plan, args, meta, count, pool.dtype, batch, stacked=layout)
    return _expand(y, shrunk, scale, False)


def lora_expand_stacked_ref(y: torch.Tensor, h: torch.Tensor, entry_of_slot: torch.Tensor, pool: torch.Tensor,
                            page_table: torch.Tensor, token_slots: torch.Tensor, meta: DenseLoraMeta, *,
                            rank_block: int, batch: LoraBatch | None = None, scale: float = 1.0) -> torch.Tensor:
    """Torch reference of `lora_expand_stacked` (same signature and math; ``batch`` unused)."""
    entries = _stack_entries(h, meta, rank_block)
    _check_stacked(y, h, entry_of_slot, pool, page_table, token_slots, meta, rank_block, entries)
    slots = token_slots.tolist()
    bad = sorted({s for s in slots if not -1 <= s < meta.num_slots})
    if bad:
        _fail("token_slots", f"in [-1, {meta.num_slots})", bad)
    width = meta.num_slices * rank_block
    for slot in sorted(set(slots) - {-1}):
        rows = torch.tensor([t for t, s in enumerate(slots) if s == slot], device=y.device)
        if slot >= entry_of_slot.shape[0]:
            _fail("entry_of_slot", f"an entry for slot {slot}", entry_of_slot.shape[0])
        entry = int(entry_of_slot[slot])
        if not -1 <= entry < entries:
            _fail(f"entry_of_slot[{slot}]", f"in [-1, {entries})", entry)
        if entry < 0:
            continue  # (as the kernel: no entry, no delta)
        table = page_table[slot].long()
        for j, rank in enumerate(meta.ranks[slot]):
            if rank == 0:
                continue
            start = entry * width + j * rank_block
            b = gather_block(pool, table, Block(meta.b_offsets[slot][j], rank, meta.slice_cols[j])).float()
            cols = slice(meta.slice_starts[j], meta.slice_starts[j] + meta.slice_cols[j])
            delta = h[rows, start:start + rank].float() @ b
            y[rows, cols] = (y[rows, cols].float() + scale * delta).to(y.dtype)
    return y


FILL_BK = 256  # columns of one A row per fill program


@triton.jit(do_not_specialize=["slot"])  # (one compiled kernel for every slot)
def _fill_kernel(pool_ptr, table_ptr, rank_ptr, a_off_ptr, out_ptr, slot, d_in, a_stride, out_stride,
                 J: tl.constexpr, RB: tl.constexpr, LOG2_P: tl.constexpr, BK: tl.constexpr):
    row = tl.program_id(0)  # the entry's row: slice * RB + i
    piece, i = row // RB, row % RB
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    ok = cols < d_in
    live = ok & (cols * 0 + i < tl.load(rank_ptr + slot * J + piece))  # (vector form: the interpreter's)
    virt = tl.load(a_off_ptr + slot * J + piece) + i * a_stride + cols
    page = tl.load(table_ptr + (virt >> LOG2_P), mask=live, other=0)
    src = page.to(tl.int64) * (1 << LOG2_P) + (virt & ((1 << LOG2_P) - 1))
    a = tl.load(pool_ptr + src, mask=live, other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * out_stride + cols, a, mask=ok)


def _check_fill(rows, pool, page_table, meta: DenseLoraMeta, slot: int) -> int:
    """The entry's rank block; ValueError for a bad argument."""
    slices = meta.num_slices
    if rows.dim() != 2 or rows.shape[1] != meta.d_in or rows.shape[0] % slices or rows.stride(-1) != 1:
        _fail("rows", f"[J*RB, {meta.d_in}] with J = {slices}, columns contiguous", tuple(rows.shape))
    rank_block = rows.shape[0] // slices
    if meta.max_rank > rank_block:
        _fail("rows", f"a rank block >= the largest rank {meta.max_rank}", rank_block)
    check_pages(pool, page_table, meta)
    if rows.dtype != pool.dtype or rows.device != pool.device:
        _fail("rows", f"{pool.dtype} on {pool.device}", f"{rows.dtype} on {rows.device}")
    if not 0 <= slot < page_table.shape[0]:
        _fail("slot", f"in [0, {page_table.shape[0]})", slot)
    return rank_block


def fill_entry(rows: torch.Tensor, pool: torch.Tensor, page_table: torch.Tensor, meta: DenseLoraMeta,
               slot: int) -> None:
    """Copy slot ``slot``'s A rows of ``meta``'s slices into one stack entry, ``rows [J*RB, D]``
    (slice ``j`` from row ``j*RB``, ``RB = rows.shape[0] // J``; rows past each rank zeroed): one launch,
    reading the slot's ranks and A offsets from ``meta``'s device tables.

    pool: ``[N, P]`` one layer of the pool; page_table: ``[S, max_pages]`` int32."""
    rank_block = _check_fill(rows, pool, page_table, meta, slot)
    launch(_fill_kernel, (rows.shape[0], triton.cdiv(meta.d_in, FILL_BK)),
           pool, page_table[slot], meta.rank, meta.a_offset, rows, slot, meta.d_in, round_up(meta.d_in),
           rows.stride(0), J=meta.num_slices, RB=rank_block, LOG2_P=pool.shape[1].bit_length() - 1, BK=FILL_BK)


def fill_entry_ref(rows: torch.Tensor, pool: torch.Tensor, page_table: torch.Tensor, meta: DenseLoraMeta,
                   slot: int) -> None:
    """Torch version of `fill_entry` (same signature; the slot's ranks and offsets from ``meta``'s host rows,
    after the tables' refresh)."""
    rank_block = _check_fill(rows, pool, page_table, meta, slot)
    rows.zero_()
    table = page_table[slot].long()
    for j, rank in enumerate(meta.ranks[slot]):
        if rank:
            block = Block(meta.a_offsets[slot][j], rank, meta.d_in)
            rows[j * rank_block:j * rank_block + rank] = gather_block(pool, table, block)
