"""Paged fused_moe_lora: the LoRA deltas of the routed experts of many adapters,
read straight from the unified pool's pages.

Shape legend: T, H, I, E, K, TK = T·K pairs as in `fused_moe`; S = adapter slots;
N = pool pages, P = page_elems; R = rows of an expert's gate/up A; r = a rank.

Math, for pair ``p`` = (token ``t``, expert ``e``) whose token has adapter slot
``s = token_slots[t] >= 0`` (gate/up B slice ``j`` covers output columns
``[col_j, col_j + ncols_j)`` and reads A-product entries ``[a_row_j, a_row_j + r_j)``;
scaling is folded into B)::

    z        = x[t] @ A_gu[s, e].T                                              [R]
    h        = raw[p] + Σ_j place_j(z[a_row_j : a_row_j + r_j] @ B_gu_j[s, e])  [2I]
    act[p]   = act_fn(h[:I], h[I:])   (silu(g)·u; GPT-OSS: the clamped SwiGLU)  [I]
    y[p]    += w[p] · (act[p] @ A_d[s, e].T) @ B_d[s, e]                        [H]

where ``raw[p] = x[t] @ W_gu[e].T`` and ``y[p] = w[p] · act[p] @ W_d[e].T`` come
from the base MoE (`fused_moe.moe_gate_up` / `moe_down`).  Pairs without an
adapter (or whose adapter has no expert target in this layer) are untouched.

Paging (contract of `unipage.lora_layout`): slot ``s``'s expert ``e`` group starts
at virtual offset ``expert_base + e·expert_stride``; virtual ``v`` lives at
``pool.view(-1)[page_table[s, v >> log2 P]·P + (v & (P-1))]``.  Every matrix row
starts 64-aligned, so a tile is loaded as runs of CHUNK (a power of two <= 64)
elements starting at CHUNK-aligned offsets of a row: each run lies in one page and
costs one page-table lookup — contiguous, vectorised loads.  A pair-mode shrink
program and every expand program load their whole weight tile at once
(`common.load_runs`: every (row, run) looked up, then one load), so those loads are in
flight together; a group-mode shrink walks K one 64-run at a time (`_load_paged`), or with
config ``shrink.whole_k`` loads its split whole too (the tile's x rows and the group's A; not small tiles), for
decode loads where group mode's one read of A per group could beat pair mode's one per pair
(the gate/up shrink only: the fused path's down shrink, `moe_lora_down_shrink`, always walks).
In pair mode a program picks its slot's metadata row out of the whole table loaded at
once (`_slot_row`, up to `GATHER_SLOTS` slots), so the chain from its start to its
weights is slot and expert -> page table -> weights: three dependent loads, cold in L2
at decode.

Kernels (one launch each):

- `_moe_shrink_kernel`: split-K partials of ``z``; zeroes the down accumulator.
- `_expand_gate_up_kernel`: ``raw + delta`` -> activation -> ``act`` (the add and the
  activation fused into the expand epilogue), and the down shrink
  ``act @ A_d.T`` accumulated per column tile (atomics) — no extra pass over ``act``.
- `_expand_down_kernel`: ``y += w · z_d @ B_d`` (the add fused into the epilogue); the down
  config's ``"sum": true`` takes `moe_lora_sum` instead (any mode), the delta added inside
  the sum over the K choices.

With launch config ``"pdl": true`` on Hopper+, both expands are programmatic dependent
launches: each program reads its tile, the metadata, the page table, its whole weight
tiles (gate B, up B and down A; or down B) and, for gate/up, the base GEMM's raw output
before ``gdc_wait``, so that chain of dependent loads overlaps the kernel before it;
``z`` / ``down_z`` / ``y`` are read only after the wait.  A program with no work waits too
before it exits (`common.finish_early`).
The shrink is a plain launch: it may trigger its dependents early but never waits itself, so
launching it with PDL would race its reads of ``x`` with the kernel before.

Tiles: *pair mode* (``block_m`` 1) gives each pair its own program with no
alignment pass (decode: groups hold about one pair) and weight tiles as tall as
the ranks' power of two (`tile_ranks`: broadcast-reduce math, no tensor-core
minimum; registers bound how many of these latency-bound programs run at once);
*group mode* (``block_m`` >= 16) aligns pairs by group ``slot·E + expert``
(`moe_align`; by the slot's rank among the step's, so the tiles follow the step's adapters, not
the slots, when `MoeLora.active_slots` bounds them) and runs tensor-core tiles that share the
group's A/B; *small tiles*
(``block_m`` 2-8) align the same way but do pair mode's broadcast-reduce math on
weight tiles as tall as the ranks' power of two, for loads of a few pairs a group
(setup (b)'s decode under the affinity policy: about 4), where a 16-row dot's tile is
mostly padding (slower than group mode on an H200 at that load, so no tuned config
uses them).  The mode and the tile height come from the expected pairs per
(adapter, expert) group, not from the token count.
Per-step sizes are ``do_not_specialize``: one compile serves every batch.
The plan (`MoeLora`, `plan_moe_lora`, the tile widths) and the device helpers with which a
program finds its tile and its slot's metadata live in `moe_lora_plan`; this module keeps the
kernels, their launchers and the references, and exports the plan's public names too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from unipage.kernels.common import (
    cdiv,
    finish_early,
    gdc_launch_dependents,
    gdc_wait,
    hopper_or_later,
    load_runs,
    next_pow2,
)
from unipage.kernels.launch import launch
from unipage.kernels.moe_act import gated_act
from unipage.kernels.moe_align import (
    F_BASE,
    F_DOWN_A,
    F_DOWN_B,
    F_DOWN_RANK,
    F_GU_A,
    F_GU_ROWS,
    F_GU_SLICES,
    F_SLICE0,
    F_STRIDE,
    FIELDS,
    SLICE_FIELDS,
    MoeLoraMeta,
    expected_load,
    lora_pairs,
    moe_lora_meta,
    swizzle,
)
from unipage.kernels.moe_lora_plan import (
    MoeLora,
    MoeLoraPlan,
    _field,
    _num_tiles,
    _skip,
    _slot_row,
    _slots_pad,
    _split_k,
    _tile,
    lora_config,
    lora_pads,
    plan_moe_lora,
    plan_moe_lora_ref,
    tile_ranks,
)

from unipage.adapter_pack import gather_block
from unipage.lora_layout import Block

__all__ = [
    "MoeLora",
    "MoeLoraMeta",
    "MoeLoraPlan",
    "expected_load",
    "lora_config",
    "lora_pairs",
    "moe_lora_down",
    "moe_lora_down_ref",
    "moe_lora_down_shrink",
    "moe_lora_gate_up",
    "moe_lora_gate_up_ref",
    "moe_lora_meta",
    "moe_lora_shrink",
    "plan_moe_lora",
    "plan_moe_lora_ref",
]



# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _load_paged(pool_ptr, pt_ptr, row_virt, row_ok, col0, col_ok, PAGE_SHIFT: tl.constexpr,
                CHUNK: tl.constexpr):
    """``[rows, CHUNK]``: row i = the pool elements at virtual ``row_virt[i] + col0 + [0, CHUNK)``.

    ``row_virt + col0`` is CHUNK-aligned and CHUNK <= 64, so each run is inside one page.
    """
    virt = row_virt + col0
    page = tl.load(pt_ptr + (virt >> PAGE_SHIFT), mask=row_ok, other=0)
    base = page.to(tl.int64) * (1 << PAGE_SHIFT) + (virt & ((1 << PAGE_SHIFT) - 1))
    base = tl.multiple_of(base, CHUNK)
    ptrs = pool_ptr + base[:, None] + tl.arange(0, CHUNK)[None, :]
    return tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def _mm(a, b, PAIR: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``a [M, R] @ b [R, C]`` in float32: a broadcast-reduce for tiles under 16 pairs (pair mode, small
    tiles), a tensor-core dot for larger ones."""
    if PAIR:
        out = tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        out = tl.dot(a, b, input_precision=DOT_PRECISION)
    return out


