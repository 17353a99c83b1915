"""A MoE layer's residual add, its RMSNorm, the router's GEMV and the routing in one launch.

After its attention a MoE layer runs `elementwise.add_rms_norm` (``h + o`` and ``x = rmsnorm(h + o)``),
the router's GEMM ``x @ W_r.T`` and `fused_moe.route_topk`: three launches, at decode for a few tokens
and a small weight (GPT-OSS-20B's router is 32 x 2880, 184 KB).  `add_rms_norm_route` does all of it in
one program per token when the step is small (`fits`): the add and the norm as `add_rms_norm` (same
math and roundings), x written, then read back in chunks against the router's rows, the logits rounded
once to the model dtype (as the GEMM's output is; an fp32 sum in another order than cuBLAS's), then
`fused_moe.route_rows` (bias, softmax, top-k, renormalisation and weight rounding as `route_topk`).

Every program reads the whole router weight (from L2 after the first), so the kernel is taken only
while ``tokens x`` the router's bytes is at most `MAX_ROUTER_READS`; otherwise, and for a router that
is not contiguous, the three launches run (the router's GEMM as `skinny.linear`).

`add_rms_norm_route_ref` is `add_rms_norm_ref`, ``F.linear`` and `route_topk_ref`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from unipage.kernels import skinny
from unipage.kernels.common import next_pow2
from unipage.kernels.elementwise import _rows_view, add_rms_norm, add_rms_norm_ref
from unipage.kernels.fused_moe import _TL_DTYPES, _check_route_args, route_rows, route_topk, route_topk_ref
from unipage.kernels.launch import launch

__all__ = ["MAX_ROUTER_READS", "add_rms_norm_route", "add_rms_norm_route_ref", "fits"]

MAX_ROUTER_READS = 4 << 20  # bytes of router weight all programs read together (GPT-OSS-20B, 16 tokens: 2.9 MB)
ROUTER_ELEMS = 8192  # router elements per step of the GEMV (columns: this over the experts, at most 256)


@triton.jit(do_not_specialize=["tokens"])
def _add_norm_route_kernel(
    h_ptr, d_ptr,  # [T, N], last dim contiguous
    w_ptr,  # [N] the norm's weight
    sum_ptr, out_ptr,  # [T, N] contiguous: h + delta, and its norm x
    router_ptr,  # [E, N] contiguous
    bias_ptr, weights_ptr, ids_ptr,  # [E] or unused; [T, K] float32; [T, K] int32
    tokens, n, num_experts, stride_ht, stride_dt, eps,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_TO: tl.constexpr,
    BLOCK: tl.constexpr, BK: tl.constexpr, E_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dtype = sum_ptr.dtype.element_ty
    x = tl.load(h_ptr + t * stride_ht + cols, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + t * stride_dt + cols, mask=mask, other=0.0).to(tl.float32)
    s = (x + d).to(dtype)  # the residual stream keeps dtype
    tl.store(sum_ptr + t * n + cols, s, mask=mask)
    x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    y = (x * rstd).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * n + cols, (y * w).to(dtype), mask=mask)
    tl.debug_barrier()  # x is read back below in chunks, by other threads than wrote them
    experts = tl.arange(0, E_PAD)
    e_ok = experts < num_experts
    acc = tl.zeros([E_PAD], tl.float32)
    for k0 in range(0, n, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < n
        xk = tl.load(out_ptr + t * n + ks, mask=k_ok, other=0.0).to(tl.float32)
        wk = tl.load(router_ptr + experts[:, None] * n + ks[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(wk.to(tl.float32) * xk[None, :], axis=1)
    rows = t + tl.arange(0, 1)
    route_rows(acc.to(dtype)[None, :], bias_ptr, weights_ptr, ids_ptr, rows, rows < tokens, experts, num_experts,
               TOP_K, RENORMALIZE, 1, HAS_BIAS, ROUND_TO)


def fits(tokens: int, router: torch.Tensor) -> bool:
    """Whether `add_rms_norm_route` takes its one kernel for ``tokens`` tokens (`MAX_ROUTER_READS`)."""
    return router.is_contiguous() and 0 < tokens * router.numel() * router.element_size() <= MAX_ROUTER_READS


def add_rms_norm_route(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, router: torch.Tensor,
                       top_k: int, renormalize: bool, bias: torch.Tensor | None = None,
                       weight_dtype: torch.dtype | None = None):
    """``(h + delta, x, topk_weights, topk_ids)``: `add_rms_norm`'s two outputs, then `route_topk` of the
    router logits ``x @ router.T`` (module docstring).  h, delta, weight: as `add_rms_norm` (2-D);
    router ``[E, N]`` of h's dtype; top_k, renormalize, bias, weight_dtype: as `route_topk`."""
    tokens, _, stride_ht, _ = _rows_view(h, "h")
    if h.dim() != 2 or delta.shape != h.shape or delta.dtype != h.dtype or delta.stride(-1) != 1:
        raise ValueError(f"h and delta must be [T, N] of one dtype, rows contiguous: {tuple(h.shape)} "
                         f"{h.dtype} and {tuple(delta.shape)} {delta.dtype}")
    if router.dim() != 2 or router.shape[1] != h.shape[1] or router.dtype != h.dtype or router.device != h.device:
        raise ValueError(f"router must be [E, {h.shape[1]}] {h.dtype} on {h.device}, got {tuple(router.shape)} "
                         f"{router.dtype} on {router.device}")
    if not fits(tokens, router) or weight.shape != (h.shape[1],) or not weight.is_contiguous():
        total, x = add_rms_norm(h, delta, weight, eps)
        return total, x, *route_topk(skinny.linear(x, router), top_k, renormalize, bias, weight_dtype)
    num_experts, n = router.shape
    _check_route_args(h[:0, :num_experts], top_k, bias, weight_dtype)  # (an empty [0, E] of the logits' dtype)
    total, x = (torch.empty(h.shape, dtype=h.dtype, device=h.device) for _ in range(2))
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=h.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=h.device)
    launch(_add_norm_route_kernel, (tokens,), h, delta, weight, total, x, router,
           bias if bias is not None else router, weights, ids, tokens, n, num_experts, stride_ht, delta.stride(0),
           eps, TOP_K=top_k, RENORMALIZE=renormalize, HAS_BIAS=bias is not None,
           ROUND_TO=_TL_DTYPES.get(weight_dtype), BLOCK=next_pow2(n), E_PAD=next_pow2(num_experts),
           BK=max(16, min(256, ROUTER_ELEMS // next_pow2(num_experts))), num_warps=8 if next_pow2(n) >= 4096 else 4)
    return total, x, weights, ids


def add_rms_norm_route_ref(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                           router: torch.Tensor, top_k: int, renormalize: bool, bias: torch.Tensor | None = None,
                           weight_dtype: torch.dtype | None = None):
    """Torch reference of `add_rms_norm_route`."""
    total, x = add_rms_norm_ref(h, delta, weight, eps)
    return total, x, *route_topk_ref(F.linear(x, router), top_k, renormalize, bias, weight_dtype)
