"""Fused MoE of the base model: top-k routing (`moe_route`), token-to-expert alignment, grouped
gate/up GEMM with the SiLU-gated activation in its epilogue, grouped down GEMM
with the routing weight in its epilogue, and the sum over the K choices.

Shape legend: T = tokens, H = hidden, I = expert intermediate, E = experts,
K = top_k, TK = T·K routed pairs (pair ``p`` = token ``p // K``, choice ``p % K``).

Weights in transformers' layout (``Qwen3MoeExperts``)::

    w_gate_up [E, 2I, H]   gate rows [0, I), then up rows [I, 2I);  h = x @ w_gate_up[e].T
    w_down    [E, H, I]

Math, for token ``t`` routed to experts ``e_j`` with weights ``w_j`` (j < K)::

    g_j, u_j = x[t] @ w_gate_up[e_j, :I].T,  x[t] @ w_gate_up[e_j, I:].T      # [I] each
    act_j    = silu(g_j) · u_j                      silu(g) = g · sigmoid(g)
    out[t]   = Σ_j w_j · (act_j @ w_down[e_j].T)                                # [H]

Optional, for GPT-OSS: per-expert biases (``g_j, u_j`` get ``gate_up_bias[e_j]``
before the activation, the down product ``down_bias[e_j]`` inside the routing
weight) and another gated activation (`unipage.kernels.moe_act`).

With LoRA (`unipage.kernels.fused_moe_lora`) ``g_j, u_j`` get their LoRA deltas
before the activation and the down output its delta before the routing weight:
pairs of tokens with LoRA leave the gate/up GEMM un-activated (``raw``) and the
LoRA gate/up pass adds the delta and applies the activation.  With the "lora"
config's ``"overlap"`` the LoRA plan and shrink run on a side stream beside the
base alignment and gate/up GEMM (`unipage.kernels.moe_lora_side`).

Each launcher has a torch reference with the same signature (``*_ref``): the
engine's CPU path and the tests' oracle.  Intermediates are rounded to the
model dtype at the same points in both.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch
import triton
import triton.language as tl
from unipage.kernels import fused_moe_lora as lora_ops
from unipage.kernels import moe_lora_fused as lora_fused
from unipage.kernels import moe_lora_side as side
from unipage.kernels import moe_lora_stack as lora_stack
from unipage.kernels import moe_lora_sum as lora_sum
from unipage.kernels.common import cdiv, config_devices, hopper_or_later, next_pow2
from unipage.kernels.launch import launch
from unipage.kernels.moe_act import SILU, GatedActivation, gated_act
from unipage.kernels.moe_align import (
    Alignment,
    launch_config,
    lora_pairs,
    moe_align,
    moe_align_ref,
    shape_key,
    swizzle,
)
from unipage.kernels.moe_route import route_topk, route_topk_ref  # (the routing: `fused_moe` runs it)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# ---------------------------------------------------------------------------------------------
# Grouped GEMM


@triton.jit
def _load_w(w_src, ptrs, row, col, k_ok, USE_TMA: tl.constexpr, EVEN_K: tl.constexpr):
    """A ``[BK, BN]`` tile of ``W[e].T``: by TMA from a descriptor over ``[E·rows, K]``
    (rows ``row..row+BN``, columns ``col..col+BK``; out of bounds reads 0), or by pointers."""
    if USE_TMA:
        w = tl.trans(w_src.load([row, col]))
    elif EVEN_K:
        w = tl.load(ptrs)
    else:
        w = tl.load(ptrs, mask=k_ok[:, None], other=0.0)
    return w


@triton.jit
def _add_bias(acc, acc_up, bias_ptr, cols, N, GATED: tl.constexpr):
    """The expert's output bias (``bias_ptr``: its row of ``[E, W_rows]``) added to the tile's columns."""
    acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc_up += tl.load(bias_ptr + N + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    return acc, acc_up


@triton.jit
def _store_raw(acc, acc_up, raw_ptr, slots_ptr, flags_ptr, a_rows, pairs, pair_ok, cols, mask, N, stride_rm):
    """Store the un-activated gate | up of the tile's pairs whose token's slot has expert LoRA into ``raw``;
    returns ``mask`` without those rows (their ``act`` is the LoRA pass's to write)."""
    slot = tl.load(slots_ptr + a_rows, mask=pair_ok, other=-1)
    lora = tl.load(flags_ptr + tl.maximum(slot, 0), mask=slot >= 0, other=0) != 0
    raw_ptrs = raw_ptr + pairs[:, None].to(tl.int64) * stride_rm + cols[None, :]
    tl.store(raw_ptrs, acc.to(raw_ptr.dtype.element_ty), mask=mask & lora[:, None])
    tl.store(raw_ptrs + N, acc_up.to(raw_ptr.dtype.element_ty), mask=mask & lora[:, None])
    return mask & ~lora[:, None]


@triton.jit(do_not_specialize=["num_pairs", "num_ranks"])
def _moe_gemm_kernel(
    a_ptr,  # [rows, K_dim]: x [T, H] (gate/up, row = pair // a_div) or act [TK, I] (down, row = pair)
    w_src,  # [E, W_rows, K_dim], unit stride along K_dim (W_rows = 2N gate/up, N down); a TMA
    #         descriptor over its [E·W_rows, K_dim] view when USE_TMA
    out_ptr,  # [TK, N]: act (gate/up) or y (down), rows = pairs
    raw_ptr,  # [TK, 2N] un-activated gate|up of LoRA pairs (HAS_LORA)
    topk_weights_ptr,  # [TK] float32 (MUL_WEIGHT)
    bias_ptr,  # [E, W_rows] the experts' output bias (HAS_BIAS), added before the activation / weight
    sorted_ptr, block_expert_ptr, num_blocks_ptr,  # the `Alignment` (groups = experts)
    slots_ptr, flags_ptr,  # [T] int32 token slots, [S] int32 slot has expert LoRA (HAS_LORA or FUSED)
    # FUSED (`moe_lora_fused`): z [SPLIT_K, TK, R_PAD] float32 (gate/up: x @ A_gu.T partials; down:
    # down_z), down_z [TK, RD_PAD] float32 (gate/up: += act @ A_d.T), the pool layer [N, P], page table
    # [S, max_pages] int32, LoRA metadata [S, NUM_FIELDS] int32, RANKED: the slots' ranks [S_PAD] and the
    # ranks' slots [A_PAD] int32 (`moe_ranks.slot_ranks`), ranks below num_ranks
    z_ptr, down_z_ptr, pool_ptr, pt_ptr, meta_ptr, ranks_ptr, inverse_ptr,
    # EXT (`moe_lora_stack`): the extra K block's operand [TK, EXT_L], weights [E, W_rows, EXT_L] and each
    # slot's entry (int32; the token slots in slots_ptr)
    ext_a_ptr, ext_w_ptr, entry_ptr,
    num_pairs, N, K_dim, a_div, w_rows, top_k, num_ranks, stride_pt,
    stride_am, stride_we, stride_wn, stride_om, stride_rm, stride_ea, stride_ewe, alpha, limit,
    GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr, EVEN_K: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FUSED: tl.constexpr = False, R_PAD: tl.constexpr = 16,
    RK: tl.constexpr = 16, RD: tl.constexpr = 16, RD_PAD: tl.constexpr = 16, SPLIT_K: tl.constexpr = 1,
    CHUNK_SLOTS: tl.constexpr = 1, DOWN_SLOTS: tl.constexpr = 1,
    STEPS: tl.constexpr = 2,
    RUN: tl.constexpr = 16, PAGE_SHIFT: tl.constexpr = 6, DOWN_SHRINK: tl.constexpr = True,
    RANKED: tl.constexpr = False, EXT: tl.constexpr = False, EXT_K: tl.constexpr = 16, EXT_L: tl.constexpr = 16,
    EXT_ROWS: tl.constexpr = 16,
):
    num_m = tl.load(num_blocks_ptr)
    num_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    if pid >= num_m * num_n:
        return
    pid_m, pid_n = swizzle(pid, num_m, num_n, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    a_rows = tl.where(pair_ok, pairs // a_div, 0)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_row = expert * w_rows + pid_n * BLOCK_N  # TMA: a tile past N reads the next rows, never stored
    if USE_TMA:
        w_ptrs, up_ptrs = w_src, w_src
    else:
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N  # wrapped: loads need no column mask
        w_ptrs = w_src + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
        up_ptrs = w_ptrs + N * stride_wn
    n0 = pid_n * BLOCK_N
    if FUSED:  # the first LoRA step's addressing before the main loop, which hides its chain of loads
        slot, prep, prep_down = lora_fused.first_steps(slots_ptr, flags_ptr, ranks_ptr, inverse_ptr, num_ranks, pairs,
                                                       pair_ok, top_k, expert, n0, N, pt_ptr, meta_ptr, stride_pt,
                                                       R_PAD, RK, RD, CHUNK_SLOTS, DOWN_SLOTS, BLOCK_N, RUN,
                                                       PAGE_SHIFT, GATED, DOWN_SHRINK, RANKED)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(tl.cdiv(K_dim, BLOCK_K)):
        k_ok = offs_k < K_dim - k * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs, mask=pair_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        w = _load_w(w_src, w_ptrs, w_row, k * BLOCK_K, k_ok, USE_TMA, EVEN_K)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            w_up = _load_w(w_src, up_ptrs, w_row + N, k * BLOCK_K, k_ok, USE_TMA, EVEN_K)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        if not USE_TMA:
            w_ptrs += BLOCK_K
            up_ptrs += BLOCK_K
    if FUSED:  # the LoRA deltas as extra K steps into the same accumulators, after the main loop
        if GATED:
            acc, acc_up = lora_fused.gate_up_delta(acc, acc_up, prep, slot, pairs, expert, n0, N, num_pairs, z_ptr,
                                                   pool_ptr, pt_ptr, meta_ptr, inverse_ptr, stride_pt, R_PAD, RK,
                                                   SPLIT_K, CHUNK_SLOTS, STEPS, BLOCK_N, RUN, PAGE_SHIFT,
                                                   DOT_PRECISION, RANKED)
        else:
            acc = lora_fused.down_delta(acc, prep_down, slot, pairs, expert, n0, N, z_ptr, pool_ptr, pt_ptr, meta_ptr,
                                        inverse_ptr, stride_pt, RD, RD_PAD, CHUNK_SLOTS, STEPS, BLOCK_N, RUN,
                                        PAGE_SHIFT, DOT_PRECISION, RANKED)
    cols = n0 + tl.arange(0, BLOCK_N)
    if EXT:  # the stacked LoRA's deltas: one more K block, plain loads (no pages, no metadata)
        acc, acc_up = lora_stack.ext_delta(acc, acc_up, ext_a_ptr, ext_w_ptr, entry_ptr, slots_ptr, pairs, pair_ok,
                                           top_k, expert, cols, N, stride_ea, stride_ewe, GATED, EXT_K, EXT_L,
                                           EXT_ROWS, DOT_PRECISION)
    mask = pair_ok[:, None] & (cols[None, :] < N)
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_om + cols[None, :]
    if HAS_BIAS:
        acc, acc_up = _add_bias(acc, acc_up, bias_ptr + expert * w_rows, cols, N, GATED)
    if GATED:
        if HAS_LORA:  # the LoRA pairs' rows go to raw, un-activated, for the separate LoRA pass
            mask = _store_raw(acc, acc_up, raw_ptr, slots_ptr, flags_ptr, a_rows, pairs, pair_ok, cols, mask, N,
                              stride_rm)
        acc = gated_act(acc, acc_up, ACT, alpha, limit)
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pairs, mask=pair_ok, other=0.0)[:, None]
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptrs, out, mask=mask)
    if FUSED and GATED and DOWN_SHRINK:  # the down shrink, from act as stored
        lora_fused.down_shrink(out, prep_down, slot, pairs, expert, n0, N, down_z_ptr, pool_ptr, pt_ptr, meta_ptr,
                               inverse_ptr, stride_pt, RD, RD_PAD, DOWN_SLOTS, STEPS, BLOCK_N, RUN, PAGE_SHIFT,
                               DOT_PRECISION, RANKED)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _weight_source(w: torch.Tensor, cfg: dict):
    """``w`` itself, or (config ``"tma"`` on Hopper+) a TMA descriptor over its ``[E·rows, K]`` view."""
    if not cfg.get("tma") or (w.is_cuda and not hopper_or_later(w.device)):
        return w, False  # (on CPU only the interpreter runs kernels: it emulates TMA)
    if not w.is_contiguous() or (w.shape[2] * w.element_size()) % 16:
        raise ValueError(f"TMA needs contiguous weights with 16-byte rows, got {list(w.shape)} {w.stride()}")
    from triton.tools.tensor_descriptor import TensorDescriptor

    flat = w.view(-1, w.shape[2])
    return TensorDescriptor.from_tensor(flat, block_shape=[cfg["block_n"], cfg["block_k"]]), True


def _launch_gemm(a, w, out, align: Alignment, cfg: dict, *, n: int, a_div: int, gated: bool,
                 weights=None, raw=None, token_slots=None, slot_flags=None, bias=None,
                 activation: GatedActivation = SILU, fused=None, ext: lora_stack.Ext | None = None) -> None:
    """``fused``: a `moe_lora_plan.MoeLoraPlan` whose LoRA deltas the GEMM adds (`moe_lora_fused`);
    ``ext``: the stacked LoRA's extra K block (`moe_lora_stack`)."""
    k_dim, has_lora = a.shape[1], raw is not None
    w_src, tma = _weight_source(w, cfg)
    grid = (align.max_blocks * cdiv(n, cfg["block_n"]),)
    if fused is not None:
        token_slots, slot_flags = fused.lora.token_slots, fused.lora.meta.slot_flags
        lora_args, lora_consts = lora_fused.gemm_args(fused, gated, cfg["block_n"])
    else:
        lora_args, lora_consts = (out, out, out, out, out, out, out, 1, 0, 0), {}
    if ext is not None:  # (the kernel's top_k finds a pair's token, also in the down GEMM, whose a_div is 1)
        token_slots = ext.token_slots
        top_k, num_ranks, stride_pt = ext.top_k, 0, 0
        lora_args = (*lora_args[:7], top_k, num_ranks, stride_pt)
        ext_args = (ext.a, ext.w, ext.entry_of_slot)
        lora_consts = {**lora_consts, "EXT": True, "EXT_K": next_pow2(ext.a.shape[1]), "EXT_L": ext.a.shape[1],
                       "EXT_ROWS": ext.rows}
    else:
        ext_args = (out, out, out)
    launch(_moe_gemm_kernel, grid,
        a, w_src, out, raw if has_lora else out, weights if weights is not None else out,
        bias if bias is not None else out, align.sorted_pairs, align.block_group, align.num_blocks,
        token_slots if token_slots is not None else align.sorted_pairs,
        slot_flags if slot_flags is not None else align.sorted_pairs, *lora_args[:7], *ext_args,
        align.num_pairs, n, k_dim, a_div, w.shape[1], *lora_args[7:], a.stride(0), w.stride(0), w.stride(1),
        out.stride(0), raw.stride(0) if has_lora else 0, ext.a.stride(0) if ext else 0,
        ext.w.stride(0) if ext else 0, float(activation.alpha), float(activation.limit),
        GATED=gated, MUL_WEIGHT=weights is not None, HAS_LORA=has_lora, HAS_BIAS=bias is not None,
        ACT=activation.code,
        EVEN_K=k_dim % cfg["block_k"] == 0, USE_TMA=tma, DOT_PRECISION=_dot_precision(a.dtype),
        BLOCK_M=align.block_m, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], GROUP_M=cfg["group_m"],
        **lora_ops._launch_opts(cfg), **lora_consts)  # ("maxnreg": `moe_lora_fused.fused_base`)


