"""Write new keys and values into their KV pages of the unified pool.

Shape legend: N = pages in the pool, P = page_elems, T = new tokens,
KVH = key/value heads, D = head_dim, bt = block_tokens.

KV page layout (one layer's pool ``[N, P]``; the full pool is ``[L, N, P]``
and the caller passes ``pool[layer]``)::

    page p viewed as [2, bt, KVH, D]:   [0] = K of the block's bt tokens
                                        [1] = V of the block's bt tokens
    P = bt * 2 * KVH * D

Token position ``t`` of a sequence lives in page ``block_table[t // bt]`` at
row ``t % bt``.  A *slot* names one row of one page: ``slot = page * bt + row``.

    write_kv:  for every token i with slot_mapping[i] >= 0,
               page, row = divmod(slot_mapping[i], bt)
               pool[page].view(2, bt, KVH, D)[0, row] = k[i]
               pool[page].view(2, bt, KVH, D)[1, row] = v[i]

``bt`` is not an argument: it follows from ``P / (2 * KVH * D)``.

`rope_write_kv` is the decoder's launch: q and k rotated (`elementwise.rope_qk`'s math and
rounding), q' returned, and the rotated k with v written to their slots, one program per token
(no k' tensor between two launches); `rope_write_kv_ref` is `rope_qk_ref` then `write_kv_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from unipage.kernels.common import next_pow2
from unipage.kernels.elementwise import DTYPES, _check_rope_args, _rotate_heads, cos_sin_halves, rope_qk_ref
from unipage.kernels.launch import launch


@triton.jit
def _write_kv_kernel(
    pool_ptr,  # [N, P] contiguous
    k_ptr, v_ptr,  # [T, KVH, D], last stride 1
    slot_ptr,  # [T] int64
    stride_kt, stride_kh, stride_vt, stride_vh,
    BT: tl.constexpr, KVH: tl.constexpr, KVH_P: tl.constexpr, D: tl.constexpr,
):
    token = tl.program_id(0)
    offs_h = tl.arange(0, KVH_P)
    offs_d = tl.arange(0, D)
    # one slot per head lane: the interpreter mishandles `vector & scalar` masks
    slot = tl.load(slot_ptr + token + offs_h * 0).to(tl.int64)  # [KVH_P], all equal
    mask = ((offs_h < KVH) & (slot >= 0))[:, None]
    row_off = (slot // BT) * (2 * BT * KVH * D) + (slot % BT) * (KVH * D) + offs_h * D
    dst = pool_ptr + row_off[:, None] + offs_d[None, :]
    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(dst, k, mask=mask)
    tl.store(dst + BT * KVH * D, v, mask=mask)


def kv_block_tokens(pool: torch.Tensor, num_kv_heads: int, head_dim: int) -> int:
    """``block_tokens`` implied by a page of ``pool [N, P]``: ``P / (2 * KVH * D)``."""
    row = 2 * num_kv_heads * head_dim
    if pool.dim() != 2:
        raise ValueError(f"pool must be one layer [N, P], got shape {tuple(pool.shape)}")
    if pool.shape[1] % row != 0:
        raise ValueError(f"page_elems {pool.shape[1]} is not a multiple of 2 * num_kv_heads * head_dim = {row}")
    block_tokens = pool.shape[1] // row
    if block_tokens & (block_tokens - 1) != 0:
        raise ValueError(f"block_tokens {block_tokens} must be a power of two")
    return block_tokens


def _check_write_args(pool, k, v, slot_mapping) -> int:
    if k.dim() != 3:
        raise ValueError(f"k must be [T, KVH, D], got shape {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    if not (pool.dtype == k.dtype == v.dtype):
        raise ValueError(f"dtypes differ: pool {pool.dtype}, k {k.dtype}, v {v.dtype}")
    if not (slot_mapping.shape == (k.shape[0],) and slot_mapping.dtype == torch.int64):
        raise ValueError(f"slot_mapping must be [T={k.shape[0]}] int64, "
                         f"got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    devices = {t.device for t in (pool, k, v, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"tensors on different devices: {devices}")
    return kv_block_tokens(pool, k.shape[1], k.shape[2])


def write_kv(pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V rows into their pages, in place (see the module docstring).

    pool: [N, P] one layer, contiguous, same dtype as k/v.
    k, v: [T, KVH, D], last dim contiguous (views of a fused qkv are fine).
    slot_mapping: [T] int64, ``page * block_tokens + row``; -1 skips the token.
    Slots must be < N * block_tokens (not checked: it would need a device sync).
    """
    block_tokens = _check_write_args(pool, k, v, slot_mapping)
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous")
    if not (k.stride(2) == 1 and v.stride(2) == 1):
        raise ValueError("k and v need a contiguous last dim")
    tokens, kv_heads, head_dim = k.shape
    if not (head_dim >= 16 and head_dim & (head_dim - 1) == 0):
        raise ValueError(f"head_dim {head_dim} must be a power of two >= 16")
    if tokens == 0:
        return
    launch(_write_kv_kernel, (tokens,),
        pool, k, v, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        BT=block_tokens, KVH=kv_heads, KVH_P=next_pow2(kv_heads), D=head_dim)


