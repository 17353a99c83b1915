"""The decoder's elementwise steps as single launches: RMSNorm (with the residual add), rope, silu·up.

Shape legend: T = tokens of the step, N = normalised width (hidden size, the
q/k projection, or head_dim), HQ / HK = query / key heads, D = head_dim,
I = MLP width.  ``dtype`` is the activations' (fp16, bf16 or fp32); every
kernel computes in float32 and rounds to dtype where the torch reference rounds.
The residual sum is bit-identical to torch's add; the norms differ by the order
of a row's sum; rope on an H100 differs from torch's bf16 expression by one
bf16 ulp in some elements (the same rounding steps, compiled differently).

    rms_norm:      y = w · dtype(x / sqrt(mean(x²) + eps))        (transformers' RMSNorm)
    add_rms_norm:  s = dtype(h + delta);  y = rms_norm(s)         returns (s, y)
    rope_qk:       x' = dtype(dtype(x · cos) + dtype(rotate_half(x) · sin)),
                   rotate_half(x) = cat(-x[D/2:], x[:D/2]), for q and k in one launch
    silu_mul:      y = dtype(dtype(silu(g)) · u),  [g | u] = gate_up,  silu(g) = g / (1 + e^-g)

The token count is never a specialised argument (the grid carries it, or it is
``do_not_specialize``), so one compile serves every step length; there are no
host syncs, so the launches can be captured in a CUDA graph.  The references
(``*_ref``) are the model's CPU path and the kernels' test oracles.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from unipage.kernels.common import cdiv, next_pow2
from unipage.kernels.launch import launch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# -- RMSNorm ---------------------------------------------------------------
@triton.jit(do_not_specialize=["rows"])
def _rms_norm_kernel(
    x_ptr,  # [T, heads, N] (or [T, N]: heads = 1), last dim contiguous
    d_ptr,  # like x (ADD only)
    w_ptr,  # [N] contiguous
    out_ptr,  # [T * heads, N] contiguous
    sum_ptr,  # [T * heads, N] contiguous (ADD only)
    rows, heads, n,  # rows = T * heads
    stride_xt, stride_xh, stride_dt, stride_dh,
    eps,
    ADD: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (r < rows)[:, None] & (cols < n)[None, :]
    t, head = r // heads, r % heads
    x = tl.load(x_ptr + (t * stride_xt + head * stride_xh)[:, None] + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    dst = r[:, None] * n + cols[None, :]
    if ADD:
        d = tl.load(d_ptr + (t * stride_dt + head * stride_dh)[:, None] + cols[None, :], mask=mask, other=0.0)
        s = (x + d.to(tl.float32)).to(sum_ptr.dtype.element_ty)  # the residual stream keeps dtype
        tl.store(sum_ptr + dst, s, mask=mask)
        x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n + eps)
    y = (x * rstd[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + dst, (y * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def _rows_view(x: torch.Tensor, name: str) -> tuple[int, int, int, int]:
    """``(T, heads, stride_t, stride_h)`` of a ``[T, N]`` or ``[T, heads, N]`` input."""
    if x.dim() not in (2, 3):
        raise ValueError(f"{name} must be [T, N] or [T, heads, N], got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"{name} dtype must be one of {DTYPES}, got {x.dtype}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dim, got strides {x.stride()}")
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0], x.shape[1], x.stride(0), x.stride(1)


def _launch_norm(x, delta, weight, eps, add: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    tokens, heads, stride_xt, stride_xh = _rows_view(x, "x")
    n = x.shape[-1]
    if not (weight.shape == (n,) and weight.dtype == x.dtype and weight.is_contiguous()):
        raise ValueError(f"weight must be [{n}] {x.dtype} contiguous, got {tuple(weight.shape)} {weight.dtype}")
    stride_dt = stride_dh = 0
    if add:
        if not (delta.shape == x.shape and delta.dtype == x.dtype):
            raise ValueError(f"delta must match x: {tuple(x.shape)} {x.dtype}, got {tuple(delta.shape)} {delta.dtype}")
        _, _, stride_dt, stride_dh = _rows_view(delta, "delta")
    devices = {t.device for t in (x, weight, delta) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"tensors on different devices: {devices}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if add else None
    rows = tokens * heads
    if rows == 0:
        return total, out
    block = next_pow2(n)
    per_program = max(1, min(32, 2048 // block))  # short rows (q/k heads) share a program
    launch(_rms_norm_kernel, (cdiv(rows, per_program),),
        x, delta if add else x, weight, out, total if add else out, rows, heads, n,
        stride_xt, stride_xh, stride_dt, stride_dh, eps,
        ADD=add, ROWS=per_program, BLOCK=block, num_warps=8 if per_program * block >= 4096 else 4)
    return total, out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (see the module docstring); returns a new contiguous tensor.

    x: [T, N] or [T, heads, N] (a q/k head view), fp16/bf16/fp32, last dim contiguous;
       rows may be strided (views of a fused qkv are fine).
    weight: [N], x's dtype, contiguous.
    eps: added to the mean square.
    Returns ``[T, N]`` / ``[T, heads, N]`` contiguous, x's dtype.
    """
    return _launch_norm(x, None, weight, eps, add=False)[1]


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm in one launch: ``(h + delta, rms_norm(h + delta))``.

    h, delta: [T, N], same dtype (fp16/bf16/fp32), last dim contiguous.
    weight: [N], h's dtype, contiguous.
    Returns two new contiguous ``[T, N]`` tensors of h's dtype; h is not written.
    """
    return _launch_norm(h, delta, weight, eps, add=True)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch reference of `rms_norm`: transformers' RMSNorm, normalised in float32, scaled in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `add_rms_norm`."""
    total = h + delta
    return total, rms_norm_ref(total, weight, eps)