# ---------------------------------------------------------------------------------------------
# Argument checks


def _check_tensor(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype, device) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise ValueError(f"{name} must be {list(shape)} {dtype} on {device}, got "
                         f"{list(t.shape)} {t.dtype} on {t.device}")
    if t.dim() and t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got strides {t.stride()}")


def check_experts_args(x, w_gate_up, w_down, topk_weights, topk_ids) -> tuple[int, int, int, int, int]:
    """Validate the fused-MoE inputs; return ``(T, H, I, E, K)``."""
    if x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be [T, H] float16/bfloat16/float32, got {list(x.shape)} {x.dtype}")
    if w_gate_up.dim() != 3 or w_gate_up.shape[1] % 2:
        raise ValueError(f"w_gate_up must be [E, 2I, H], got {list(w_gate_up.shape)}")
    num_tokens, hidden = x.shape
    num_experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    top_k = topk_ids.shape[-1] if topk_ids.dim() == 2 else -1
    _check_tensor("x", x, (num_tokens, hidden), x.dtype, x.device)
    _check_tensor("w_gate_up", w_gate_up, (num_experts, 2 * inter, hidden), x.dtype, x.device)
    _check_tensor("w_down", w_down, (num_experts, hidden, inter), x.dtype, x.device)
    _check_tensor("topk_ids", topk_ids, (num_tokens, top_k), torch.int32, x.device)
    _check_tensor("topk_weights", topk_weights, (num_tokens, top_k), torch.float32, x.device)
    if not (topk_ids.is_contiguous() and topk_weights.is_contiguous()):
        raise ValueError("topk_ids and topk_weights must be contiguous")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, E={num_experts}], got {top_k}")
    return num_tokens, hidden, inter, num_experts, top_k


