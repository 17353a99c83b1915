"""Paged LoRA shrink/expand for dense linear layers, reading A and B from pool pages.

Shape legend: T = tokens, S = adapter slots, J = output slices of one call
(q, k, v), N = pool pages, P = page_elems, D = d_in, C = output columns of all
slices, RB = rank block (largest rank padded to a power of two >= 16).

Math — for every token ``t`` with slot ``s = token_slots[t] >= 0`` and every
slice ``j`` whose rank ``r = rank[s, j]`` is > 0::

    h = round(x[t] @ A[s, j].T)                                  # [r]   shrink
    y[t, c_j : c_j + n_j] = round(y[t, c_j:c_j+n_j] + scale * h @ B[s, j])   # expand

with ``A[s, j]`` ``[r, D]`` and ``B[s, j]`` ``[r, n_j]`` read from the slot's
pages (the LoRA scaling is already folded into B), products accumulated in
fp32 and ``round`` to the model dtype (as PEFT does with its intermediate).
Tokens with slot -1 and slices of rank 0 are left bit-identical.

Two kernels, each with two paths chosen by the `LoraBatch` plan:

* shrink — programs ``(row tile, K split, stacked-row block)``.  The A rows of
  all slices are stacked (row ``j * RB + i`` = row ``i`` of slice ``j``), so
  one pass over x serves q, k and v.  Split-K fills the GPU when the token
  count is small; partial sums go to ``part [split, T, J*RB]`` fp32 (no
  atomics, no zeroing).
* expand — programs ``(row tile, column tile)``; a column tile lies inside one
  slice.  It sums the K splits of ``h``, rounds it, multiplies by B and adds
  into ``y`` in the epilogue.

On Hopper+ the expand is a programmatic dependent launch of the shrink
(config ``"pdl"``, default on): its programs start and read their tile
metadata (on the GEMV path also their B tile and ``y``) while the shrink
finishes, and wait (``gdc_wait``) only before reading the partials.  Reading
``y`` early is safe because the shrink starts its dependents only once
whatever wrote ``y`` has finished (a plain shrink starts after it; an early
one, below, triggers them after waiting for it) and nothing writes ``y``
between the two launches.  A program with no work waits too before it exits,
so the expand never completes before the shrink.

``early=True`` makes the shrink itself a programmatic dependent of the kernel
before it (in the engine: the base projection ``x @ W.T``): its programs read
their tile, rank, A offsets and page translations while that kernel drains,
then wait for it before reading ``x``.

GEMV path: a row tile is one token (decode).  Grouped path: a row tile is
``block_m`` tokens of one adapter, gathered through ``token_order``, and the
products use ``tl.dot``.

Paging: every tile is loaded in 64-column runs.  A run starts 64-aligned in
a row whose stride is a multiple of 64, so it lies in one page: its physical
offset is ``page_table[slot, v >> log2 P] * P + (v & (P - 1))`` and the 64
elements follow contiguously.  The expand translates once per (row, run).  The
shrink translates before its K loop whenever a split's K range is at most one
page (``k_per_split <= P``): each A row's range then spans at most two pages,
and a run picks one of the two bases with a compare.  Looked up inside the
loop, each A copy waited on a page-table copy that the pipeliner had put one
stage ahead of it; with the few K steps of a split that chain was not hidden
(H100, Llama-3.1-8B qkv r16, 256 tokens: shrink 13.9 us paged against 10.9 us
contiguous; hoisted 11.6 us).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from unipage.kernels.common import finish_early, gdc_launch_dependents, gdc_wait, load_runs
from unipage.kernels.launch import launch
from unipage.kernels.lora_meta import DenseLoraMeta, LoraBatch, plan_lora_batch
from unipage.kernels.lora_plan import LoraPlan, cached_plan
from unipage.kernels.lora_plan import fail as _fail

from unipage.adapter_pack import gather_block
from unipage.lora_layout import Block, round_up

# The GEMV path's expand (one token per tile) loads its tile whole; grouped tiles go 64 columns at
# a time.  Measured on the H100 (Llama-3.1-8B, r16, 16 adapters, whole tiles against runs): GEMV
# rows 10-24 % faster at 1 and 16 tokens for q/k/v, o, gate/up and down (qkv at 1 token 9.7 ->
# 8.5 us, down 12.7 -> 10.0 us); grouped tiles from -6 % to +12 % (16 x 128 gate/up at 64 tokens
# the worst) and 64 x 128 / 64 x 256 tiles 5-20 % slower.
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# Kernel arguments (legend above):
#   x_ptr [T, D], y_ptr [T, C]: model dtype, rows x_stride / y_stride apart, columns contiguous
#   pool_ptr [N, P]: model dtype;  table_ptr [S, max_pages] int32, rows table_stride apart
#   token_slots_ptr [T] int32;  tiles_ptr [M, 3] int32 (slot, first, end);  order_ptr [T] int64
#   rank_ptr, a_off_ptr, b_off_ptr [S, J] int32;  part_ptr [split_k, T, J*RB] fp32
#   col_tiles_ptr [n_tiles, 4] int32 (slice, first column in slice, slice width, y column of slice)
# On the GEMV path tiles_ptr / order_ptr are unused (token_slots is passed in their place).


@triton.jit
def _row_tile(pid, token_slots_ptr, tiles_ptr, order_ptr, BM: tl.constexpr, GROUPED: tl.constexpr):
    """``(slot, token ids [BM] int64, row mask [BM])`` of row tile ``pid``."""
    if GROUPED:
        slot = tl.load(tiles_ptr + pid * 3)
        first = tl.load(tiles_ptr + pid * 3 + 1)
        end = tl.load(tiles_ptr + pid * 3 + 2)
        m = first + tl.arange(0, BM)
        m_ok = m < end
        tok = tl.load(order_ptr + m, mask=m_ok, other=0)
    else:
        slot = tl.load(token_slots_ptr + pid)
        tok = (pid + tl.arange(0, BM)).to(tl.int64)
        m_ok = tok == pid
    return slot, tok, m_ok


@triton.jit
def _run_starts(table, virt, ok, LOG2_P: tl.constexpr, PAGED: tl.constexpr):
    """Pool element offsets (int64) of the 64-element runs starting at virtual elements ``virt``."""
    if PAGED:
        page = tl.load(table + (virt >> LOG2_P), mask=ok, other=0)
        start = page.to(tl.int64) * (1 << LOG2_P) + (virt & ((1 << LOG2_P) - 1))
    else:  # the slot's buffer is contiguous from its first page
        start = tl.load(table).to(tl.int64) * (1 << LOG2_P) + virt
    return tl.multiple_of(start, 64)  # runs start 64-aligned: lets the loads vectorize


@triton.jit
def _page_pair(table, virt_lo, virt_hi, ok, LOG2_P: tl.constexpr, PAGED: tl.constexpr):
    """``(edge, base_lo, base_hi)``: the run at virtual element ``v`` in ``[virt_lo, virt_hi)`` starts
    at pool element ``(base_lo if v < edge else base_hi) + v``.  Needs ``virt_hi - virt_lo <= P``:
    the range then lies in at most two pages, looked up here once instead of once per run."""
    if PAGED:
        page = virt_lo >> LOG2_P
        edge = (page + 1) << LOG2_P
        lo = tl.load(table + page, mask=ok, other=0)
        hi = tl.load(table + page + 1, mask=ok & (edge < virt_hi), other=0)  # only if the range crosses
        base_lo = (lo.to(tl.int64) - page) << LOG2_P
        base_hi = (hi.to(tl.int64) - page - 1) << LOG2_P
    else:  # the slot's buffer is contiguous from its first page
        edge = virt_hi
        base_lo = tl.load(table).to(tl.int64) << LOG2_P
        base_hi = base_lo
    return edge, base_lo, base_hi


@triton.jit
def _pair_start(edge, base_lo, base_hi, virt):
    """Pool element offsets (int64) of the runs at ``virt``, from `_page_pair`'s translation."""
    return tl.multiple_of(tl.where(virt < edge, base_lo, base_hi) + virt, 64)