# -- rope ------------------------------------------------------------------
@triton.jit
def _rotate_heads(src_ptr, dst_ptr, t, stride_t, stride_h, heads, c1, c2, s1, s2,
                  HP: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr):
    """Rotate the ``heads`` rows of token ``t`` (cos/sin halves c1, c2, s1, s2: [1, HALF_P] float32)."""
    offs_h = tl.arange(0, HP)[:, None]
    offs_d = tl.arange(0, HALF_P)[None, :]
    mask = (offs_h < heads) & (offs_d < HALF)
    src = src_ptr + t * stride_t + offs_h * stride_h + offs_d
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    # each product rounds to dtype before the sum, as the torch expression does
    y1 = (x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)
    y2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    dst = dst_ptr + t * heads * (2 * HALF) + offs_h * (2 * HALF) + offs_d
    tl.store(dst, y1.to(dtype), mask=mask)
    tl.store(dst + HALF, y2.to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,  # [T, HQ, D], last dim contiguous
    k_ptr,  # [T, HK, D], last dim contiguous
    cos_ptr, sin_ptr,  # [T, D], last dim contiguous
    q_out_ptr,  # [T, HQ, D] contiguous
    k_out_ptr,  # [T, HK, D] contiguous
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
    HQ: tl.constexpr, HK: tl.constexpr, HQ_P: tl.constexpr, HK_P: tl.constexpr,
    HALF: tl.constexpr, HALF_P: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    c1, c2, s1, s2 = cos_sin_halves(cos_ptr, sin_ptr, t, stride_ct, stride_st, HALF, HALF_P)
    _rotate_heads(q_ptr, q_out_ptr, t, stride_qt, stride_qh, HQ, c1, c2, s1, s2, HQ_P, HALF, HALF_P)
    _rotate_heads(k_ptr, k_out_ptr, t, stride_kt, stride_kh, HK, c1, c2, s1, s2, HK_P, HALF, HALF_P)


@triton.jit
def cos_sin_halves(cos_ptr, sin_ptr, t, stride_ct, stride_st, HALF: tl.constexpr, HALF_P: tl.constexpr):
    """Token ``t``'s cos and sin halves ``(c1, c2, s1, s2)``, ``[1, HALF_P]`` float32 each (also
    `kv_write.rope_write_kv`'s)."""
    offs = tl.arange(0, HALF_P)[None, :]
    m = offs < HALF
    c1 = tl.load(cos_ptr + t * stride_ct + offs, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + offs, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + offs, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + HALF + offs, mask=m, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


def _check_rope_args(q, k, cos, sin) -> None:
    if not (q.dim() == 3 and k.dim() == 3):
        raise ValueError(f"q, k must be [T, heads, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    tokens, _, head_dim = q.shape
    if not (k.shape[0] == tokens and k.shape[2] == head_dim):
        raise ValueError(f"k {tuple(k.shape)} must have q's tokens and head_dim ({tokens}, {head_dim})")
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim {head_dim} must be even")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (tokens, head_dim):
            raise ValueError(f"{name} must be [T={tokens}, D={head_dim}], got {tuple(t.shape)}")
    if not (q.dtype == k.dtype == cos.dtype == sin.dtype):
        raise ValueError(f"q, k, cos, sin must share one dtype: {q.dtype}, {k.dtype}, {cos.dtype}, {sin.dtype}")
    devices = {t.device for t in (q, k, cos, sin)}
    if len(devices) != 1:
        raise ValueError(f"tensors on different devices: {devices}")


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by the step's cos/sin in one launch; returns new contiguous ``(q', k')``.

    q: [T, HQ, D], k: [T, HK, D]: last dim contiguous, rows may be strided (views of a fused qkv).
    cos, sin: [T, D], q's dtype, last dim contiguous (`rope.cos_sin`).
    D even; q, k, cos, sin share one dtype (fp16/bf16/fp32).
    """
    _check_rope_args(q, k, cos, sin)
    if q.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {q.dtype}")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim, got strides {t.stride()}")
    tokens, heads_q, head_dim = q.shape
    heads_k = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    launch(_rope_kernel, (tokens,),
        q, k, cos, sin, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), sin.stride(0), HQ=heads_q, HK=heads_k, HQ_P=next_pow2(heads_q),
        HK_P=next_pow2(heads_k), HALF=half, HALF_P=next_pow2(half),
        num_warps=4 if heads_q * head_dim <= 4096 else 8)
    return q_out, k_out


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, D]`` by ``cos/sin [T, D]``: ``x · cos + rotate_half(x) · sin``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_qk_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `rope_qk`."""
    _check_rope_args(q, k, cos, sin)
    return rotate_ref(q, cos, sin), rotate_ref(k, cos, sin)


# -- silu(gate) · up -------------------------------------------------------
@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [T, 2I], last dim contiguous
    out_ptr,  # [T, I] contiguous
    inter, stride_gt,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gate_up_ptr + t * stride_gt + cols, mask=mask, other=0.0)
    u = tl.load(gate_up_ptr + t * stride_gt + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = g.dtype
    g = g.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # F.silu rounds to dtype before the product
    tl.store(out_ptr + t * inter + cols, (act * u).to(dtype), mask=mask)


def _check_silu_args(gate_up: torch.Tensor) -> None:
    if not (gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0):
        raise ValueError(f"gate_up must be [T, 2I], got shape {tuple(gate_up.shape)}")


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` of a dense MLP's fused projection; returns a new contiguous ``[T, I]``.

    gate_up: [T, 2I] = [gate | up], fp16/bf16/fp32, last dim contiguous (rows may be strided).
    """
    _check_silu_args(gate_up)
    if gate_up.dtype not in DTYPES:
        raise ValueError(f"gate_up dtype must be one of {DTYPES}, got {gate_up.dtype}")
    if gate_up.stride(1) != 1:
        raise ValueError(f"gate_up needs a contiguous last dim, got strides {gate_up.stride()}")
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if tokens == 0 or inter == 0:
        return out
    block = min(1024, next_pow2(inter))
    launch(_silu_mul_kernel, (tokens, cdiv(inter, block)), gate_up, out, inter, gate_up.stride(0), BLOCK=block,
           num_warps=4)
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch reference of `silu_mul` (transformers' ``act_fn(gate_proj(x)) * up_proj(x)``)."""
    _check_silu_args(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