@triton.jit
def _col_mask(cols, limit, EVEN: tl.constexpr):
    if EVEN:
        ok = tl.full(cols.shape, 1, tl.int1)
    else:
        ok = cols < limit
    return ok


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_shrink_kernel(
    x_ptr,  # [T, H] model dtype
    z_ptr,  # [SPLIT_K, TK, R_PAD] float32: written for LoRA pairs of slots with gate/up LoRA
    down_z_ptr,  # [TK, RD_PAD] float32: zeroed for LoRA pairs
    pool_ptr, pt_ptr, meta_ptr, slots_ptr, flags_ptr, topk_ids_ptr, sorted_ptr, block_group_ptr,
    num_blocks_ptr, num_pairs, top_k, num_experts, num_slots, hidden, stride_x, stride_pt,
    R_PAD: tl.constexpr, RD_PAD: tl.constexpr, SPLIT_K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
    K_TILE: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr, PAGE_SHIFT: tl.constexpr,
    EVEN_K: tl.constexpr, S_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    DOWN: tl.constexpr = False, WHOLE_K: tl.constexpr = False,
):
    # DOWN (the fused path's down shrink, `moe_lora_down_shrink`): x is act [TK, I] (row = pair),
    # hidden is I, z is down_z [TK, RD_PAD] (SPLIT_K 1), A is down A; down_z is not zeroed.
    if USE_PDL:
        gdc_launch_dependents()
    num_m = _num_tiles(num_blocks_ptr, num_pairs, BLOCK_M)
    pid = tl.program_id(0)
    if pid >= num_m * SPLIT_K:
        return
    pid_m, split = swizzle(pid, num_m, SPLIT_K, GROUP_M)
    pairs, pair_ok, slot, expert = _tile(pid_m, slots_ptr, flags_ptr, topk_ids_ptr, sorted_ptr,
                                         block_group_ptr, num_pairs, top_k, num_experts, BLOCK_M)
    row, meta = _slot_row(meta_ptr, flags_ptr, slot, num_slots, S_PAD)
    offs_kt = tl.arange(0, K_TILE)
    k_left = tl.minimum(K_PER_SPLIT, hidden - split * K_PER_SPLIT)
    x_rows = tl.where(pair_ok, pairs if DOWN else pairs // top_k, 0).to(tl.int64)
    # whole splits: pair mode, and group mode with WHOLE_K (small tiles walk: a [BM, K, R] product spills)
    if BLOCK_M == 1 or (WHOLE_K and BLOCK_M >= 16):  # the tile's x rows over the whole split, with the metadata
        x_run = tl.load(x_ptr + x_rows[:, None] * stride_x + split * K_PER_SPLIT + offs_kt[None, :],
                        mask=pair_ok[:, None] & (offs_kt[None, :] < k_left), other=0.0)
    rows_a = _field(row, meta + (F_DOWN_RANK if DOWN else F_GU_ROWS), S_PAD)
    group_off = _field(row, meta + F_BASE, S_PAD) + expert * _field(row, meta + F_STRIDE, S_PAD)
    gu_a = _field(row, meta + (F_DOWN_A if DOWN else F_GU_A), S_PAD)
    if _skip(row, flags_ptr, slot, BLOCK_M, S_PAD):
        return
    if split == 0 and not DOWN:
        zero = tl.zeros((BLOCK_M, RD_PAD), tl.float32)
        tl.store(down_z_ptr + pairs[:, None] * RD_PAD + tl.arange(0, RD_PAD)[None, :], zero,
                 mask=pair_ok[:, None])
    if rows_a == 0:
        return
    offs_r = tl.arange(0, R_PAD)
    a_virt = group_off + gu_a + offs_r * ((hidden + 63) // 64 * 64)
    r_ok = offs_r < rows_a
    pt = pt_ptr + slot * stride_pt
    if BLOCK_M == 1 or (WHOLE_K and BLOCK_M >= 16):  # the whole split at once: a page lookup per 64-run, one load
        a = load_runs(pool_ptr, pt, a_virt + split * K_PER_SPLIT, r_ok, k_left, K_TILE, 64, PAGE_SHIFT, True)
        acc = _mm(x_run, tl.trans(a), BLOCK_M < 16, DOT_PRECISION)
    else:  # group mode and small tiles: K one 64-run at a time
        acc = tl.zeros((BLOCK_M, R_PAD), tl.float32)
        k_lo = split * K_PER_SPLIT
        for k0 in range(k_lo, tl.minimum(k_lo + K_PER_SPLIT, hidden), 64):
            offs_k = k0 + tl.arange(0, 64)
            k_ok = _col_mask(offs_k, hidden, EVEN_K)
            x = tl.load(x_ptr + x_rows[:, None] * stride_x + offs_k[None, :],
                        mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
            a = _load_paged(pool_ptr, pt, a_virt, r_ok, k0, k_ok, PAGE_SHIFT, 64)
            acc += _mm(x, tl.trans(a), BLOCK_M < 16, DOT_PRECISION)
    z = z_ptr + (split * num_pairs + pairs[:, None]).to(tl.int64) * R_PAD + offs_r[None, :]
    tl.store(z, acc, mask=pair_ok[:, None])


@triton.jit
def _slice_z(z_ptr, pairs, pair_ok, row, field, num_pairs, R_PAD: tl.constexpr, RK_PAD: tl.constexpr,
             SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, S_PAD: tl.constexpr):
    """``z[:, a_row : a_row + rank]`` of the gate/up slice whose fields start at ``row[field]``
    (summed over the split-K partials)."""
    a_row = _field(row, field, S_PAD)
    offs = tl.arange(0, RK_PAD)
    ok = pair_ok[:, None] & (offs < _field(row, field + 1, S_PAD))[None, :]
    out = tl.zeros((BLOCK_M, RK_PAD), tl.float32)
    for split in tl.static_range(SPLIT_K):
        ptrs = z_ptr + (split * num_pairs + pairs[:, None]).to(tl.int64) * R_PAD + a_row + offs[None, :]
        out += tl.load(ptrs, mask=ok, other=0.0)
    return out


@triton.jit
def _load_gate_up(raw, mask, inter):
    """A tile's un-activated gate and up columns of ``raw``, in float32."""
    return (tl.load(raw, mask=mask, other=0.0).to(tl.float32),
            tl.load(raw + inter, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _slice_rows(row, field, group_off, RK_PAD: tl.constexpr, S_PAD: tl.constexpr):
    """Virtual start and validity of each B row of the gate/up slice whose fields start at ``row[field]``."""
    offs = tl.arange(0, RK_PAD)
    stride = (_field(row, field + 4, S_PAD) + 63) // 64 * 64
    start = group_off + _field(row, field + 2, S_PAD)
    return start + offs * stride, offs < _field(row, field + 1, S_PAD)


@triton.jit(do_not_specialize=["num_pairs"])
def _expand_gate_up_kernel(
    raw_ptr,  # [TK, 2I] model dtype: un-activated gate | up of LoRA pairs (from the base GEMM)
    act_ptr,  # [TK, I] model dtype: written for LoRA pairs
    z_ptr,  # [SPLIT_K, TK, R_PAD] float32 from `_moe_shrink_kernel`
    down_z_ptr,  # [TK, RD_PAD] float32: += act @ A_d.T
    pool_ptr, pt_ptr, meta_ptr, slots_ptr, flags_ptr, topk_ids_ptr, sorted_ptr, block_group_ptr,
    num_blocks_ptr, num_pairs, top_k, num_experts, num_slots, inter, stride_raw, stride_act, stride_pt, alpha,
    limit, R_PAD: tl.constexpr, RK_PAD: tl.constexpr, RD_PAD: tl.constexpr, RD_T: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, GROUP_M: tl.constexpr,
    PAGE_SHIFT: tl.constexpr, EVEN_N: tl.constexpr, S_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr, ACT: tl.constexpr, RAW_AFTER_WAIT: tl.constexpr,
):
    # Everything up to `gdc_wait` reads only what existed before the kernel this one depends on
    # programmatically started (routing, alignment, metadata, weights): under PDL it overlaps that kernel.
    # That kernel is the shrink, launched after the base GEMM, so the GEMM's ``raw`` is read early too;
    # with RAW_AFTER_WAIT (the shrink ran on the side stream: the kernel before this one is the GEMM that
    # writes ``raw``) ``raw`` is read after the wait.
    if USE_PDL:
        gdc_launch_dependents()
    num_m = _num_tiles(num_blocks_ptr, num_pairs, BLOCK_M)
    num_n = tl.cdiv(inter, BLOCK_N)
    pid = tl.program_id(0)
    if pid >= num_m * num_n:
        finish_early(USE_PDL)
        return
    pid_m, pid_n = swizzle(pid, num_m, num_n, GROUP_M)
    pairs, pair_ok, slot, expert = _tile(pid_m, slots_ptr, flags_ptr, topk_ids_ptr, sorted_ptr,
                                         block_group_ptr, num_pairs, top_k, num_experts, BLOCK_M)
    row, meta = _slot_row(meta_ptr, flags_ptr, slot, num_slots, S_PAD)
    group_off = _field(row, meta + F_BASE, S_PAD) + expert * _field(row, meta + F_STRIDE, S_PAD)
    if _skip(row, flags_ptr, slot, BLOCK_M, S_PAD):
        finish_early(USE_PDL)
        return
    pt = pt_ptr + slot * stride_pt
    gate = meta + F_SLICE0  # slice 0 feeds the gate columns; the last slice the up columns
    up = gate + (tl.maximum(_field(row, meta + F_GU_SLICES, S_PAD), 1) - 1) * SLICE_FIELDS
    up_shift = inter - _field(row, up + 3, S_PAD)  # up column c: local column c + up_shift
    gate_virt, gate_ok = _slice_rows(row, gate, group_off, RK_PAD, S_PAD)
    up_virt, up_ok = _slice_rows(row, up, group_off, RK_PAD, S_PAD)
    offs_d = tl.arange(0, RD_T)
    down_rank = _field(row, meta + F_DOWN_RANK, S_PAD)
    down_ok = offs_d < down_rank
    down_virt = group_off + _field(row, meta + F_DOWN_A, S_PAD) + offs_d * ((inter + 63) // 64 * 64)
    rows = pairs[:, None].to(tl.int64)
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    mask = pair_ok[:, None] & _col_mask(cols, inter, EVEN_N)[None, :]
    b_gate = load_runs(pool_ptr, pt, gate_virt + n0, gate_ok, inter - n0, BLOCK_N, CHUNK, PAGE_SHIFT, True)
    b_up = load_runs(pool_ptr, pt, up_virt + n0 + up_shift, up_ok, inter - n0, BLOCK_N, CHUNK, PAGE_SHIFT, True)
    a_down = load_runs(pool_ptr, pt, down_virt + n0, down_ok, inter - n0, BLOCK_N, CHUNK, PAGE_SHIFT, True)
    raw = raw_ptr + rows * stride_raw + cols[None, :]
    if not RAW_AFTER_WAIT:
        g, u = _load_gate_up(raw, mask, inter)
    if USE_PDL:
        gdc_wait()  # the kernel before this one is complete and its writes visible from here on
    if RAW_AFTER_WAIT:
        g, u = _load_gate_up(raw, mask, inter)
    dtype = pool_ptr.dtype.element_ty
    z_gate = _slice_z(z_ptr, pairs, pair_ok, row, gate, num_pairs, R_PAD, RK_PAD, SPLIT_K, BLOCK_M, S_PAD).to(dtype)
    z_up = _slice_z(z_ptr, pairs, pair_ok, row, up, num_pairs, R_PAD, RK_PAD, SPLIT_K, BLOCK_M, S_PAD).to(dtype)
    g += _mm(z_gate, b_gate, BLOCK_M < 16, DOT_PRECISION)
    u += _mm(z_up, b_up, BLOCK_M < 16, DOT_PRECISION)
    act = gated_act(g, u, ACT, alpha, limit).to(act_ptr.dtype.element_ty)
    tl.store(act_ptr + rows * stride_act + cols[None, :], act, mask=mask)
    if down_rank > 0:
        acc_down = _mm(act, tl.trans(a_down), BLOCK_M < 16, DOT_PRECISION)
        tl.atomic_add(down_z_ptr + rows * RD_PAD + offs_d[None, :], acc_down,
                      mask=pair_ok[:, None] & down_ok[None, :], sem="relaxed")


@triton.jit(do_not_specialize=["num_pairs"])
def _expand_down_kernel(
    y_ptr,  # [TK, H] model dtype: += w · delta for LoRA pairs
    down_z_ptr,  # [TK, RD_PAD] float32: act @ A_d.T
    topk_weights_ptr,  # [TK] float32
    pool_ptr, pt_ptr, meta_ptr, slots_ptr, flags_ptr, topk_ids_ptr, sorted_ptr, block_group_ptr,
    num_blocks_ptr, num_pairs, top_k, num_experts, num_slots, hidden, stride_y, stride_pt,
    RD_PAD: tl.constexpr, RD_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RUN: tl.constexpr,
    GROUP_M: tl.constexpr,
    PAGE_SHIFT: tl.constexpr, EVEN_N: tl.constexpr, S_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Up to `gdc_wait`: only routing, alignment, metadata and weights (all older than the
    # kernel before this one), so under PDL this overlaps that kernel's tail.
    num_m = _num_tiles(num_blocks_ptr, num_pairs, BLOCK_M)
    num_n = tl.cdiv(hidden, BLOCK_N)
    pid = tl.program_id(0)
    if pid >= num_m * num_n:
        finish_early(USE_PDL)
        return
    pid_m, pid_n = swizzle(pid, num_m, num_n, GROUP_M)
    pairs, pair_ok, slot, expert = _tile(pid_m, slots_ptr, flags_ptr, topk_ids_ptr, sorted_ptr,
                                         block_group_ptr, num_pairs, top_k, num_experts, BLOCK_M)
    row, meta = _slot_row(meta_ptr, flags_ptr, slot, num_slots, S_PAD)
    rank = _field(row, meta + F_DOWN_RANK, S_PAD)
    group_off = _field(row, meta + F_BASE, S_PAD) + expert * _field(row, meta + F_STRIDE, S_PAD)
    if _skip(row, flags_ptr, slot, BLOCK_M, S_PAD) | (rank == 0):
        finish_early(USE_PDL)
        return
    pt = pt_ptr + slot * stride_pt
    offs_r = tl.arange(0, RD_T)
    r_ok = offs_r < rank
    rows = pairs[:, None].to(tl.int64)
    weight = tl.load(topk_weights_ptr + pairs, mask=pair_ok, other=0.0)
    b_virt = group_off + _field(row, meta + F_DOWN_B, S_PAD) + offs_r * ((hidden + 63) // 64 * 64)
    n0 = pid_n * BLOCK_N
    b = load_runs(pool_ptr, pt, b_virt + n0, r_ok, hidden - n0, BLOCK_N, RUN, PAGE_SHIFT, True)
    if USE_PDL:
        gdc_wait()  # down_z and y are complete and visible from here on
    z = tl.load(down_z_ptr + rows * RD_PAD + offs_r[None, :], mask=pair_ok[:, None] & r_ok[None, :], other=0.0)
    delta = _mm(z.to(pool_ptr.dtype.element_ty), b, BLOCK_M < 16, DOT_PRECISION)
    cols = n0 + tl.arange(0, BLOCK_N)
    mask = pair_ok[:, None] & _col_mask(cols, hidden, EVEN_N)[None, :]
    ptrs = y_ptr + rows * stride_y + cols[None, :]
    y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + weight[:, None] * delta
    tl.store(ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launchers


def _check_phase(plan: MoeLoraPlan, **tensors: tuple[torch.Tensor, int, int]) -> None:
    """Each ``name=(tensor, rows, cols)``: that shape, the pool's dtype and device, unit column stride."""
    pool = plan.lora.pool
    for name, (t, rows, cols) in tensors.items():
        if t.shape != (rows, cols) or t.dtype != pool.dtype or t.device != pool.device or t.stride(1) != 1:
            raise ValueError(f"{name} must be [{rows}, {cols}] {pool.dtype} on {pool.device} with unit column "
                             f"stride, got {list(t.shape)} {t.dtype} on {t.device} strides {t.stride()}")
    if plan.lora.meta.inter % 16:
        raise ValueError(f"the Triton kernels need I % 16 == 0, got I={plan.lora.meta.inter} (use the *_ref path)")


def check_weights(plan: MoeLoraPlan, topk_weights: torch.Tensor) -> None:
    """``topk_weights`` must be contiguous [T, K] float32, as ``plan.topk_ids``."""
    if topk_weights.shape != plan.topk_ids.shape or topk_weights.dtype != torch.float32 \
            or not topk_weights.is_contiguous():
        raise ValueError(f"topk_weights must be contiguous {list(plan.topk_ids.shape)} float32, got "
                         f"{list(topk_weights.shape)} {topk_weights.dtype}")


def _chunk(inter: int) -> int:
    """Widest power-of-two run <= 64 dividing I: where the fused format's up columns start."""
    return min(64, inter & -inter)


def _tile_args(plan: MoeLoraPlan) -> tuple:
    lora, align, ids = plan.lora, plan.align, plan.topk_ids
    return (lora.pool, lora.page_table, lora.meta.table, lora.token_slots, lora.meta.slot_flags, ids,
            align.sorted_pairs if align else ids, align.block_group if align else ids,
            align.num_blocks if align else ids, ids.numel(), ids.shape[1], lora.meta.num_experts,
            lora.meta.table.shape[0])


def _num_tile_bound(plan: MoeLoraPlan) -> int:
    return plan.align.max_blocks if plan.align is not None else plan.topk_ids.numel()


def _launch_opts(cfg: dict) -> dict:
    """A stage's launch options; ``"maxnreg"`` (optional) caps its registers per thread."""
    opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    if cfg.get("maxnreg"):
        opts["maxnreg"] = cfg["maxnreg"]
    return opts


def _use_pdl(plan: MoeLoraPlan) -> bool:
    return bool(plan.config.get("pdl")) and gdc_wait is not None and hopper_or_later(plan.topk_ids.device)


def moe_lora_shrink(plan: MoeLoraPlan, x: torch.Tensor) -> None:
    """``plan.gate_up_z`` = split-K partials of ``x[t] @ A_gu[s, e].T`` and ``plan.down_z`` = 0 for every
    LoRA pair (``x`` [T, H] model dtype).  The first launch of `moe_lora_gate_up`, and of the fused path
    (`moe_lora_fused`) before the base gate/up GEMM."""
    meta = plan.lora.meta
    _check_phase(plan, x=(x, plan.topk_ids.shape[0], meta.hidden))
    cfg, page_shift = plan.config, plan.lora.pool.shape[1].bit_length() - 1
    r_pad, _, rd_pad = lora_pads(meta)
    splits, per_split = _split_k(meta.hidden, cfg["split_k"])
    launch(_moe_shrink_kernel, (_num_tile_bound(plan) * splits,),
        x, plan.gate_up_z, plan.down_z, *_tile_args(plan), meta.hidden, x.stride(0), plan.lora.page_table.stride(0),
        R_PAD=r_pad, RD_PAD=rd_pad, SPLIT_K=splits, K_PER_SPLIT=per_split,
        K_TILE=next_pow2(per_split), BLOCK_M=cfg["block_m"], GROUP_M=cfg["shrink"]["group_m"],
        PAGE_SHIFT=page_shift, EVEN_K=meta.hidden % 64 == 0, S_PAD=_slots_pad(plan),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", USE_PDL=_use_pdl(plan),
        WHOLE_K=bool(cfg["shrink"].get("whole_k")), **_launch_opts(cfg["shrink"]))


def moe_lora_down_shrink(plan: MoeLoraPlan, act: torch.Tensor) -> None:
    """``plan.down_z[p] = act[p] @ A_d[s, e].T`` for every LoRA pair with down LoRA (``act`` [TK, I] model
    dtype): the fused path's down shrink as its own pass (config ``"down_shrink": "pass"``), between the
    base GEMMs; `moe_lora_shrink` zeroed ``down_z`` before."""
    meta = plan.lora.meta
    _check_phase(plan, act=(act, plan.topk_ids.numel(), meta.inter))
    cfg, rd_pad = plan.config, lora_pads(meta)[2]
    launch(_moe_shrink_kernel, (_num_tile_bound(plan),),
        act, plan.down_z, plan.down_z, *_tile_args(plan), meta.inter, act.stride(0), plan.lora.page_table.stride(0),
        R_PAD=rd_pad, RD_PAD=rd_pad, SPLIT_K=1, K_PER_SPLIT=cdiv(meta.inter, 64) * 64,
        K_TILE=next_pow2(cdiv(meta.inter, 64) * 64), BLOCK_M=cfg["block_m"], GROUP_M=cfg["shrink"]["group_m"],
        PAGE_SHIFT=plan.lora.pool.shape[1].bit_length() - 1, EVEN_K=meta.inter % 64 == 0, S_PAD=_slots_pad(plan),
        DOT_PRECISION="ieee" if act.dtype == torch.float32 else "tf32", USE_PDL=False, DOWN=True,
        **_launch_opts(cfg["shrink"]))


def moe_lora_gate_up(plan: MoeLoraPlan, x: torch.Tensor, raw: torch.Tensor, act: torch.Tensor, *,
                     shrunk: bool = False) -> None:
    """For every LoRA pair ``p = (t, e)``: ``act[p] = act_fn(h[:I], h[I:])``, ``h = raw[p] + delta_gu``
    (``act_fn``: ``plan.lora.activation``, silu-gated by default).

    ``x`` [T, H] and ``raw`` [TK, 2I] (from `fused_moe.moe_gate_up`) and ``act`` [TK, I]
    (written for LoRA pairs only), all the model dtype.  Also leaves ``act[p] @ A_d.T``
    in ``plan.down_z`` for `moe_lora_down` (or the fused down GEMM, config ``"fused": "down"``).
    ``shrunk``: `moe_lora_shrink` already ran on this plan (on a side stream, beside the base GEMM), so
    only the expand is launched; under PDL it then reads ``raw`` only after its wait for the kernel
    before it, the base GEMM that writes ``raw``.
    """
    meta, num_pairs = plan.lora.meta, plan.topk_ids.numel()
    _check_phase(plan, x=(x, plan.topk_ids.shape[0], meta.hidden), raw=(raw, num_pairs, 2 * meta.inter),
                 act=(act, num_pairs, meta.inter))
    if not shrunk:
        moe_lora_shrink(plan, x)
    cfg, tiles, page_shift = plan.config, _num_tile_bound(plan), plan.lora.pool.shape[1].bit_length() - 1
    r_pad, _, rd_pad = lora_pads(meta)
    rk_tile, rd_tile = tile_ranks(meta, cfg["block_m"])
    splits, _ = _split_k(meta.hidden, cfg["split_k"])
    pdl, precision = _use_pdl(plan), "ieee" if x.dtype == torch.float32 else "tf32"
    stride_pt = plan.lora.page_table.stride(0)
    chunk = _chunk(meta.inter)
    block_n = max(chunk, min(cfg["gate_up"]["block_n"], next_pow2(meta.inter)))
    extra = {"launch_pdl": True} if pdl else {}
    launch(_expand_gate_up_kernel, (tiles * cdiv(meta.inter, block_n),),
        raw, act, plan.gate_up_z, plan.down_z, *_tile_args(plan), meta.inter, raw.stride(0), act.stride(0),
        stride_pt, float(plan.lora.activation.alpha), float(plan.lora.activation.limit), R_PAD=r_pad,
        RK_PAD=rk_tile, RD_PAD=rd_pad, RD_T=rd_tile, SPLIT_K=splits, BLOCK_M=cfg["block_m"], BLOCK_N=block_n,
        CHUNK=chunk, GROUP_M=cfg["gate_up"]["group_m"], PAGE_SHIFT=page_shift, EVEN_N=meta.inter % block_n == 0,
        S_PAD=_slots_pad(plan), DOT_PRECISION=precision, USE_PDL=pdl, ACT=plan.lora.activation.code,
        RAW_AFTER_WAIT=shrunk, **_launch_opts(cfg["gate_up"]), **extra)


def moe_lora_down(plan: MoeLoraPlan, act: torch.Tensor, y: torch.Tensor, topk_weights: torch.Tensor) -> None:
    """For every LoRA pair ``p``: ``y[p] += w[p] · (act[p] @ A_d.T) @ B_d``.

    ``act`` [TK, I] (its A-product was taken by `moe_lora_gate_up`, which must run
    first on the same plan); ``y`` [TK, H] model dtype, updated in place;
    ``topk_weights`` [T, K] float32.
    """
    meta, num_pairs = plan.lora.meta, plan.topk_ids.numel()
    _check_phase(plan, act=(act, num_pairs, meta.inter), y=(y, num_pairs, meta.hidden))
    check_weights(plan, topk_weights)
    cfg, pdl = plan.config, _use_pdl(plan)
    block_n = max(64, min(cfg["down"]["block_n"], next_pow2(meta.hidden)))
    launch(_expand_down_kernel, (_num_tile_bound(plan) * cdiv(meta.hidden, block_n),),
        y, plan.down_z, topk_weights, *_tile_args(plan), meta.hidden, y.stride(0),
        plan.lora.page_table.stride(0), RD_PAD=lora_pads(meta)[2], RD_T=tile_ranks(meta, cfg["block_m"])[1],
        BLOCK_M=cfg["block_m"], BLOCK_N=block_n, RUN=64,
        GROUP_M=cfg["down"]["group_m"], PAGE_SHIFT=plan.lora.pool.shape[1].bit_length() - 1,
        EVEN_N=meta.hidden % block_n == 0, S_PAD=_slots_pad(plan),
        DOT_PRECISION="ieee" if y.dtype == torch.float32 else "tf32",
        USE_PDL=pdl, **_launch_opts(cfg["down"]), **({"launch_pdl": True} if pdl else {}))


# ---------------------------------------------------------------------------------------------
# References (same signatures): per (slot, expert) group, weights gathered through the page table


def _groups(plan: MoeLoraPlan):
    """Yield ``(pairs [n] int64, slot, slot's fields, virtual start of the expert group)`` per group."""
    lora, top_k = plan.lora, plan.topk_ids.shape[1]
    has = lora_pairs(lora.token_slots, lora.meta.slot_flags, top_k)
    slot = lora.token_slots.long().repeat_interleave(top_k)
    key = slot * lora.meta.num_experts + plan.topk_ids.reshape(-1).long()
    table = lora.meta.table.tolist()
    for group in torch.unique(key[has]).tolist():
        s, e = divmod(group, lora.meta.num_experts)
        fields = dict(zip(FIELDS, table[s]))
        start = fields["expert_base"] + e * fields["expert_stride"]
        yield torch.nonzero(has & (key == group)).squeeze(1), s, fields, start


def _read(plan: MoeLoraPlan, slot: int, offset: int, rows: int, cols: int) -> torch.Tensor:
    """A ``[rows, cols]`` matrix of ``slot`` at virtual ``offset``, read through the page table, float32."""
    table = plan.lora.page_table[slot].long()
    return gather_block(plan.lora.pool, table, Block(offset, rows, cols)).float()


def moe_lora_gate_up_ref(plan: MoeLoraPlan, x: torch.Tensor, raw: torch.Tensor, act: torch.Tensor, *,
                         shrunk: bool = False) -> None:
    """Torch version of `moe_lora_gate_up` (float32 math from ``x``, so ``shrunk`` changes nothing; does not
    fill ``plan.down_z``)."""
    meta, top_k = plan.lora.meta, plan.topk_ids.shape[1]
    inter = meta.inter
    for pairs, slot, f, start in _groups(plan):
        h = raw[pairs].float()
        if f["gu_rows"]:
            z = x[pairs // top_k].float() @ _read(plan, slot, start + f["gu_a"], f["gu_rows"], meta.hidden).T
            for j in range(f["gu_slices"]):
                a_row, rank, col, ncols = (f[f"s{j}_{n}"] for n in ("a_row", "rank", "col", "ncols"))
                b = _read(plan, slot, start + f[f"s{j}_b"], rank, ncols)
                h[:, col: col + ncols] += z[:, a_row: a_row + rank] @ b
        act[pairs] = plan.lora.activation.ref(h[:, :inter], h[:, inter:]).to(act.dtype)


def moe_lora_down_ref(plan: MoeLoraPlan, act: torch.Tensor, y: torch.Tensor, topk_weights: torch.Tensor) -> None:
    """Torch version of `moe_lora_down` (float32 math, from ``act``)."""
    meta, weights = plan.lora.meta, topk_weights.reshape(-1)
    for pairs, slot, f, start in _groups(plan):
        rank = f["down_rank"]
        if rank:
            z = act[pairs].float() @ _read(plan, slot, start + f["down_a"], rank, meta.inter).T
            delta = z @ _read(plan, slot, start + f["down_b"], rank, meta.hidden)
            y[pairs] = (y[pairs].float() + weights[pairs, None] * delta).to(y.dtype)