@triton.jit
def _product(h, b, GROUPED: tl.constexpr, FP32: tl.constexpr):
    """``h [BM, R] @ b [R, C]`` in fp32: a tensor-core dot for grouped tiles, a broadcast-reduce for one token."""
    if GROUPED:
        if FP32:
            out = tl.dot(h, b, input_precision="ieee")
        else:
            out = tl.dot(h, b)
    else:
        out = tl.sum(h.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return out


@triton.jit(do_not_specialize=["num_tokens"])
def _shrink_kernel(
    x_ptr, x_stride, pool_ptr, table_ptr, table_stride,
    token_slots_ptr, tiles_ptr, order_ptr, rank_ptr, a_off_ptr, part_ptr,
    num_tokens, d_in, a_stride, k_per_split,
    J: tl.constexpr, RB: tl.constexpr, ROWS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    GROUPED: tl.constexpr, EVEN_K: tl.constexpr, PAGED: tl.constexpr, LOG2_P: tl.constexpr,
    FP32: tl.constexpr, USE_PDL: tl.constexpr, HOIST: tl.constexpr, WAIT_PRIOR: tl.constexpr,
):
    if USE_PDL and not WAIT_PRIOR:
        gdc_launch_dependents()  # the expand may start its prologue now
    slot, tok, m_ok = _row_tile(tl.program_id(0), token_slots_ptr, tiles_ptr, order_ptr, BM, GROUPED)
    if slot < 0:
        finish_early(WAIT_PRIOR)
        return
    row = tl.program_id(2) * ROWS + tl.arange(0, ROWS)  # stacked row: slice * RB + i
    piece, i = row // RB, row % RB
    piece_ok = piece < J
    rank = tl.load(rank_ptr + slot * J + piece, mask=piece_ok, other=0)
    if tl.max(rank, 0) == 0:
        finish_early(WAIT_PRIOR)
        return  # no slice of this block exists for the slot; expand skips it too
    row_ok = i < rank
    row_virt = tl.load(a_off_ptr + slot * J + piece, mask=piece_ok, other=0) + i * a_stride
    table = table_ptr + slot.to(tl.int64) * table_stride
    x_rows = x_ptr + tok[:, None] * x_stride
    cols = tl.arange(0, 64)
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, d_in)
    if HOIST:  # the split's K range of a row spans at most two pages: translate them once
        edge, base_lo, base_hi = _page_pair(table, row_virt + k_lo, row_virt + k_hi, row_ok, LOG2_P, PAGED)
    if WAIT_PRIOR:  # launched early: everything above overlapped the kernel before, which wrote x
        gdc_wait()
        if USE_PDL:
            gdc_launch_dependents()  # only now: the expand reads what that kernel wrote (y) before it waits
    acc = tl.zeros((BM, ROWS), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        for r in tl.static_range(BK // 64):
            k = tl.multiple_of(k0 + r * 64, 64)
            if EVEN_K:
                x = tl.load(x_rows + k + cols[None, :], mask=m_ok[:, None], other=0.0)
                if HOIST:
                    start = _pair_start(edge, base_lo, base_hi, row_virt + k)
                else:
                    start = _run_starts(table, row_virt + k, row_ok, LOG2_P, PAGED)
                a = tl.load(pool_ptr + start[:, None] + cols[None, :], mask=row_ok[:, None], other=0.0)
            else:
                k_ok = k + cols < d_in
                x = tl.load(x_rows + k + cols[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                if HOIST:
                    start = _pair_start(edge, base_lo, base_hi, row_virt + k)
                else:
                    run_ok = row_ok & (row * 0 + k < d_in)  # vector form: the interpreter rejects bool scalars here
                    start = _run_starts(table, row_virt + k, run_ok, LOG2_P, PAGED)
                a = tl.load(pool_ptr + start[:, None] + cols[None, :],
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if GROUPED:
                if FP32:
                    acc += tl.dot(x, tl.trans(a), input_precision="ieee")
                else:
                    acc += tl.dot(x, tl.trans(a))
            else:
                acc += tl.sum(x.to(tl.float32)[:, None, :] * a.to(tl.float32)[None, :, :], axis=2)
    part = part_ptr + (tl.program_id(1) * num_tokens + tok[:, None]) * (J * RB) + row[None, :]
    tl.store(part, acc, mask=m_ok[:, None] & piece_ok[None, :])


@triton.jit
def _sum_splits(part_rows, i, m_ok, i_ok, split_k, split_stride, SPLITS: tl.constexpr):
    """``h [BM, RK]`` fp32: the Split-K partials of rows ``i``, summed in one vector load."""
    split = tl.arange(0, SPLITS)
    ptrs = part_rows[None, :, :] + split[:, None, None] * split_stride + i[None, None, :]
    mask = (split < split_k)[:, None, None] & m_ok[None, :, None] & i_ok[None, None, :]
    return tl.sum(tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), axis=0)  # (a stack's h is bf16/fp16)


@triton.jit(do_not_specialize=["num_tokens", "split_k"])
def _expand_kernel(
    y_ptr, y_stride, pool_ptr, table_ptr, table_stride,
    token_slots_ptr, tiles_ptr, order_ptr, rank_ptr, b_off_ptr, part_ptr, col_tiles_ptr,
    num_tokens, split_k, scale, entry_ptr, part_row, part_piece, entry_stride,
    J: tl.constexpr, RB: tl.constexpr, RK: tl.constexpr, SPLITS: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, WIDE: tl.constexpr, Y_DIV: tl.constexpr, GROUPED: tl.constexpr, EVEN_N: tl.constexpr,
    PAGED: tl.constexpr, LOG2_P: tl.constexpr, FP32: tl.constexpr, USE_PDL: tl.constexpr,
    ENTRY: tl.constexpr = False,
):
    slot, tok, m_ok = _row_tile(tl.program_id(0), token_slots_ptr, tiles_ptr, order_ptr, BM, GROUPED)
    if slot < 0:
        finish_early(USE_PDL)
        return
    entry = 0
    if ENTRY:  # h of the slot's entry in a shrink stack (`lora_stack`); -1: none, add nothing
        entry = tl.load(entry_ptr + slot)
    if entry < 0:
        finish_early(USE_PDL)
        return
    col_tile = col_tiles_ptr + tl.program_id(1) * 4
    piece = tl.load(col_tile)
    rank = tl.load(rank_ptr + slot * J + piece)
    if rank == 0:
        finish_early(USE_PDL)
        return  # the slot's adapter lacks this target
    n_lo = tl.multiple_of(tl.load(col_tile + 1), 64)
    width = tl.load(col_tile + 2)
    y_rows = y_ptr + tok[:, None] * y_stride + tl.multiple_of(tl.load(col_tile + 3), Y_DIV)
    b_virt = tl.load(b_off_ptr + slot * J + piece)
    b_stride = (width + 63) // 64 * 64
    table = table_ptr + slot.to(tl.int64) * table_stride
    part_rows = part_ptr + tok[:, None] * part_row + piece * part_piece + entry.to(tl.int64) * entry_stride
    split_stride = num_tokens * (J * RB)
    dtype = y_ptr.dtype.element_ty
    cols = tl.arange(0, 64)
    i0 = tl.arange(0, RK)
    if WIDE:  # one token, the whole rank in one chunk: all the tile's loads (y too, see the module
        # docstring) issued at once, before the wait
        n = n_lo + tl.arange(0, BN)
        if EVEN_N:
            y_mask = m_ok[:, None]
        else:
            y_mask = m_ok[:, None] & (n < width)[None, :]
        y = tl.load(y_rows + n[None, :], mask=y_mask, other=0.0)
        b = load_runs(pool_ptr, table, b_virt + i0 * b_stride + n_lo, i0 < rank, width - n_lo, BN, 64, LOG2_P, PAGED)
        if USE_PDL:
            gdc_wait()  # the shrink's partials are complete and visible from here on
        h = _sum_splits(part_rows, i0, m_ok, i0 < rank, split_k, split_stride, SPLITS).to(dtype)
        acc = _product(h, b, GROUPED, FP32)
        tl.store(y_rows + n[None, :], (y.to(tl.float32) + scale * acc).to(dtype), mask=y_mask)
    else:  # rank chunks of RK rows, 64 columns at a time (an accumulator of BM x 64)
        if USE_PDL:
            gdc_wait()
        if RK == RB:  # the whole rank in one chunk: sum the splits once, not per column run
            h_all = _sum_splits(part_rows, i0, m_ok, i0 < rank, split_k, split_stride, SPLITS).to(dtype)
        for n in range(n_lo, tl.minimum(n_lo + BN, width), 64):
            n = tl.multiple_of(n, 64)  # a loop variable carries no hint of its own
            n_ok = n + cols < width
            if EVEN_N:
                y_mask = m_ok[:, None]
            else:
                y_mask = m_ok[:, None] & n_ok[None, :]
            y = tl.load(y_rows + n + cols[None, :], mask=y_mask, other=0.0)  # issued early: overlaps the B chain
            acc = tl.zeros((BM, 64), dtype=tl.float32)
            for r0 in range(0, rank, RK):
                i = r0 + i0
                i_ok = i < rank
                if RK == RB:
                    h = h_all
                else:
                    h = _sum_splits(part_rows, i, m_ok, i_ok, split_k, split_stride, SPLITS).to(dtype)
                start = _run_starts(table, b_virt + i * b_stride + n, i_ok, LOG2_P, PAGED)
                if EVEN_N:
                    b = tl.load(pool_ptr + start[:, None] + cols[None, :], mask=i_ok[:, None], other=0.0)
                else:
                    b = tl.load(pool_ptr + start[:, None] + cols[None, :],
                                mask=i_ok[:, None] & n_ok[None, :], other=0.0)
                acc += _product(h, b, GROUPED, FP32)
            tl.store(y_rows + n + cols[None, :], (y.to(tl.float32) + scale * acc).to(dtype), mask=y_mask)


# ------------------------------------------------------------------ checks


def _check_tensor(name: str, t: torch.Tensor, shape: tuple, dtype, device) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(name, "a tensor", type(t).__name__)
    if t.dim() != len(shape) or any(e is not None and e != g for e, g in zip(shape, t.shape)):
        _fail(name, f"of shape {tuple('*' if e is None else e for e in shape)}", tuple(t.shape))
    if t.dtype != dtype:
        _fail(f"{name}.dtype", str(dtype), t.dtype)
    if t.device != device:
        _fail(f"{name}.device", str(device), t.device)
    if t.numel() and t.stride(-1) != 1:
        _fail(f"{name}.stride(-1)", "1 (rows contiguous)", t.stride(-1))


def check_inputs(y, x, pool, page_table, token_slots, meta: DenseLoraMeta) -> None:
    """Validate the arguments of `lora_shrink_expand` (shared by the reference; ``y`` None for
    `lora_shrink`, ``x`` None for `lora_stack.lora_expand_stacked`); raise ValueError."""
    check_pages(pool, page_table, meta)
    rows, dev = y if x is None else x, pool.device
    count = rows.shape[0] if isinstance(rows, torch.Tensor) and rows.dim() == 2 else None
    if x is not None:
        _check_tensor("x", x, (None, meta.d_in), pool.dtype, dev)
    if y is not None:  # (lora_shrink has no y)
        _check_tensor("y", y, (count, meta.out_cols), pool.dtype, dev)
    _check_tensor("token_slots", token_slots, (count,), torch.int32, dev)


def check_pages(pool, page_table, meta: DenseLoraMeta) -> None:
    """Validate the pool layer, the page table and ``meta``'s device (what every kernel here pages through)."""
    if not isinstance(pool, torch.Tensor) or pool.dim() != 2:
        _fail("pool", "one layer of the pool, [N, P]", getattr(pool, "shape", type(pool).__name__))
    page, dev = pool.shape[1], pool.device
    if pool.dtype not in DTYPES:
        _fail("pool.dtype", f"one of {DTYPES}", pool.dtype)
    if page < 64 or page & (page - 1) or not pool.is_contiguous():
        _fail("pool", "contiguous with a power-of-two page_elems >= 64", (tuple(pool.shape), pool.stride()))
    _check_tensor("page_table", page_table, (meta.num_slots, None), torch.int32, dev)
    if page_table.shape[1] * page < meta.buffer_elems:
        _fail("page_table.shape[1]", f">= {-(-meta.buffer_elems // page)} pages", page_table.shape[1])
    if meta.rank.device != dev:
        _fail("meta device", str(dev), meta.rank.device)


# ---------------------------------------------------------------- launcher


def lora_shrink_expand(y: torch.Tensor, x: torch.Tensor, pool: torch.Tensor, page_table: torch.Tensor,
                       token_slots: torch.Tensor, meta: DenseLoraMeta, *, batch: LoraBatch | None = None,
                       scale: float = 1.0, config: dict | None = None, contiguous: bool = False,
                       early: bool = False) -> torch.Tensor:
    """``y[t, slice j] += scale * round(x[t] @ A[s, j].T) @ B[s, j]`` for ``s = token_slots[t] >= 0``.

    y: ``[T, C]`` model dtype, updated in place and returned (row stride free, columns contiguous).
    x: ``[T, D]`` model dtype.
    pool: ``[N, P]`` one layer of the pool (model dtype, contiguous, P a power of two >= 64).
    page_table: ``[S, max_pages]`` int32, page ids of each slot's buffer.
    token_slots: ``[T]`` int32, the slot of each token, -1 for none (must be < S).
    meta: `DenseLoraMeta` of this layer and these targets, on the pool's device.
    batch: `LoraBatch` from `plan_lora_batch` (built once per step); None plans here.
    scale: extra factor (the adapters' scaling is already folded into B).
    config: launch-config overrides (tile sizes, Split-K, warps); default from configs/lora_dense.json.
    contiguous: read each slot's buffer as contiguous from its first page (no per-run
        translation) — only for benchmarking against unpaged weights.
    early: see `lora_shrink`.

    The same as `lora_shrink` then `lora_expand` with ``dependent=True``.
    """
    check_inputs(y, x, pool, page_table, token_slots, meta)
    shrunk = _shrink(x, pool, page_table, token_slots, meta, batch, config, contiguous, early)
    return _expand(y, shrunk, scale, True)


@dataclass(frozen=True)
class LoraShrink:
    """What `lora_shrink` hands to `lora_expand`: the Split-K partials of ``h`` and the launch they came from
    (None: nothing to add — no token or no rank)."""

    part: torch.Tensor | None  # [split_k, T, J*RB] fp32
    plan: LoraPlan | None
    args: tuple  # the pool, table and batch arguments both kernels take
    meta: DenseLoraMeta
    num_tokens: int
    dtype: torch.dtype  # the pool's, which y must have
    batch: LoraBatch | None
    stacked: StackedH | None = None  # where h lies when it comes from a shrink stack (part is then h)


@dataclass(frozen=True)
class StackedH:
    """``h`` of a shrink stack (`lora_stack`): token ``t``'s slice ``j`` of entry ``e = entry_of_slot[slot]``
    starts at element ``t * row_stride + e * entry_stride + j * piece_stride``."""

    entry_of_slot: torch.Tensor  # [>= S] int32
    row_stride: int
    piece_stride: int
    entry_stride: int


def lora_shrink(x: torch.Tensor, pool: torch.Tensor, page_table: torch.Tensor, token_slots: torch.Tensor,
                meta: DenseLoraMeta, *, batch: LoraBatch | None = None, config: dict | None = None,
                contiguous: bool = False, early: bool = False) -> LoraShrink:
    """The shrink half of `lora_shrink_expand` (same arguments but ``y`` and ``scale``): launches the kernel
    that writes the Split-K partials of ``h = x @ A.T`` and returns them for `lora_expand`.

    early: launch it as a programmatic dependent of the kernel before it on the stream (Hopper+, when
        the plan uses PDL): its programs start while that kernel finishes, read the batch plan, the
        metadata and the page table, and wait for it before reading ``x``.  Only when the kernel before
        writes none of those (the engine: the base projection ``x @ W.T`` of the same ``x``, or a bias
        added to its result) and the ones before it have finished writing them (they run before a plain
        launch).
    The partials are allocated on the current stream; `lora_expand` (or `lora_silu_mul`) reads them.
    """
    check_inputs(None, x, pool, page_table, token_slots, meta)
    return _shrink(x, pool, page_table, token_slots, meta, batch, config, contiguous, early)


def _shrink(x, pool, page_table, token_slots, meta: DenseLoraMeta, batch: LoraBatch | None, config: dict | None,
            contiguous: bool, early: bool = False) -> LoraShrink:
    count = x.shape[0]
    if count == 0 or meta.max_rank == 0:
        return LoraShrink(None, None, (), meta, count, pool.dtype, None)
    batch, plan, args = launch_args(x, pool, page_table, token_slots, meta, batch, config, contiguous)
    part = torch.empty(plan.split_k, count, meta.num_slices * meta.rank_block, dtype=torch.float32, device=x.device)
    launch(_shrink_kernel, plan.shrink_grid,
        x, x.stride(0), *args, meta.a_offset, part, count, meta.d_in, round_up(meta.d_in), plan.k_per_split,
        **(plan.shrink_early if early else plan.shrink_options))
    return LoraShrink(part, plan, args, meta, count, pool.dtype, batch)


def launch_args(x, pool, page_table, token_slots, meta: DenseLoraMeta, batch: LoraBatch | None,
                config: dict | None, contiguous: bool) -> tuple[LoraBatch, LoraPlan, tuple]:
    """``(batch, plan, args)`` of a launch on ``x``'s rows (``batch`` planned here if None): the plan of
    the geometry and the pool, table and batch arguments both kernels take."""
    if batch is None:
        batch = plan_lora_batch(token_slots, meta.num_slots)
    if batch.num_tokens != x.shape[0]:
        _fail("batch.num_tokens", f"T = {x.shape[0]}", batch.num_tokens)
    plan = cached_plan(x, pool, meta, batch, config, contiguous)
    args = (pool, page_table, page_table.stride(0), token_slots,
            batch.tiles if batch.grouped else token_slots,
            batch.token_order if batch.grouped else token_slots, meta.rank)
    return batch, plan, args


def lora_expand(y: torch.Tensor, shrunk: LoraShrink, *, scale: float = 1.0, dependent: bool = False) -> torch.Tensor:
    """The expand half of `lora_shrink_expand`: ``y += scale * round(sum of the partials) @ B`` (returns y).

    dependent: launch as a programmatic dependent of the shrink (Hopper+, when the plan allows it) —
        only when the shrink was the last launch on this stream and whatever wrote ``y`` came before
        the shrink (the GEMV path reads ``y`` before it waits); otherwise a plain launch.
    """
    if not isinstance(shrunk, LoraShrink):
        _fail("shrunk", "what lora_shrink returned", type(shrunk).__name__)
    _check_tensor("y", y, (shrunk.num_tokens, shrunk.meta.out_cols), shrunk.dtype, shrunk.meta.rank.device)
    return _expand(y, shrunk, scale, dependent)


def _expand(y, shrunk: LoraShrink, scale: float, dependent: bool) -> torch.Tensor:
    if shrunk.plan is None:
        return y
    plan, meta = shrunk.plan, shrunk.meta
    stacked = shrunk.stacked
    if stacked is None:
        layout = (shrunk.part, meta.num_slices * meta.rank_block, meta.rank_block, 0)
        split_k, options = plan.split_k, plan.expand_options if dependent else plan.expand_solo
        grid, block_n = plan.expand_grid, plan.block_n
    else:  # one h in the model dtype per entry, no splits to sum (`lora_stack`), its own column tile
        layout = (stacked.entry_of_slot, stacked.row_stride, stacked.piece_stride, stacked.entry_stride)
        split_k, options = 1, plan.stacked_options
        grid, block_n = plan.stacked_grid, plan.stacked_block_n
    launch(_expand_kernel, grid,
        y, y.stride(0), *shrunk.args, meta.b_offset, shrunk.part, meta.col_tile_table(block_n),
        shrunk.num_tokens, split_k, float(scale), *layout, **options)
    return y


# --------------------------------------------------------------- reference


def lora_shrink_expand_ref(y: torch.Tensor, x: torch.Tensor, pool: torch.Tensor, page_table: torch.Tensor,
                           token_slots: torch.Tensor, meta: DenseLoraMeta, *, batch: LoraBatch | None = None,
                           scale: float = 1.0, config: dict | None = None,
                           contiguous: bool = False, early: bool = False) -> torch.Tensor:
    """Torch reference of `lora_shrink_expand`, same signature and math; reads through the page
    table like the kernels (``batch``, ``config``, ``contiguous`` and ``early`` only shape the launch there).

    Used by the engine on CPU and as the test oracle.  Syncs with the device (reads ``token_slots``).
    """
    check_inputs(y, x, pool, page_table, token_slots, meta)
    slots = token_slots.tolist()
    bad = sorted({s for s in slots if not -1 <= s < meta.num_slots})
    if bad:
        _fail("token_slots", f"in [-1, {meta.num_slots})", bad)
    for slot in sorted(set(slots) - {-1}):
        rows = torch.tensor([t for t, s in enumerate(slots) if s == slot], device=x.device)
        _slot_delta(y, x[rows].float(), rows, pool, page_table[slot].long(), meta, slot, scale)
    return y


@dataclass(frozen=True)
class LoraShrinkRef:
    """`lora_shrink_ref`'s result: the inputs, for `lora_expand_ref` (the reference does the whole product)."""

    x: torch.Tensor
    pool: torch.Tensor
    page_table: torch.Tensor
    token_slots: torch.Tensor
    meta: DenseLoraMeta


def lora_shrink_ref(x: torch.Tensor, pool: torch.Tensor, page_table: torch.Tensor, token_slots: torch.Tensor,
                    meta: DenseLoraMeta, *, batch: LoraBatch | None = None, config: dict | None = None,
                    contiguous: bool = False, early: bool = False) -> LoraShrinkRef:
    """Torch reference of `lora_shrink` (same signature): checks and keeps the inputs."""
    check_inputs(None, x, pool, page_table, token_slots, meta)
    return LoraShrinkRef(x, pool, page_table, token_slots, meta)


def lora_expand_ref(y: torch.Tensor, shrunk: LoraShrinkRef, *, scale: float = 1.0,
                    dependent: bool = False) -> torch.Tensor:
    """Torch reference of `lora_expand` (same signature; ``shrunk`` from `lora_shrink_ref`)."""
    if not isinstance(shrunk, LoraShrinkRef):
        _fail("shrunk", "what lora_shrink_ref returned", type(shrunk).__name__)
    return lora_shrink_expand_ref(y, shrunk.x, shrunk.pool, shrunk.page_table, shrunk.token_slots, shrunk.meta,
                                  scale=scale)


def _slot_delta(y, x_rows, rows, pool, table, meta: DenseLoraMeta, slot: int, scale: float) -> None:
    for j, rank in enumerate(meta.ranks[slot]):
        if rank == 0:
            continue
        a = gather_block(pool, table, Block(meta.a_offsets[slot][j], rank, meta.d_in)).float()
        b = gather_block(pool, table, Block(meta.b_offsets[slot][j], rank, meta.slice_cols[j])).float()
        h = (x_rows @ a.T).to(y.dtype).float()
        cols = slice(meta.slice_starts[j], meta.slice_starts[j] + meta.slice_cols[j])
        y[rows, cols] = (y[rows, cols].float() + scale * (h @ b)).to(y.dtype)
