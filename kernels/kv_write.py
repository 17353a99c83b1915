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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from unipage.kernels.common import next_pow2
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
