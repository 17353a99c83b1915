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

``"sum": "dense"`` computes the same ``out`` as a GEMM over every expert (`_down_dense_kernel`): for
the tokens of one slot, the delta is ``D [tokens, E·RD] @ B_d[s, all experts] [E·RD, H]`` with
``D[t, e·RD + r] = w[p] · down_z[p, r]`` for the pair ``p`` of token ``t`` routed to ``e`` (zero for the
experts it was not routed to).  A program takes ``"dense_m"`` consecutive tokens and one column tile,
and walks the experts ``"dense_experts"`` at a time, once per distinct slot among its tokens (tokens
in runs of one adapter, as the engine's batches are, give one or two): a slot's B rows are read once
per program, not once per pair, and the products run on the tensor cores (16× the useful FLOPs at
top-8 of 128 experts, which cost nothing beside the weight reads).  B rows of experts none of the
program's tokens of that slot were routed to are not read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from unipage.kernels.common import cdiv, gdc_launch_dependents, gdc_wait, load_runs, next_pow2
from unipage.kernels.fused_moe_lora import _col_mask, _launch_opts, _use_pdl, check_weights, moe_lora_down_ref
from unipage.kernels.moe_lora_plan import MoeLoraPlan, _field, _skip, _slot_row, lora_pads, table_pad, tile_ranks
from unipage.kernels.launch import launch
from unipage.kernels.moe_align import F_BASE, F_DOWN_B, F_DOWN_RANK, F_STRIDE, NUM_FIELDS

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


NONE = tl.constexpr(1 << 30)  # "no slot": larger than any slot id


@triton.jit
def _routed(ids, w, e, mine):
    """For experts ``e`` [EB]: ``(k, w, hit)`` [BM, EB]: the top-k position at which each token chose the
    expert, its routing weight, and whether it did (and is one of ``mine``)."""
    match = ids[:, :, None] == e[None, None, :]  # [BM, K_PAD, EB]; a token picks an expert at most once
    j = tl.arange(0, ids.shape[1])
    k = tl.sum(tl.where(match, j[None, :, None], 0), 1)
    weight = tl.sum(tl.where(match, w[:, :, None], 0.0), 1)
    hit = (tl.max(match.to(tl.int32), 1) > 0) & mine[:, None]
    return k, weight, hit


@triton.jit
def _per_rank(x, RD_T: tl.constexpr):
    """``[BM, EB]`` -> ``[BM, EB·RD_T]``: each expert's value repeated over its rank columns."""
    return tl.reshape(tl.broadcast_to(x[:, :, None], (x.shape[0], x.shape[1], RD_T)),
                      (x.shape[0], x.shape[1] * RD_T))


@triton.jit(do_not_specialize=["num_tokens"])
def _down_dense_kernel(
    out_ptr, y_ptr, down_z_ptr, topk_weights_ptr,  # as `_down_sum_kernel`'s
    pool_ptr, pt_ptr, meta_ptr, slots_ptr, flags_ptr, topk_ids_ptr,
    num_tokens, top_k, num_experts, hidden, stride_out, stride_y, stride_pt,
    K_PAD: tl.constexpr, RD_PAD: tl.constexpr, RD_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EXPERTS: tl.constexpr, RUN: tl.constexpr, PAGE_SHIFT: tl.constexpr, EVEN_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # safe while every PDL kernel after this one waits before reading what this one writes
        gdc_launch_dependents()
    num_n = tl.cdiv(hidden, BLOCK_N)
    pid = tl.program_id(0)
    toks = (pid // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = (pid % num_n) * BLOCK_N
    tok_ok = toks < num_tokens
    slot = tl.load(slots_ptr + toks, mask=tok_ok, other=-1)
    flag = tl.load(flags_ptr + tl.maximum(slot, 0), mask=slot >= 0, other=0)
    slot = tl.where(flag != 0, slot, NONE)  # NONE: no LoRA in this layer
    j = tl.arange(0, K_PAD)
    pairs = toks.to(tl.int64)[:, None] * top_k + j[None, :]  # [BM, K_PAD]
    pair_ok = tok_ok[:, None] & (j < top_k)[None, :]
    ids = tl.load(topk_ids_ptr + pairs, mask=pair_ok & (slot < NONE)[:, None], other=-1)
    w = tl.load(topk_weights_ptr + pairs, mask=pair_ok, other=0.0)
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = _col_mask(cols, hidden, EVEN_N)
    c = tl.arange(0, EXPERTS * RD_T)  # the K columns of a step: expert c // RD_T, rank row c % RD_T
    r = c % RD_T
    row_stride = (hidden + 63) // 64 * 64
    if USE_PDL:
        gdc_wait()  # y and down_z are complete and visible from here on
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    s = tl.min(slot, 0)
    while s < NONE:  # each distinct slot among the tokens, smallest first
        at = meta_ptr + s * NUM_FIELDS
        rank = tl.load(at + F_DOWN_RANK)
        base = tl.load(at + F_BASE)
        stride = tl.load(at + F_STRIDE)
        b_off = tl.load(at + F_DOWN_B)
        pt = pt_ptr + s.to(tl.int64) * stride_pt
        mine = slot == s
        for e0 in range(0, num_experts, EXPERTS):
            k, weight, hit = _routed(ids, w, e0 + tl.arange(0, EXPERTS), mine)
            k, weight, hit = _per_rank(k, RD_T), _per_rank(weight, RD_T), _per_rank(hit, RD_T)
            ok = hit & (r < rank)[None, :]
            d = tl.load(down_z_ptr + (toks.to(tl.int64)[:, None] * top_k + k) * RD_PAD + r[None, :], mask=ok,
                        other=0.0) * weight
            expert = e0 + c // RD_T
            used = (tl.max(ok.to(tl.int32), 0) > 0) & (expert < num_experts)  # [EB·RD_T] rows to read
            b = load_runs(pool_ptr, pt, base + expert * stride + b_off + r * row_stride + n0, used, hidden - n0,
                          BLOCK_N, RUN, PAGE_SHIFT, True)
            acc = tl.dot(d, b.to(tl.float32), acc, input_precision=DOT_PRECISION)
        s = tl.min(slot + (slot <= s).to(tl.int32) * NONE, 0)  # the next slot id (NONE: none left)
    y_rows = y_ptr + toks.to(tl.int64)[:, None] * top_k * stride_y + cols[None, :]
    for k in tl.static_range(K_PAD):  # the base's sum over the K choices, one [BM, BN] load at a time
        k_ok = tok_ok & (tl.full([BLOCK_M], k, tl.int32) < top_k)
        y = tl.load(y_rows + k * stride_y, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += y.to(tl.float32)
    out = out_ptr + toks.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=tok_ok[:, None] & col_ok[None, :])


def sums_down(plan: MoeLoraPlan) -> bool:
    """Whether ``plan`` adds its down delta in the top-k sum (`moe_lora_down_sum`): the down stage's
    ``"sum": true``, in any mode, for a step of at most its ``"sum_max_tokens"`` tokens (default: any).
    The bound is for group-mode entries: this kernel reads a group's B once per pair, which stops
    paying once those reads spill out of L2 (many tokens over many adapters at the same load)."""
    down = plan.config["down"]
    limit = down.get("sum_max_tokens")
    return bool(_sum_mode(down)) and (limit is None or plan.topk_ids.shape[0] <= limit)


SUM_MODES = (False, True, "dense")


def _sum_mode(down: dict):
    """The down stage's ``"sum"``: false (the separate down pass), true (`_down_sum_kernel`) or "dense"
    (`_down_dense_kernel`)."""
    mode = down.get("sum", False)
    if type(mode) not in (bool, str) or mode not in SUM_MODES:
        raise ValueError(f'lora config "down.sum" must be false, true or "dense", got {mode!r}')
    return mode


def _dense_tile(down: dict, rd_t: int) -> tuple[int, int]:
    """``(tokens, experts)`` of a dense program's tile and K step (``"dense_m"``, default 32, and
    ``"dense_experts"``, default 8): powers of two, at least 16 tokens and 16 K columns (the dot's minimum)."""
    rows, experts = down.get("dense_m", 32), down.get("dense_experts", 8)
    for key, value in (("dense_m", rows), ("dense_experts", experts)):
        if type(value) is not int or value < 1 or value & (value - 1):
            raise ValueError(f'lora config "down.{key}" must be a power of two, got {value!r}')
    if rows < 16:
        raise ValueError(f'lora config "down.dense_m" must be at least 16 (a dot\'s rows), got {rows}')
    return rows, max(experts, 16 // rd_t)


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
    if _sum_mode(cfg) == "dense":
        _dense(plan, y, topk_weights, out, block_n, pdl)
        return out
    launch(_down_sum_kernel, (num_tokens * cdiv(meta.hidden, block_n),),
        out, y, plan.down_z, topk_weights, lora.pool, lora.page_table, meta.table, lora.token_slots,
        meta.slot_flags, plan.topk_ids, num_tokens, top_k, meta.table.shape[0], meta.hidden, out.stride(0),
        y.stride(0), lora.page_table.stride(0), K_PAD=next_pow2(top_k), RD_PAD=lora_pads(meta)[2],
        RD_T=tile_ranks(meta, 1)[1], BLOCK_N=block_n, RUN=64, PAGE_SHIFT=lora.pool.shape[1].bit_length() - 1,
        EVEN_N=meta.hidden % block_n == 0, S_PAD=table_pad(plan), USE_PDL=pdl, **_launch_opts(cfg),
        **({"launch_pdl": True} if pdl else {}))
    return out


def _dense(plan: MoeLoraPlan, y: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor, block_n: int,
           pdl: bool) -> None:
    """`moe_lora_down_sum` by `_down_dense_kernel`."""
    lora, meta, cfg = plan.lora, plan.lora.meta, plan.config["down"]
    num_tokens, top_k = plan.topk_ids.shape
    rd_t = tile_ranks(meta, 1)[1]
    rows, experts = _dense_tile(cfg, rd_t)
    launch(_down_dense_kernel, (cdiv(num_tokens, rows) * cdiv(meta.hidden, block_n),),
        out, y, plan.down_z, topk_weights, lora.pool, lora.page_table, meta.table, lora.token_slots,
        meta.slot_flags, plan.topk_ids, num_tokens, top_k, meta.num_experts, meta.hidden, out.stride(0),
        y.stride(0), lora.page_table.stride(0), K_PAD=next_pow2(top_k), RD_PAD=lora_pads(meta)[2], RD_T=rd_t,
        BLOCK_M=rows, BLOCK_N=block_n, EXPERTS=experts, RUN=64, PAGE_SHIFT=lora.pool.shape[1].bit_length() - 1,
        EVEN_N=meta.hidden % block_n == 0, DOT_PRECISION="ieee" if y.dtype == torch.float32 else "tf32",
        USE_PDL=pdl, **_launch_opts(cfg), **({"launch_pdl": True} if pdl else {}))


def moe_lora_down_sum_ref(plan: MoeLoraPlan, act: torch.Tensor, y: torch.Tensor,
                          topk_weights: torch.Tensor) -> torch.Tensor:
    """Torch version of `moe_lora_down_sum` (float32 math, the delta from ``act``)."""
    _check(plan, y, topk_weights)
    full = y.to(torch.float32, copy=True)
    moe_lora_down_ref(plan, act, full, topk_weights)
    num_tokens, top_k = plan.topk_ids.shape
    return full.view(num_tokens, top_k, -1).sum(dim=1).to(y.dtype)