def base_config(num_experts: int, hidden: int, inter: int, topk_ids: torch.Tensor, config: dict | None) -> dict:
    """The launch config: ``config`` if given, else the tuned entry for the pairs per expert."""
    if config is not None:
        return config
    return launch_config("base", shape_key(hidden, inter, num_experts, topk_ids.shape[-1]),
                         topk_ids.numel() / num_experts, config_devices(topk_ids.device))


def _check_bias(bias, w: torch.Tensor) -> None:
    if bias is not None:
        _check_tensor("bias", bias, tuple(w.shape[:2]), w.dtype, w.device)
        if not bias.is_contiguous():
            raise ValueError("bias must be contiguous")


def _check_stage(x, w, act_or_y, topk_ids, rows: int, cols: int) -> None:
    _check_tensor("output", act_or_y, (rows, cols), x.dtype, x.device)
    if w.dtype != x.dtype or w.stride(-1) != 1:
        raise ValueError(f"weights must be {x.dtype} with unit stride along K, got {w.dtype} {w.stride()}")
    if topk_ids.dtype != torch.int32 or topk_ids.numel() != rows:
        raise ValueError(f"topk_ids must be int32 with {rows} pairs, got {topk_ids.dtype} {topk_ids.numel()}")


# ---------------------------------------------------------------------------------------------
# Stages (launcher + reference each)


