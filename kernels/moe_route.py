"""Top-k routing of a MoE layer: softmax over the router's logits, the ``top_k`` largest per token
(descending), optionally renormalised; GPT-OSS's router adds a bias first and rounds the weights to the
model dtype.  `route_topk` (one launch) and its torch reference `route_topk_ref`; `fused_moe` runs the experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from unipage.kernels.common import cdiv, next_pow2
from unipage.kernels.launch import launch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit(do_not_specialize=["num_tokens"])
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_t,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                  E_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_TO: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    row_ok = rows < num_tokens
    col_ok = cols[None, :] < num_experts
    logits = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :], mask=row_ok[:, None] & col_ok,
                     other=0.0)
    if HAS_BIAS:  # added in float32 and rounded to the logits' dtype, as torch's ``logits + bias``
        bias = tl.load(bias_ptr + cols, mask=cols < num_experts, other=0.0)
        logits = _round_to(logits.to(tl.float32) + bias.to(tl.float32)[None, :], logits.dtype)
    logits = tl.where(col_ok, logits.to(tl.float32), float("-inf"))  # rows past T stay finite: no NaN
    probs = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = probs / tl.sum(probs, axis=1)[:, None]
    scale = tl.full([BLOCK_T], 1.0, tl.float32)
    if RENORMALIZE:  # first pass: the sum of the top-k probabilities
        left, total = probs, tl.zeros([BLOCK_T], tl.float32)
        for _ in tl.static_range(TOP_K):
            total += tl.max(left, axis=1)
            left = tl.where(cols[None, :] == tl.argmax(left, axis=1)[:, None], -1.0, left)
        scale = 1.0 / total
    for j in tl.static_range(TOP_K):
        best = tl.argmax(probs, axis=1)
        weight = _round_to(tl.max(probs, axis=1) * scale, ROUND_TO)
        tl.store(weights_ptr + rows * TOP_K + j, weight, mask=row_ok)
        tl.store(ids_ptr + rows * TOP_K + j, best.to(tl.int32), mask=row_ok)
        probs = tl.where(cols[None, :] == best[:, None], -1.0, probs)


@triton.jit
def _round_to(w, DTYPE: tl.constexpr):
    """Float32 ``w`` rounded to ``DTYPE``'s grid (nearest, ties to even, as torch's ``.to``; NaN and
    infinities kept), kept in float32; None: unchanged.  bfloat16 by integer arithmetic on the bits
    (sign and magnitude, so it holds for negative values too): the interpreter truncates that cast."""
    if DTYPE == tl.bfloat16:
        bits = w.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        w = tl.where(w == w, rounded, w)  # NaN stays NaN (the bit arithmetic could make it finite)
    elif DTYPE is not None:
        w = w.to(DTYPE).to(tl.float32)
    return w


def _check_route_args(router_logits: torch.Tensor, top_k: int, bias: torch.Tensor | None,
                      weight_dtype: torch.dtype | None) -> None:
    if router_logits.dim() != 2 or router_logits.dtype not in _DTYPES or router_logits.stride(1) != 1:
        raise ValueError(f"router_logits must be [T, E] float with unit column stride, got "
                         f"{tuple(router_logits.shape)} {router_logits.dtype}")
    if not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"top_k must be in [1, E={router_logits.shape[1]}], got {top_k}")
    num_experts = router_logits.shape[1]
    if bias is not None and (bias.shape != (num_experts,) or bias.dtype != router_logits.dtype
                             or bias.device != router_logits.device or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [E={num_experts}] {router_logits.dtype} on "
                         f"{router_logits.device}, got {tuple(bias.shape)} {bias.dtype} on {bias.device}")
    if weight_dtype is not None and weight_dtype not in _DTYPES:
        raise ValueError(f"weight_dtype must be one of {_DTYPES}, got {weight_dtype}")


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool, bias: torch.Tensor | None = None,
               weight_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts, the ``top_k`` largest (descending), optionally renormalised to sum 1.

    ``router_logits`` [T, E] float; ``bias`` [E] of its dtype (GPT-OSS's router bias), added to the
    logits first; ``weight_dtype``: round the weights to it (transformers rounds them to the model
    dtype).  Returns ``topk_weights`` [T, K] float32 and ``topk_ids`` [T, K] int32.  One kernel for all
    of it: no separate launches for the bias add and the rounding.
    """
    _check_route_args(router_logits, top_k, bias, weight_dtype)
    num_tokens, num_experts = router_logits.shape
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    block_t = 16
    launch(_route_kernel, (cdiv(num_tokens, block_t),),
        router_logits, bias if bias is not None else router_logits, weights, ids, num_tokens, num_experts,
        router_logits.stride(0), TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_T=block_t,
        E_PAD=next_pow2(num_experts), HAS_BIAS=bias is not None, ROUND_TO=_TL_DTYPES.get(weight_dtype))
    return weights, ids


def route_topk_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool, bias: torch.Tensor | None = None,
                   weight_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of `route_topk` (the Qwen3-MoE / Mixtral router; GPT-OSS's with ``bias``)."""
    _check_route_args(router_logits, top_k, bias, weight_dtype)
    if bias is not None:
        router_logits = router_logits + bias
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weight_dtype is not None:
        weights = weights.to(weight_dtype).float()
    return weights, ids.int()
