"""Expert LoRA fused into the base MoE GEMMs' epilogues (the ``"fuse": true`` mode of a LoRA
launch config): no LoRA pass over the activations.

Same math as `unipage.kernels.fused_moe_lora` (see its docstring), different schedule:

1. `fused_moe_lora.moe_lora_shrink`: ``z = x @ A_gu.T`` per LoRA pair (split-K partials), and
   the down accumulator ``down_z`` zeroed.
2. The base gate/up GEMM, in its epilogue: ``h += z_slice @ B_gu_slice`` before the activation
   (`gate_up_delta`), then ``down_z += act @ A_d.T`` over its column tile (`down_shrink`, atomics).
3. The base down GEMM, in its epilogue: ``y += down_z @ B_d`` before the routing weight (`down_delta`).

So the pass never reads or writes ``raw`` [TK, 2I] or re-reads ``y`` [TK, H]: at prefill sizes
those activations are most of the separate pass's bytes.

A base tile holds the pairs of one expert from any adapters.  Its rows' distinct LoRA slots are
ranked (`tile_slots`); the slots are taken S_TILE at a time, and for each group of S_TILE the
weights of all of them are read as one stacked tile ``[S_TILE·r, BLOCK_N]`` (one chain of
dependent loads, all issued together) and multiplied by the rows' ``z`` spread into block
``rank`` of ``[BLOCK_M, S_TILE·r]`` (zeros elsewhere): one tensor-core dot adds every row's own
adapter's delta.  Tiles with more than S_TILE slots loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from unipage.kernels.fused_moe_lora import MoeLoraPlan, k_splits, load_rows, lora_pads
from unipage.kernels.moe_align import (
    F_BASE,
    F_DOWN_A,
    F_DOWN_B,
    F_DOWN_RANK,
    F_GU_SLICES,
    F_SLICE0,
    F_STRIDE,
    NUM_FIELDS,
    SLICE_FIELDS,
)


@triton.jit
def tile_slots(slots_ptr, flags_ptr, pairs, pair_ok, top_k, BLOCK_M: tl.constexpr):
    """Per row: its LoRA slot (-1: none or no expert LoRA in this layer) and the slot's rank among
    the tile's distinct slots (ascending); and the number of distinct slots."""
    slot = tl.load(slots_ptr + pairs // top_k, mask=pair_ok, other=-1)
    flag = tl.load(flags_ptr + tl.maximum(slot, 0), mask=slot >= 0, other=0)
    key = tl.where(flag != 0, slot, -1)
    idx = tl.arange(0, BLOCK_M)
    seen = (key[None, :] == key[:, None]) & (idx[None, :] < idx[:, None])
    first = (key >= 0) & (tl.max(seen.to(tl.int32), axis=1) == 0)
    rank = tl.sum((first[None, :] & (key[None, :] < key[:, None])).to(tl.int32), axis=1)
    return key, rank, tl.sum(first.to(tl.int32), axis=0)


@triton.jit
def _group_slots(key, rank, first, S_TILE: tl.constexpr):
    """Slots of ranks ``first .. first + S_TILE`` (-1 past the last)."""
    js = first + tl.arange(0, S_TILE)
    match = (rank[None, :] == js[:, None]) & (key[None, :] >= 0)
    return tl.max(tl.where(match, key[None, :], -1), axis=1)


@triton.jit
def _own_block(key, rank, first, S_TILE: tl.constexpr):
    """``[BLOCK_M, S_TILE]``: row m's slot is slot ``j`` of this group."""
    return (key >= 0)[:, None] & ((rank - first)[:, None] == tl.arange(0, S_TILE)[None, :])


@triton.jit
def _spread(z, own, S_TILE: tl.constexpr, WIDTH: tl.constexpr, BLOCK_M: tl.constexpr):
    """``[BLOCK_M, S_TILE·WIDTH]``: row m's ``z`` in its own slot's block, zeros elsewhere."""
    big = tl.where(own[:, :, None], z[:, None, :], 0.0)
    return tl.reshape(big, (BLOCK_M, S_TILE * WIDTH)).to(z.dtype)


@triton.jit
def _stacked(pool_ptr, pt_ptr, stride_pt, slots, start, rank, row_stride, cols_left, WIDTH: tl.constexpr,
             BLOCK_N: tl.constexpr, RUN: tl.constexpr, PAGE_SHIFT: tl.constexpr, S_TILE: tl.constexpr):
    """``[S_TILE·WIDTH, BLOCK_N]``: slot j's rows ``0 .. rank[j]`` (virtual ``start[j] + k·row_stride[j]``)
    stacked in block j; rows past a rank and slots -1 read 0."""
    k = tl.arange(0, WIDTH)
    virt = tl.reshape(start[:, None] + k[None, :] * row_stride[:, None], (S_TILE * WIDTH,))
    ok = tl.reshape((slots >= 0)[:, None] & (k[None, :] < rank[:, None]), (S_TILE * WIDTH,))
    pt_off = tl.reshape(tl.maximum(slots, 0)[:, None] * stride_pt + 0 * k[None, :], (S_TILE * WIDTH,))
    return load_rows(pool_ptr, pt_ptr, pt_off, virt, ok, cols_left, BLOCK_N, RUN, PAGE_SHIFT)


@triton.jit
def _fields(meta_ptr, slots, expert):
    """Each slot's field row and its expert group's virtual start."""
    ok = slots >= 0
    meta = meta_ptr + tl.maximum(slots, 0) * NUM_FIELDS
    start = tl.load(meta + F_BASE, mask=ok, other=0) + expert * tl.load(meta + F_STRIDE, mask=ok, other=0)
    return meta, start


@triton.jit
def _gate_up_fields(meta, ok, inter):
    """The gate slice's and the up slice's field pointers and the up columns' shift in their slice."""
    gate = meta + F_SLICE0
    up = gate + (tl.maximum(tl.load(meta + F_GU_SLICES, mask=ok, other=1), 1) - 1) * SLICE_FIELDS
    return gate, up, inter - tl.load(up + 3, mask=ok, other=0)


@triton.jit
def _row_z(z_ptr, pairs, has, field, num_pairs, R_PAD: tl.constexpr, RK_PAD: tl.constexpr,
           SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """``[BLOCK_M, RK_PAD]``: each LoRA row's ``z[a_row : a_row + rank]`` of its own slice (field
    pointers per row), summed over the split-K partials."""
    a_row = tl.load(field, mask=has, other=0)
    offs = tl.arange(0, RK_PAD)
    ok = has[:, None] & (offs[None, :] < tl.load(field + 1, mask=has, other=0)[:, None])
    out = tl.zeros((BLOCK_M, RK_PAD), tl.float32)
    for split in tl.static_range(SPLIT_K):
        ptrs = z_ptr + (split * num_pairs + pairs[:, None]).to(tl.int64) * R_PAD + a_row[:, None] + offs[None, :]
        out += tl.load(ptrs, mask=ok, other=0.0)
    return out


@triton.jit
def _slice_b(pool_ptr, pt_ptr, stride_pt, slots, start, field, col, cols_left, RK_PAD: tl.constexpr,
             BLOCK_N: tl.constexpr, RUN: tl.constexpr, PAGE_SHIFT: tl.constexpr, S_TILE: tl.constexpr):
    """The stacked B tile of one gate/up slice per slot, local columns ``col .. col + BLOCK_N``."""
    ok = slots >= 0
    row0 = start + tl.load(field + 2, mask=ok, other=0) + col
    stride = (tl.load(field + 4, mask=ok, other=0) + 63) // 64 * 64
    return _stacked(pool_ptr, pt_ptr, stride_pt, slots, row0, tl.load(field + 1, mask=ok, other=0), stride,
                    cols_left, RK_PAD, BLOCK_N, RUN, PAGE_SHIFT, S_TILE)


@triton.jit
def gate_up_delta(acc, acc_up, pairs, key, rank, num_slots, expert, n0, inter, z_ptr, pool_ptr, pt_ptr, meta_ptr,
                  stride_pt, num_pairs, R_PAD: tl.constexpr, RK_PAD: tl.constexpr, SPLIT_K: tl.constexpr,
                  S_TILE: tl.constexpr, RUN: tl.constexpr, PAGE_SHIFT: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``acc += z_gate @ B_gate``, ``acc_up += z_up @ B_up`` for the LoRA rows of a gate/up tile
    (columns ``n0 .. n0 + BLOCK_N`` of each half)."""
    dtype = pool_ptr.dtype.element_ty
    has = key >= 0
    row_meta = meta_ptr + tl.maximum(key, 0) * NUM_FIELDS
    row_gate, row_up, _ = _gate_up_fields(row_meta, has, inter)
    z_gate = _row_z(z_ptr, pairs, has, row_gate, num_pairs, R_PAD, RK_PAD, SPLIT_K, BLOCK_M).to(dtype)
    z_up = _row_z(z_ptr, pairs, has, row_up, num_pairs, R_PAD, RK_PAD, SPLIT_K, BLOCK_M).to(dtype)
    for first in range(0, num_slots, S_TILE):
        slots = _group_slots(key, rank, first, S_TILE)
        meta, start = _fields(meta_ptr, slots, expert)
        gate, up, up_shift = _gate_up_fields(meta, slots >= 0, inter)
        own = _own_block(key, rank, first, S_TILE)
        b = _slice_b(pool_ptr, pt_ptr, stride_pt, slots, start, gate, n0, inter - n0, RK_PAD, BLOCK_N, RUN,
                     PAGE_SHIFT, S_TILE)
        acc = tl.dot(_spread(z_gate, own, S_TILE, RK_PAD, BLOCK_M), b, acc, input_precision=DOT_PRECISION)
        b = _slice_b(pool_ptr, pt_ptr, stride_pt, slots, start, up, n0 + up_shift, inter - n0, RK_PAD, BLOCK_N,
                     RUN, PAGE_SHIFT, S_TILE)
        acc_up = tl.dot(_spread(z_up, own, S_TILE, RK_PAD, BLOCK_M), b, acc_up, input_precision=DOT_PRECISION)
    return acc, acc_up


@triton.jit
def down_shrink(act, pairs, key, rank, num_slots, expert, n0, inter, down_z_ptr, pool_ptr, pt_ptr, meta_ptr,
                stride_pt, RD_PAD: tl.constexpr, S_TILE: tl.constexpr, RUN: tl.constexpr,
                PAGE_SHIFT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """``down_z += act @ A_d[:, n0 : n0 + BLOCK_N].T`` for the LoRA rows (``act``: the model dtype)."""
    out = tl.zeros((BLOCK_M, RD_PAD), tl.float32)
    for first in range(0, num_slots, S_TILE):
        slots = _group_slots(key, rank, first, S_TILE)
        meta, start = _fields(meta_ptr, slots, expert)
        ok = slots >= 0
        a = _stacked(pool_ptr, pt_ptr, stride_pt, slots, start + tl.load(meta + F_DOWN_A, mask=ok, other=0) + n0,
                     tl.load(meta + F_DOWN_RANK, mask=ok, other=0), tl.zeros_like(slots) + (inter + 63) // 64 * 64,
                     inter - n0, RD_PAD, BLOCK_N, RUN, PAGE_SHIFT, S_TILE)
        part = tl.reshape(tl.dot(act, tl.trans(a), input_precision=DOT_PRECISION), (BLOCK_M, S_TILE, RD_PAD))
        out += tl.sum(tl.where(_own_block(key, rank, first, S_TILE)[:, :, None], part, 0.0), axis=1)
    offs = tl.arange(0, RD_PAD)
    tl.atomic_add(down_z_ptr + pairs[:, None].to(tl.int64) * RD_PAD + offs[None, :], out,
                  mask=(key >= 0)[:, None], sem="relaxed")


@triton.jit
def down_delta(acc, pairs, key, rank, num_slots, expert, n0, hidden, down_z_ptr, pool_ptr, pt_ptr, meta_ptr,
               stride_pt, RD_PAD: tl.constexpr, S_TILE: tl.constexpr, RUN: tl.constexpr, PAGE_SHIFT: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``acc += down_z @ B_d[:, n0 : n0 + BLOCK_N]`` for the LoRA rows of a down tile."""
    offs = tl.arange(0, RD_PAD)
    z = tl.load(down_z_ptr + pairs[:, None].to(tl.int64) * RD_PAD + offs[None, :], mask=(key >= 0)[:, None],
                other=0.0).to(pool_ptr.dtype.element_ty)
    for first in range(0, num_slots, S_TILE):
        slots = _group_slots(key, rank, first, S_TILE)
        meta, start = _fields(meta_ptr, slots, expert)
        ok = slots >= 0
        b = _stacked(pool_ptr, pt_ptr, stride_pt, slots, start + tl.load(meta + F_DOWN_B, mask=ok, other=0) + n0,
                     tl.load(meta + F_DOWN_RANK, mask=ok, other=0), tl.zeros_like(slots) + (hidden + 63) // 64 * 64,
                     hidden - n0, RD_PAD, BLOCK_N, RUN, PAGE_SHIFT, S_TILE)
        own = _own_block(key, rank, first, S_TILE)
        acc = tl.dot(_spread(z, own, S_TILE, RD_PAD, BLOCK_M), b, acc, input_precision=DOT_PRECISION)
    return acc


# ---------------------------------------------------------------------------------------------
# Launch side


def _chunk(n: int) -> int:
    return min(64, n & -n)


def can_fuse(plan: MoeLoraPlan | None, base_block_m: int, gate_up_block_n: int, down_block_n: int) -> bool:
    """Whether this step's LoRA runs fused: the config asks for it and the base tiles suit it
    (tensor-core heights, column tiles that are whole 64-aligned runs of the weights' rows)."""
    if plan is None or not plan.config.get("fuse"):
        return False
    meta = plan.lora.meta
    return base_block_m >= 16 and min(gate_up_block_n, down_block_n) >= 16 and meta.inter % 16 == 0


def epilogue_args(plan: MoeLoraPlan | None, stage: str, block_n: int, dummy: torch.Tensor) -> dict:
    """Keyword arguments of `fused_moe._moe_gemm_kernel` for ``stage`` ("gate_up" or "down"):
    the fused LoRA epilogue's inputs, or placeholders with FUSED off."""
    if plan is None:
        return {"lz_ptr": dummy, "ldz_ptr": dummy, "lpool_ptr": dummy, "lpt_ptr": dummy, "lmeta_ptr": dummy,
                "lstride_pt": 0, "ltop_k": 1, "FUSED": False, "L_R_PAD": 16, "L_RK_PAD": 16, "L_RD_PAD": 16,
                "L_SPLIT_K": 1, "L_S_TILE": 1, "L_RUN": 16, "L_PAGE_SHIFT": 6}
    lora, meta = plan.lora, plan.lora.meta
    r_pad, rk_pad, rd_pad = lora_pads(meta)
    run = min(block_n, _chunk(meta.inter)) if stage == "gate_up" else min(block_n, 64)
    return {"lz_ptr": plan.gate_up_z if stage == "gate_up" else plan.down_z, "ldz_ptr": plan.down_z,
            "lpool_ptr": lora.pool, "lpt_ptr": lora.page_table, "lmeta_ptr": meta.table,
            "lstride_pt": lora.page_table.stride(0), "ltop_k": plan.topk_ids.shape[1], "FUSED": True,
            "L_R_PAD": r_pad, "L_RK_PAD": rk_pad, "L_RD_PAD": rd_pad,
            "L_SPLIT_K": k_splits(meta.hidden, plan.config["split_k"])[0],
            "L_S_TILE": int(plan.config.get("fuse_slots", 8)), "L_RUN": run,
            "L_PAGE_SHIFT": lora.pool.shape[1].bit_length() - 1}