def moe_gate_up(x, w_gate_up, topk_ids, align: Alignment, act, raw=None, token_slots=None,
                slot_flags=None, config: dict | None = None, *, bias=None,
                activation: GatedActivation = SILU, lora_plan=None, ext=None) -> None:
    """``act[p] = activation(x[t] @ Wg[e].T, x[t] @ Wu[e].T)`` for every pair ``p = (t, e)``.

    ``x`` [T, H]; ``w_gate_up`` [E, 2I, H]; ``topk_ids`` [T, K] int32; ``align`` from
    `moe_align` (groups = experts); ``act`` [TK, I] (written).  With ``raw`` [TK, 2I],
    ``token_slots`` [T] int32 and ``slot_flags`` [S] int32: pairs whose token's slot has
    expert LoRA get ``raw[p] = x[t] @ W[e].T`` (gate | up, un-activated) instead and
    their ``act`` row is left for the LoRA pass.  ``config``: base launch config entry.
    ``bias`` [E, 2I] (optional): added to gate | up before the activation (and into ``raw``).
    ``activation``: `GatedActivation` (default silu).  ``lora_plan`` (instead of ``raw``): a
    `moe_lora_plan.MoeLoraPlan` after `moe_lora_shrink`: the LoRA pairs' gate/up deltas are added
    before the activation and their down shrink left in ``lora_plan.down_z`` (`moe_lora_fused`).
    ``ext`` (instead of either): a `moe_lora_stack.Ext`, the stacked LoRA's extra K block.
    """
    num_pairs, inter = topk_ids.numel(), w_gate_up.shape[1] // 2
    _check_stage(x, w_gate_up, act, topk_ids, num_pairs, inter)
    _check_bias(bias, w_gate_up)
    if sum(v is not None for v in (raw, lora_plan, ext)) > 1:
        raise ValueError("raw (the separate LoRA pass), lora_plan (the fused one) and ext (the stacked one) "
                         "exclude each other")
    if raw is not None:
        _check_tensor("raw", raw, (num_pairs, 2 * inter), x.dtype, x.device)
    _check_ext(ext, w_gate_up, topk_ids, x)
    cfg = base_config(w_gate_up.shape[0], x.shape[1], inter, topk_ids, config)
    _launch_gemm(x, w_gate_up, act, align, cfg["gate_up"], n=inter, a_div=topk_ids.shape[-1], gated=True,
                 raw=raw, token_slots=token_slots, slot_flags=slot_flags, bias=bias, activation=activation,
                 fused=lora_plan, ext=ext)


