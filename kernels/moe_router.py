"""The MoE router of a small batch in one kernel: the router GEMM ``x @ W_r.T`` and `route_topk`
(bias, softmax, top-k, renormalisation, rounding) together.

At decode the router is three launches for a few microseconds of work: cuBLAS's GEMM of
``[T, H] @ [H, E]`` (split over K, so with its reduction kernel) and then the routing
kernel, each with its gap in the CUDA graph.  `route_linear` runs it as one: a program
per ``BLOCK_T`` tokens walks H, ``BLOCK_K`` columns a step, accumulating the logits
``[BLOCK_T, E]`` on the tensor cores, rounds them to the model dtype (as the GEMM's
output is rounded) and routes them in registers (`fused_moe.topk_softmax`, the routing
kernel's own code).  Past `FUSED_TOKENS` tokens (prefill) each program would read the
whole router for few rows: there the GEMM and `route_topk` run as before.

Shapes: ``x`` [T, H] and ``weight`` [E, H] of one float dtype, rows contiguous;
``bias`` [E] of that dtype or None.  Returns ``topk_weights`` [T, K] float32 and
``topk_ids`` [T, K] int32, as `route_topk` does.  The logits are summed in another
order than cuBLAS's, so they can differ from it in the last bit of the model dtype
(and an expert choice between two logits that close can differ with them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from unipage.kernels.common import cdiv, next_pow2
from unipage.kernels.fused_moe import (
    _DTYPES,
    _TL_DTYPES,
    _round_to,
    check_route_options,
    route_topk,
    route_topk_ref,
    topk_softmax,
)
from unipage.kernels.launch import launch

FUSED_TOKENS = 64  # the most tokens the fused kernel routes; more go through the GEMM and `route_topk`
CONFIG = {"block_t": 16, "block_k": 256, "num_warps": 4, "num_stages": 3}  # launch settings of the fused kernel


@triton.jit(do_not_specialize=["num_tokens"])
def _router_kernel(x_ptr, w_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, hidden, stride_x,
                   stride_w, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                   E_PAD: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, LOGIT_DTYPE: tl.constexpr,
                   ROUND_TO: tl.constexpr, DOT_PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = rows < num_tokens
    col_ok = cols < num_experts
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + offs_k[None, :]
    w_ptrs = w_ptr + cols[None, :] * stride_w + offs_k[:, None]  # W.T's [BLOCK_K, E_PAD] tile
    acc = tl.zeros((BLOCK_T, E_PAD), tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = offs_k < hidden - k0
        x = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    logits = _round_to(acc, LOGIT_DTYPE).to(LOGIT_DTYPE)  # the GEMM's output dtype (exact: on its grid)
    topk_softmax(logits, rows, row_ok, cols, num_experts, bias_ptr, weights_ptr, ids_ptr, TOP_K, RENORMALIZE,
                 BLOCK_T, HAS_BIAS, ROUND_TO)


def _check_router_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in _DTYPES or x.stride(1) != 1:
        raise ValueError(f"x must be [T, H] float with unit column stride, got {tuple(x.shape)} {x.dtype}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.dtype != x.dtype \
            or weight.device != x.device or weight.stride(1) != 1:
        raise ValueError(f"weight must be [E, H={x.shape[1]}] {x.dtype} on {x.device} with unit column stride, "
                         f"got {tuple(weight.shape)} {weight.dtype} on {weight.device}")


def route_linear(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                 bias: torch.Tensor | None = None, weight_dtype: torch.dtype | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``route_topk(x @ weight.T, top_k, renormalize, bias, weight_dtype)``, in one launch for up to
    `FUSED_TOKENS` tokens (module docstring)."""
    _check_router_args(x, weight)
    num_tokens, num_experts = x.shape[0], weight.shape[0]
    if num_tokens > FUSED_TOKENS:
        return route_topk(x @ weight.T, top_k, renormalize, bias, weight_dtype)
    check_route_options(num_experts, x.dtype, x.device, top_k, bias, weight_dtype)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=x.device)
    cfg = CONFIG
    launch(_router_kernel, (cdiv(num_tokens, cfg["block_t"]),),
        x, weight, bias if bias is not None else weight, weights, ids, num_tokens, num_experts, x.shape[1],
        x.stride(0), weight.stride(0), TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_T=cfg["block_t"],
        E_PAD=max(16, next_pow2(num_experts)), BLOCK_K=cfg["block_k"], HAS_BIAS=bias is not None,
        LOGIT_DTYPE=_TL_DTYPES[x.dtype], ROUND_TO=_TL_DTYPES.get(weight_dtype),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return weights, ids


def route_linear_ref(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                     bias: torch.Tensor | None = None, weight_dtype: torch.dtype | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of `route_linear`: the GEMM, then `route_topk_ref`."""
    _check_router_args(x, weight)
    return route_topk_ref(x @ weight.T, top_k, renormalize, bias, weight_dtype)