def write_kv_ref(pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Torch reference of `write_kv` (same signature, same effect)."""
    block_tokens = _check_write_args(pool, k, v, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    pages = pool.view(pool.shape[0], 2, block_tokens, k.shape[1], k.shape[2])
    pages[slots // block_tokens, 0, slots % block_tokens] = k[keep]
    pages[slots // block_tokens, 1, slots % block_tokens] = v[keep]


@triton.jit
def _rope_write_kv_kernel(
    q_ptr, k_ptr, v_ptr,  # [T, HQ, D], [T, KVH, D], [T, KVH, D]: last stride 1
    cos_ptr, sin_ptr,  # [T, D], last dim contiguous
    q_out_ptr,  # [T, HQ, D] contiguous
    pool_ptr,  # [N, P] contiguous
    slot_ptr,  # [T] int64
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    HQ: tl.constexpr, HQ_P: tl.constexpr, KVH: tl.constexpr, KVH_P: tl.constexpr, HALF: tl.constexpr,
    HALF_P: tl.constexpr, BT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    c1, c2, s1, s2 = cos_sin_halves(cos_ptr, sin_ptr, t, stride_ct, stride_st, HALF, HALF_P)
    _rotate_heads(q_ptr, q_out_ptr, t, stride_qt, stride_qh, HQ, c1, c2, s1, s2, HQ_P, HALF, HALF_P)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:  # the page row holds [KVH, D] contiguous: the rotated k goes there as into a q_out row
        row = pool_ptr + (slot // BT) * (2 * BT * KVH * 2 * HALF) + (slot % BT) * (KVH * 2 * HALF)
        _rotate_heads(k_ptr + t * stride_kt, row, t * 0, stride_kt, stride_kh, KVH, c1, c2, s1, s2, KVH_P, HALF,
                      HALF_P)
        offs_h = tl.arange(0, KVH_P)[:, None]
        offs_d = tl.arange(0, 2 * HALF_P)[None, :]
        mask = (offs_h < KVH) & (offs_d < 2 * HALF)
        v = tl.load(v_ptr + t * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
        tl.store(row + BT * KVH * 2 * HALF + offs_h * (2 * HALF) + offs_d, v, mask=mask)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  pool: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """q and k rotated by the step's cos/sin, the rotated k and v written into their slots of ``pool``;
    returns q' (new, contiguous ``[T, HQ, D]``).  Arguments as for `elementwise.rope_qk` (q, k, cos, sin)
    and `write_kv` (pool, v, slot_mapping; a slot of -1 writes nothing for its token)."""
    _check_rope_args(q, k, cos, sin)
    block_tokens = _check_write_args(pool, k, v, slot_mapping)
    if q.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {q.dtype}")
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous")
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim, got strides {t.stride()}")
    tokens, heads_q, head_dim = q.shape
    kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_out
    half = head_dim // 2
    launch(_rope_write_kv_kernel, (tokens,),
        q, k, v, cos, sin, q_out, pool, slot_mapping, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), cos.stride(0), sin.stride(0), HQ=heads_q, HQ_P=next_pow2(heads_q), KVH=kv_heads,
        KVH_P=next_pow2(kv_heads), HALF=half, HALF_P=next_pow2(half), BT=block_tokens,
        num_warps=4 if heads_q * head_dim <= 4096 else 8)
    return q_out


def rope_write_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      pool: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Torch reference of `rope_write_kv`: `rope_qk_ref`, then `write_kv_ref` of the rotated k."""
    q_out, k_out = rope_qk_ref(q, k, cos, sin)
    write_kv_ref(pool, k_out, v, slot_mapping)
    return q_out