def moe_gate_up_ref(x, w_gate_up, topk_ids, align: Alignment, act, raw=None, token_slots=None,
                    slot_flags=None, config: dict | None = None, *, bias=None,
                    activation: GatedActivation = SILU, lora_plan=None, ext=None) -> None:
    """Torch version of `moe_gate_up` (same arguments; ``align`` and ``config`` unused; the fused
    LoRA's delta added in float32 to the unrounded product, its ``down_z`` not filled)."""
    num_pairs, inter = topk_ids.numel(), w_gate_up.shape[1] // 2
    _check_stage(x, w_gate_up, act, topk_ids, num_pairs, inter)
    _check_bias(bias, w_gate_up)
    _check_ext(ext, w_gate_up, topk_ids, x)
    h = _per_expert(x.float(), w_gate_up, topk_ids, topk_ids.shape[-1])
    if ext is not None:
        h += _per_expert(ext.own(), ext.w, topk_ids, 1)
    if bias is not None:
        h += bias.float()[topk_ids.reshape(-1).long()]
    a = activation.ref(h[:, :inter], h[:, inter:]).to(act.dtype)
    if lora_plan is not None:
        act.copy_(a)  # then the LoRA pairs' rows again, from h + delta
        lora_ops.moe_lora_gate_up_ref(lora_plan, x, h, act)
        return
    if raw is None:
        act.copy_(a)
        return
    lora = lora_pairs(token_slots, slot_flags, topk_ids.shape[-1])
    act[~lora] = a[~lora]
    raw[lora] = h[lora].to(raw.dtype)


