"""The expert LoRA's down delta fused into the MoE's sum over the top-k choices.

Shape legend as in `fused_moe_lora`: T tokens, K = top_k, TK pairs, H hidden.

The separate pass (`fused_moe_lora.moe_lora_down`) read-modify-writes the down GEMM's
output ``y`` [TK, H] for every LoRA pair, and a second pass sums ``y`` over the K choices.
Here one pass does both::

    out[t] = Σ_j y[t·K + j] + Σ_j w[t·K + j] · down_z[t·K + j] @ B_d[s_t, e_j]      [H]

A program takes one token and one column tile: the K pairs of a token share its adapter
slot, so the program reads one metadata row and one page-table row, then the down B
rows of all K experts at once (K x rank rows, one page lookup per run): K pairs' weight
loads behind one chain of dependent loads, where pair mode pays that chain per pair.
``y`` is read once and never written back.  Tokens without LoRA in this layer read no
weights (their loads are masked off) and just sum.

Used when the launch config's down stage says ``"sum": true``, in any mode: the kernel reads
each pair's ``down_z`` (left by the gate/up pass of pair mode or of group mode) and needs no
alignment.  In group mode it reads a group's B once per pair, where the separate pass reads
it once per tile; at decode loads the pairs of a group are few and those reads mostly hit L2.
Under PDL (config ``"pdl"``) everything up to ``gdc_wait`` reads only the routing,
metadata and weights; ``y`` and ``down_z`` are read after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from unipage.kernels.common import cdiv, gdc_launch_dependents, gdc_wait, load_runs, next_pow2
from unipage.kernels.fused_moe_lora import _col_mask, _launch_opts, _use_pdl, check_weights, moe_lora_down_ref
from unipage.kernels.moe_lora_plan import MoeLoraPlan, _field, _skip, _slot_row, lora_pads, table_pad, tile_ranks
from unipage.kernels.launch import launch
from unipage.kernels.moe_align import F_BASE, F_DOWN_B, F_DOWN_RANK, F_STRIDE

__all__ = ["moe_lora_down_sum", "moe_lora_down_sum_ref", "sums_down"]


@triton.jit(do_not_specialize=["num_tokens"])
def _down_sum_kernel(
    out_ptr,  # [T, H] model dtype: written
    y_ptr,  # [TK, H] model dtype: the base down GEMM's output (routing weight applied)
    down_z_ptr,  # [TK, RD_PAD] float32: act @ A_d.T of LoRA pairs
    topk_weights_ptr,  # [TK] float32
    pool_ptr, pt_ptr, meta_ptr, slots_ptr, flags_ptr, topk_ids_ptr,
    num_tokens, top_k, num_slots, hidden, stride_out, stride_y, stride_pt,
    K_PAD: tl.constexpr, RD_PAD: tl.constexpr, RD_T: tl.constexpr, BLOCK_N: tl.constexpr, RUN: tl.constexpr,
    PAGE_SHIFT: tl.constexpr, EVEN_N: tl.constexpr, S_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # safe while every PDL kernel after this one waits before reading what this one writes
        gdc_launch_dependents()
    num_n = tl.cdiv(hidden, BLOCK_N)
    pid = tl.program_id(0)
    token, n0 = pid // num_n, (pid % num_n) * BLOCK_N
    slot = tl.load(slots_ptr + token)
    row, meta = _slot_row(meta_ptr, flags_ptr, slot, num_slots, S_PAD)
    # 0 where the token has no LoRA in this layer: then every weight row is masked off
    rank = tl.where(_skip(row, flags_ptr, slot, 1, S_PAD), 0, _field(row, meta + F_DOWN_RANK, S_PAD))
    # weight rows: pair j's rank row r is row j·RD_T + r
    jr = tl.arange(0, K_PAD * RD_T)
    j_of, r_of = jr // RD_T, jr % RD_T
    row_ok = (j_of < top_k) & (r_of < rank)
    pair_of = token.to(tl.int64) * top_k + j_of
    expert = tl.load(topk_ids_ptr + pair_of, mask=row_ok, other=0)
    w_row = tl.load(topk_weights_ptr + pair_of, mask=row_ok, other=0.0)
    group_off = _field(row, meta + F_BASE, S_PAD) + expert * _field(row, meta + F_STRIDE, S_PAD)
    b_virt = group_off + _field(row, meta + F_DOWN_B, S_PAD) + r_of * ((hidden + 63) // 64 * 64)
    b = load_runs(pool_ptr, pt_ptr + tl.maximum(slot, 0) * stride_pt, b_virt + n0, row_ok, hidden - n0, BLOCK_N,
                  RUN, PAGE_SHIFT, True)
    j = tl.arange(0, K_PAD)
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = _col_mask(cols, hidden, EVEN_N)
    pairs = token.to(tl.int64) * top_k + j
    if USE_PDL:
        gdc_wait()  # y and down_z are complete and visible from here on
    y = tl.load(y_ptr + pairs[:, None] * stride_y + cols[None, :], mask=(j < top_k)[:, None] & col_ok[None, :],
                other=0.0)
    z = tl.load(down_z_ptr + pair_of * RD_PAD + r_of, mask=row_ok, other=0.0) * w_row
    acc = tl.sum(y.to(tl.float32), axis=0) + tl.sum(z[:, None] * b.to(tl.float32), axis=0)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def sums_down(plan: MoeLoraPlan) -> bool:
    """Whether ``plan`` adds its down delta in the top-k sum (`moe_lora_down_sum`): the down stage's
    ``"sum": true``, in any mode, for a step of at most its ``"sum_max_tokens"`` tokens (default: any).
    The bound is for group-mode entries: this kernel reads a group's B once per pair, which stops
    paying once those reads spill out of L2 (many tokens over many adapters at the same load)."""
    down = plan.config["down"]
    limit, mode = down.get("sum_max_tokens"), down.get("sum", False)
    if type(mode) is not bool:
        raise ValueError(f'lora config "down.sum" must be true or false, got {mode!r}')
    return mode and (limit is None or plan.topk_ids.shape[0] <= limit)


def _check(plan: MoeLoraPlan, y: torch.Tensor, topk_weights: torch.Tensor) -> None:
    meta, ids = plan.lora.meta, plan.topk_ids
    pool = plan.lora.pool
    if y.shape != (ids.numel(), meta.hidden) or y.dtype != pool.dtype or y.device != pool.device \
            or not y.is_contiguous():
        raise ValueError(f"y must be contiguous [{ids.numel()}, {meta.hidden}] {pool.dtype} on {pool.device}, "
                         f"got {list(y.shape)} {y.dtype} on {y.device}")
    check_weights(plan, topk_weights)


def moe_lora_down_sum(plan: MoeLoraPlan, act: torch.Tensor, y: torch.Tensor,
                      topk_weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = Σ_j (y[p] + w[p] · (act[p] @ A_d.T) @ B_d)`` over token ``t``'s pairs ``p = t·K + j``
    (the delta for LoRA pairs only), the sum in float32 and rounded once.

    ``act`` [TK, I] is not read: its A-product is ``plan.down_z``, left by `moe_lora_gate_up` on the
    same plan; ``y`` [TK, H] model dtype (not changed); ``topk_weights`` [T, K] float32.  Returns
    ``out`` [T, H] in the model dtype.
    """
    _check(plan, y, topk_weights)
    lora, meta = plan.lora, plan.lora.meta
    num_tokens, top_k = plan.topk_ids.shape
    out = torch.empty(num_tokens, meta.hidden, dtype=y.dtype, device=y.device)
    cfg, pdl = plan.config["down"], _use_pdl(plan)
    block_n = max(64, min(cfg["block_n"], next_pow2(meta.hidden)))
    launch(_down_sum_kernel, (num_tokens * cdiv(meta.hidden, block_n),),
        out, y, plan.down_z, topk_weights, lora.pool, lora.page_table, meta.table, lora.token_slots,
        meta.slot_flags, plan.topk_ids, num_tokens, top_k, meta.table.shape[0], meta.hidden, out.stride(0),
        y.stride(0), lora.page_table.stride(0), K_PAD=next_pow2(top_k), RD_PAD=lora_pads(meta)[2],
        RD_T=tile_ranks(meta, 1)[1], BLOCK_N=block_n, RUN=64, PAGE_SHIFT=lora.pool.shape[1].bit_length() - 1,
        EVEN_N=meta.hidden % block_n == 0, S_PAD=table_pad(plan), USE_PDL=pdl, **_launch_opts(cfg),
        **({"launch_pdl": True} if pdl else {}))
    return out


def moe_lora_down_sum_ref(plan: MoeLoraPlan, act: torch.Tensor, y: torch.Tensor,
                          topk_weights: torch.Tensor) -> torch.Tensor:
    """Torch version of `moe_lora_down_sum` (float32 math, the delta from ``act``)."""
    _check(plan, y, topk_weights)
    full = y.to(torch.float32, copy=True)
    moe_lora_down_ref(plan, act, full, topk_weights)
    num_tokens, top_k = plan.topk_ids.shape
    return full.view(num_tokens, top_k, -1).sum(dim=1).to(y.dtype)
