"""The residual add and RMSNorm after a stacked projection, with that projection's LoRA expand folded in.

A decode step's o projection runs through a shrink stack (`lora_stack`): one GEMM gives the projection ``y``
and every stack entry's ``h = x @ A.T``; then `lora_expand_stacked` adds ``h @ B`` into ``y`` and
`elementwise.add_rms_norm` adds ``y`` into the residual stream and normalises it, two launches in a row
over the same ``[T, H]`` rows.  `add_rms_norm_stacked` does both in one launch: a program takes one
token's row, reads its slot's B rows (rank x H, from the pool's pages, one page lookup per 64-run) and its
h, and adds the delta on the way into the norm.  ``y`` is read, never written back.

Math, for token ``t`` with slot ``s >= 0``, ``e = entry_of_slot[s] >= 0`` and rank ``r > 0``
(the projection has one slice, covering all H columns)::

    y'   = round(y[t] + scale * h[t, e*RB : e*RB + r] @ B[s])      (as `lora_expand_stacked` rounds)
    sum  = round(res[t] + y')                                       (as `add_rms_norm`)
    out  = rms_norm(sum) · weight

Other tokens take ``y' = y[t]``.  Returns ``(sum, out)``, both new ``[T, H]`` tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unipage.kernels.common import load_runs, next_pow2
from unipage.kernels.elementwise import add_rms_norm_ref
from unipage.kernels.launch import launch
from unipage.kernels.lora import _check_tensor, _fail, check_inputs
from unipage.kernels.lora_meta import DenseLoraMeta
from unipage.kernels.lora_stack import lora_expand_stacked_ref

ROW_ELEMS = 16384  # B elements a program holds at once (rank rows x H): past it, rank chunks in a loop
LAUNCH = {"flat": False, "num_warps": 0}  # the B reads' form, warps a program (0: 8 from 2,048 columns, else 4)


@triton.jit(do_not_specialize=["rows"])
def _add_rms_norm_stacked_kernel(
    res_ptr, y_ptr, h_ptr, w_ptr, sum_ptr, out_ptr,  # [T, H] ... h: [T, K*RB]; w: [H]; sum, out: [T, H] contiguous
    slots_ptr, entry_ptr, rank_ptr, b_off_ptr, pool_ptr, table_ptr,
    rows, n, stride_res, stride_y, stride_h, entry_stride, table_stride, scale, eps,
    RK: tl.constexpr, RC: tl.constexpr, BLOCK: tl.constexpr, LOG2_P: tl.constexpr, FLAT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    y = tl.load(y_ptr + t * stride_y + cols, mask=ok, other=0.0)
    res = tl.load(res_ptr + t * stride_res + cols, mask=ok, other=0.0)
    slot = tl.load(slots_ptr + t)
    live = slot >= 0
    slot = tl.maximum(slot, 0)
    entry = tl.load(entry_ptr + slot, mask=live, other=-1)
    live = live & (entry >= 0)  # (no entry: no delta, as the stacked expand)
    rank = tl.load(rank_ptr + slot, mask=live, other=0)
    b_virt = tl.load(b_off_ptr + slot, mask=live, other=0)
    table = table_ptr + slot.to(tl.int64) * table_stride
    h_row = h_ptr + t * stride_h + tl.maximum(entry, 0).to(tl.int64) * entry_stride
    b_stride = (n + 63) // 64 * 64
    delta = tl.zeros([BLOCK], tl.float32)
    for r0 in range(0, RK, RC):  # (RC = RK at decode shapes: one chunk, every B load issued at once)
        if FLAT:  # the chunk's rank rows one by one in the row's layout: a page lookup per element (cached)
            for j in tl.static_range(RC):
                i_ok = ok & (cols * 0 + r0 + j < rank)  # (vector form: the interpreter's)
                virt = b_virt + (r0 + j) * b_stride + cols
                page = tl.load(table + (virt >> LOG2_P), mask=i_ok, other=0)
                b = tl.load(pool_ptr + page.to(tl.int64) * (1 << LOG2_P) + (virt & ((1 << LOG2_P) - 1)),
                            mask=i_ok, other=0.0)
                hv = tl.load(h_row + r0 + j + cols * 0, mask=i_ok, other=0.0)  # (one element, broadcast)
                delta += hv.to(tl.float32) * b.to(tl.float32)
        else:  # the chunk as one [RC, BLOCK] tile: a page lookup per 64-run, one load
            i = r0 + tl.arange(0, RC)
            i_ok = i < rank
            b = load_runs(pool_ptr, table, b_virt + i * b_stride, i_ok, n, BLOCK, 64, LOG2_P, True)
            hv = tl.load(h_row + i, mask=i_ok, other=0.0)
            delta += tl.sum(hv.to(tl.float32)[:, None] * b.to(tl.float32), axis=0)
    dtype = sum_ptr.dtype.element_ty
    y = (y.to(tl.float32) + scale * delta).to(dtype)
    s = (res.to(tl.float32) + y.to(tl.float32)).to(dtype)
    tl.store(sum_ptr + t * n + cols, s, mask=ok)
    x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    normed = (x * rstd).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * n + cols, (normed * w).to(dtype), mask=ok)


def _check(res, y, h, weight, entry_of_slot, pool, page_table, token_slots, meta: DenseLoraMeta,
           rank_block: int) -> None:
    check_inputs(y, None, pool, page_table, token_slots, meta)
    if meta.num_slices != 1:
        _fail("meta", "one slice (a projection whose LoRA covers all its columns)", meta.num_slices)
    if rank_block < meta.max_rank:
        _fail("rank_block", f">= the largest rank {meta.max_rank}", rank_block)
    count, n = y.shape
    _check_tensor("res", res, (count, n), y.dtype, y.device)
    _check_tensor("weight", weight, (n,), y.dtype, y.device)
    if not weight.is_contiguous():
        _fail("weight", "contiguous", weight.stride())
    if h.dim() != 2 or h.shape[1] % rank_block:
        _fail("h", f"[T, K * {rank_block}]", tuple(h.shape))
    _check_tensor("h", h, (count, h.shape[1]), y.dtype, y.device)
    _check_tensor("entry_of_slot", entry_of_slot, (None,), torch.int32, y.device)


def add_rms_norm_stacked(res: torch.Tensor, y: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
                         entry_of_slot: torch.Tensor, pool: torch.Tensor, page_table: torch.Tensor,
                         token_slots: torch.Tensor, meta: DenseLoraMeta, *, rank_block: int,
                         scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum, out)``: `add_rms_norm` of ``res`` and ``y`` plus its stacked LoRA delta (module docstring).

    res: ``[T, H]`` the residual stream; y: ``[T, H]`` the projection (not written); h: ``[T, K*rank_block]``
    every stack entry's ``x @ A.T`` (`lora_expand_stacked`'s h); weight ``[H]``, eps: the norm's.  All in the
    pool's dtype, columns contiguous, rows strided as they come.  entry_of_slot, pool, page_table,
    token_slots, meta, rank_block, scale: as for `lora_stack.lora_expand_stacked` (meta of one slice).
    """
    _check(res, y, h, weight, entry_of_slot, pool, page_table, token_slots, meta, rank_block)
    count, n = y.shape
    total = torch.empty(count, n, dtype=y.dtype, device=y.device)
    out = torch.empty_like(total)
    if count == 0:
        return total, out
    block, rk = next_pow2(n), next_pow2(max(meta.max_rank, 1))
    rc = max(1, min(rk, ROW_ELEMS // block))
    launch(_add_rms_norm_stacked_kernel, (count,),
        res, y, h, weight, total, out, token_slots, entry_of_slot, meta.rank, meta.b_offset, pool, page_table,
        count, n, res.stride(0), y.stride(0), h.stride(0), rank_block, page_table.stride(0), float(scale), eps,
        RK=rk, RC=rc, BLOCK=block, LOG2_P=pool.shape[1].bit_length() - 1, FLAT=bool(LAUNCH["flat"]),
        num_warps=LAUNCH["num_warps"] or (8 if block >= 2048 else 4))
    return total, out


def add_rms_norm_stacked_ref(res: torch.Tensor, y: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
                             entry_of_slot: torch.Tensor, pool: torch.Tensor, page_table: torch.Tensor,
                             token_slots: torch.Tensor, meta: DenseLoraMeta, *, rank_block: int,
                             scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of `add_rms_norm_stacked` (same signature): the stacked expand, then the add and norm."""
    _check(res, y, h, weight, entry_of_slot, pool, page_table, token_slots, meta, rank_block)
    full = lora_expand_stacked_ref(y.clone(), h, entry_of_slot, pool, page_table, token_slots, meta,
                                   rank_block=rank_block, scale=scale)
    return add_rms_norm_ref(res, full, weight, eps)