def moe_down(act, w_down, topk_ids, topk_weights, align: Alignment, y, config: dict | None = None, *,
             bias=None, lora_plan=None, ext=None) -> None:
    """``y[p] = w[p] · (act[p] @ w_down[e].T + bias[e])`` for every pair ``p`` routed to expert ``e``.

    ``act`` [TK, I]; ``w_down`` [E, H, I]; ``topk_ids`` [T, K] int32; ``topk_weights``
    [T, K] float32; ``align`` as for `moe_gate_up`; ``y`` [TK, H] (written);
    ``bias`` [E, H] (optional, zero if absent).  ``lora_plan``: a plan whose ``down_z`` is filled (by
    `moe_gate_up`'s fused LoRA, with ``"down_shrink": "pass"`` then `moe_lora_down_shrink`; or by
    `moe_lora_gate_up` for ``"fused": "down"``): the LoRA pairs get ``+ down_z[p] @ B_d`` inside the
    routing weight.  ``ext`` (instead): a `moe_lora_stack.Ext`, the stacked LoRA's extra K block.
    """
    num_pairs, hidden = topk_ids.numel(), w_down.shape[1]
    _check_stage(act, w_down, y, topk_ids, num_pairs, hidden)
    _check_bias(bias, w_down)
    if lora_plan is not None and ext is not None:
        raise ValueError("lora_plan (the fused LoRA) and ext (the stacked one) exclude each other")
    _check_ext(ext, w_down, topk_ids, act)
    cfg = base_config(w_down.shape[0], hidden, act.shape[1], topk_ids, config)
    _launch_gemm(act, w_down, y, align, cfg["down"], n=hidden, a_div=1, gated=False,
                 weights=topk_weights, bias=bias, fused=lora_plan, ext=ext)


def moe_down_ref(act, w_down, topk_ids, topk_weights, align: Alignment, y, config: dict | None = None, *,
                 bias=None, lora_plan=None, ext=None) -> None:
    """Torch version of `moe_down` (``align`` and ``config`` unused; the fused LoRA's delta from
    ``act``, added in float32 before rounding)."""
    num_pairs, hidden = topk_ids.numel(), w_down.shape[1]
    _check_stage(act, w_down, y, topk_ids, num_pairs, hidden)
    _check_bias(bias, w_down)
    _check_ext(ext, w_down, topk_ids, act)
    out = _per_expert(act.float(), w_down, topk_ids, 1)
    if ext is not None:
        out += _per_expert(ext.own(), ext.w, topk_ids, 1)
    if bias is not None:
        out += bias.float()[topk_ids.reshape(-1).long()]
    out *= topk_weights.reshape(-1, 1)
    if lora_plan is not None:
        lora_ops.moe_lora_down_ref(lora_plan, act, out, topk_weights)
    y.copy_(out)


def moe_project(a, w, topk_ids, align: Alignment, out, config: dict, *, a_div: int) -> None:
    """``out[p] = a[p // a_div] @ w[e].T`` for every pair ``p`` routed to expert ``e``, rounded to ``out``'s
    dtype (the stacked LoRA's shrinks, `moe_lora_stack`).  ``a`` [rows, K]; ``w`` [E, L, K]; ``out`` [TK, L];
    ``config``: a stage's launch settings (``block_n`` capped at L's power of two, no TMA)."""
    _check_project(a, w, out, topk_ids, a_div)
    cfg = {**config, "block_n": max(16, min(config["block_n"], next_pow2(w.shape[1]))), "tma": False}
    _launch_gemm(a, w, out, align, cfg, n=w.shape[1], a_div=a_div, gated=False)


def moe_project_ref(a, w, topk_ids, align: Alignment, out, config: dict, *, a_div: int) -> None:
    """Torch version of `moe_project`."""
    _check_project(a, w, out, topk_ids, a_div)
    out.copy_(_per_expert(a.float(), w, topk_ids, a_div))


def _check_project(a, w, out, topk_ids, a_div: int) -> None:
    _check_stage(a, w, out, topk_ids, topk_ids.numel(), w.shape[1])
    if a.dim() != 2 or w.dim() != 3 or a.shape[1] != w.shape[2] or a.shape[0] * a_div != topk_ids.numel():
        raise ValueError(f"moe_project needs a [TK / a_div, K] and w [E, L, K]: a {list(a.shape)}, w "
                         f"{list(w.shape)}, a_div {a_div}, {topk_ids.numel()} pairs")


def _check_ext(ext, w: torch.Tensor, topk_ids: torch.Tensor, a: torch.Tensor) -> None:
    """``ext``: None, or operand [TK, L] and weights [E, W_rows, L] in ``a``'s dtype and on its device."""
    if ext is None:
        return
    width = ext.a.shape[-1] if ext.a.dim() == 2 else -1
    _check_tensor("ext.a", ext.a, (topk_ids.numel(), width), a.dtype, a.device)
    _check_tensor("ext.w", ext.w, (w.shape[0], w.shape[1], width), a.dtype, a.device)
    _check_tensor("ext.token_slots", ext.token_slots, (topk_ids.shape[0],), torch.int32, a.device)
    if ext.entry_of_slot.dim() != 1 or ext.entry_of_slot.dtype != torch.int32 or ext.entry_of_slot.device != a.device:
        raise ValueError(f"ext.entry_of_slot must be 1-D int32 on {a.device}")
    if ext.top_k != topk_ids.shape[1]:
        raise ValueError(f"ext.top_k must be the routing's {topk_ids.shape[1]}, got {ext.top_k}")
    if width < 16 or width % 16 or not ext.w.is_contiguous() or ext.rows < 1:
        raise ValueError(f"ext needs a contiguous [E, W_rows, L] block, L a multiple of 16 and rows >= 1, "
                         f"got L={width}, rows={ext.rows}")


def _per_expert(a: torch.Tensor, w: torch.Tensor, topk_ids: torch.Tensor, a_div: int) -> torch.Tensor:
    """``out[p] = a[p // a_div] @ w[e_p].T`` in float32, one matmul per expert present."""
    experts = topk_ids.reshape(-1).long()
    rows = torch.arange(experts.numel(), device=a.device) // a_div
    out = torch.empty(experts.numel(), w.shape[1], dtype=torch.float32, device=a.device)
    for expert in torch.unique(experts).tolist():
        pairs = torch.nonzero(experts == expert).squeeze(1)
        out[pairs] = a[rows[pairs]] @ w[expert].float().T
    return out


# ---------------------------------------------------------------------------------------------
# The whole MoE


_TRITON = SimpleNamespace(fused=True, align=moe_align, gate_up=moe_gate_up, down=moe_down, project=moe_project,
                          plan=lora_ops.plan_moe_lora,
                          lora_gate_up=lora_ops.moe_lora_gate_up, lora_down=lora_ops.moe_lora_down,
                          lora_down_sum=lora_sum.moe_lora_down_sum)
_TORCH = SimpleNamespace(fused=False, align=moe_align_ref, gate_up=moe_gate_up_ref, down=moe_down_ref,
                         project=moe_project_ref, plan=lora_ops.plan_moe_lora_ref,
                         lora_gate_up=lora_ops.moe_lora_gate_up_ref,
                         lora_down=lora_ops.moe_lora_down_ref, lora_down_sum=lora_sum.moe_lora_down_sum_ref)


def _experts(ops, x, w_gate_up, w_down, topk_weights, topk_ids, lora, config, lora_config, gate_up_bias=None,
             down_bias=None, activation: GatedActivation = SILU, stack=None):
    num_tokens, hidden, inter, num_experts, top_k = check_experts_args(x, w_gate_up, w_down, topk_weights,
                                                                       topk_ids)
    cfg = base_config(num_experts, hidden, inter, topk_ids, config)
    if lora is not None and lora.meta.any_lora and (lora.meta.hidden, lora.meta.inter, lora.meta.num_experts) \
            != (hidden, inter, num_experts):
        raise ValueError(f"LoRA metadata is for H={lora.meta.hidden}, I={lora.meta.inter}, "
                         f"{lora.meta.num_experts} experts; the MoE has H={hidden}, I={inter}, {num_experts} experts")
    if stack is not None:
        if lora is None or not lora.meta.any_lora:
            raise ValueError("a LoRA stack needs the layer's MoeLora with expert LoRA (its token slots)")
        return lora_stack.experts(ops, x, w_gate_up, w_down, topk_weights, topk_ids, lora, stack, cfg,
                                  gate_up_bias, down_bias, activation)
    if lora is not None and lora.activation != activation:
        lora = dataclasses.replace(lora, activation=activation)
    plan, shrunk = side.lora_plan(ops, lora, topk_ids, x, lora_config)
    raw = None
    try:
        align = ops.align(topk_ids, num_experts, cfg["block_m"])
        act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
        mode = lora_fused.fused_mode(plan) if ops.fused else ""
        cfg = lora_fused.fused_base(cfg, plan, mode) if mode else cfg
        if plan is None or mode == "all":
            if shrunk:  # the fused GEMM reads z in its epilogue: the side stream's plan and shrink end first
                side.join(x.device)
                shrunk = False
            elif mode:
                lora_ops.moe_lora_shrink(plan, x)
            ops.gate_up(x, w_gate_up, topk_ids, align, act, config=cfg, bias=gate_up_bias, activation=activation,
                        lora_plan=plan if mode else None)
            if mode and not lora_fused.down_shrink_in_epilogue(plan):
                lora_ops.moe_lora_down_shrink(plan, act)
        else:  # the separate gate/up pass (it also leaves down_z for a fused down)
            raw = torch.empty(num_tokens * top_k, 2 * inter, dtype=x.dtype, device=x.device)
            ops.gate_up(x, w_gate_up, topk_ids, align, act, raw, lora.token_slots, lora.meta.slot_flags, cfg,
                        bias=gate_up_bias, activation=activation)
    finally:
        if shrunk:  # the shrink ran beside the base GEMM; joined on an error too, so that its reads of
            side.join(x.device)  # x and the routing end before the caller may free them
    if raw is not None:
        ops.lora_gate_up(plan, x, raw, act, shrunk=shrunk)
    y = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    ops.down(act, w_down, topk_ids, topk_weights, align, y, cfg, bias=down_bias, lora_plan=plan if mode else None)
    if plan is not None and not mode:
        if lora_sum.sums_down(plan):  # the down delta inside the sum over the K choices
            return ops.lora_down_sum(plan, act, y, topk_weights)
        ops.lora_down(plan, act, y, topk_weights)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)


def fused_experts(x, w_gate_up, w_down, topk_weights, topk_ids, lora: lora_ops.MoeLora | None = None,
                  config: dict | None = None, lora_config: dict | None = None, *, gate_up_bias=None,
                  down_bias=None, activation: GatedActivation = SILU, stack=None) -> torch.Tensor:
    """The routed experts: ``out[t] = Σ_j w_j · expert_{e_j}(x[t])`` (module docstring).

    ``x`` [T, H]; ``w_gate_up`` [E, 2I, H]; ``w_down`` [E, H, I] (all the model dtype);
    ``topk_weights`` [T, K] float32; ``topk_ids`` [T, K] int32; ``lora``: the layer's
    `MoeLora` or None; ``config`` / ``lora_config``: launch config entries (default:
    tuned by load); ``gate_up_bias`` [E, 2I] / ``down_bias`` [E, H]: the experts' biases
    (GPT-OSS), the down bias inside the routing weight; ``activation``: `GatedActivation`; ``stack``: a
    `moe_lora_stack.MoeLoraStack` of ``lora``'s layer whose entries hold the tokens' adapters, whose dense
    weights then serve the LoRA (``lora_config`` unused).
    Returns ``out`` [T, H] in the model dtype.
    """
    return _experts(_TRITON, x, w_gate_up, w_down, topk_weights, topk_ids, lora, config, lora_config,
                    gate_up_bias, down_bias, activation, stack)


def fused_experts_ref(x, w_gate_up, w_down, topk_weights, topk_ids, lora: lora_ops.MoeLora | None = None,
                      config: dict | None = None, lora_config: dict | None = None, *, gate_up_bias=None,
                      down_bias=None, activation: GatedActivation = SILU, stack=None) -> torch.Tensor:
    """Torch version of `fused_experts` (the CPU engine path)."""
    return _experts(_TORCH, x, w_gate_up, w_down, topk_weights, topk_ids, lora, config, lora_config,
                    gate_up_bias, down_bias, activation, stack)


def fused_moe(x, router_logits, w_gate_up, w_down, top_k: int, renormalize: bool,
              lora: lora_ops.MoeLora | None = None, config: dict | None = None,
              lora_config: dict | None = None, **expert_options) -> torch.Tensor:
    """Route (`route_topk`) then run the experts (`fused_experts`, which takes ``expert_options``:
    biases, activation).  ``router_logits`` [T, E]."""
    topk_weights, topk_ids = route_topk(router_logits, top_k, renormalize)
    return fused_experts(x, w_gate_up, w_down, topk_weights, topk_ids, lora, config, lora_config,
                         **expert_options)


def fused_moe_ref(x, router_logits, w_gate_up, w_down, top_k: int, renormalize: bool,
                  lora: lora_ops.MoeLora | None = None, config: dict | None = None,
                  lora_config: dict | None = None, **expert_options) -> torch.Tensor:
    """Torch version of `fused_moe`."""
    topk_weights, topk_ids = route_topk_ref(router_logits, top_k, renormalize)
    return fused_experts_ref(x, w_gate_up, w_down, topk_weights, topk_ids, lora, config, lora_config,
                             **expert_options)
