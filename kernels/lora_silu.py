"""The dense MLP's gate/up LoRA expand fused with ``silu(gate) · up``.

Shape legend as in `unipage.kernels.lora`; I = MLP width (each of gate and up).

Math — with ``h`` the shrink's result for gate (slice 0) and up (slice 1) of token ``t``'s slot::

    gate = round(gate_up[t, :I] + scale * h_gate @ B_gate)     (rank 0 / slot -1: gate_up[t, :I])
    up   = round(gate_up[t, I:] + scale * h_up @ B_up)
    act[t] = round(round(silu(gate)) * up)                      (as `silu_mul`)

which is ``silu_mul(lora_expand(gate_up, shrunk))`` without writing the LoRA-added ``gate_up`` back and
reading it again, and one launch fewer: at a decode step of 16 tokens with 16 adapters of Llama-3.1-8B,
17.9 against 23.4 us a layer with the shrink (H100, `benchmarks/results/kernels-lora-silu-h100.jsonl`).

Programs ``(row tile, column tile of I)``.  Row tiles are the `LoraBatch`'s: one token (GEMV path) or
``block_m`` tokens of one adapter (grouped path).  The grouped path's tiles cover only tokens with an
adapter, so ``ceil(T / block_m)`` more row tiles follow them, over the tokens in their natural order,
each doing the tokens of its range that have no adapter.  The kernel is a programmatic dependent of
the shrink (Hopper+): everything but the partials is loaded before it waits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from unipage.kernels.common import cdiv, finish_early, gdc_wait, load_runs
from unipage.kernels.elementwise import silu_mul, silu_mul_ref
from unipage.kernels.launch import launch
from unipage.kernels.lora import (
    LoraShrink,
    _check_tensor,
    _fail,
    _product,
    _row_tile,
    _sum_splits,
    lora_expand,
    lora_expand_ref,
)

# (columns of I, warps) per program at rank block 16, by tile height (1: the GEMV path); a larger rank
# block takes proportionally fewer columns.  Taller tiles take the two kernels: measured on the H100
# (`benchmarks/kernels_lora_silu.py`: Llama-3.1-8B gate/up, r16, 16 adapters, shrink included), fused
# against two kernels: 16 tokens (GEMV) 17.9 against 23.4 us, 64 and 256 tokens (tiles of 16) 25.5 / 36.0
# against 26.2 / 37.2 us, but 1,024 and 4,096 tokens (tiles of 64) 140 / 439 against 96 / 331 us.
CONFIGS = {1: (512, 4), 16: (128, 4)}


@triton.jit
def _b_tile(pool_ptr, table, b_off_ptr, rank_ptr, slot, piece, n_lo, inter, RB: tl.constexpr, BN: tl.constexpr,
            LOG2_P: tl.constexpr, PAGED: tl.constexpr):
    """``(rank, B rows [RB, BN])`` of slice ``piece`` (0 gate, 1 up) at columns ``n_lo + [0, BN)``."""
    rank = tl.load(rank_ptr + slot * 2 + piece)
    i = tl.arange(0, RB)
    b_virt = tl.load(b_off_ptr + slot * 2 + piece) + i * ((inter + 63) // 64 * 64)
    return rank, load_runs(pool_ptr, table, b_virt + n_lo, i < rank, inter - n_lo, BN, 64, LOG2_P, PAGED)


@triton.jit
def _plus_delta(v, rank, b, part_rows, piece, m_ok, split_k, split_stride, scale, RB: tl.constexpr,
                SPLITS: tl.constexpr, GROUPED: tl.constexpr, FP32: tl.constexpr):
    """``round(v + scale * h @ b)`` for a slice the slot has (rank > 0), else ``v``."""
    if rank > 0:
        i = tl.arange(0, RB)
        h = _sum_splits(part_rows + piece * RB, i, m_ok, i < rank, split_k, split_stride, SPLITS).to(v.dtype)
        v = (v.to(tl.float32) + scale * _product(h, b, GROUPED, FP32)).to(v.dtype)
    return v


@triton.jit
def _rows(pid, num_tokens, num_tiles, token_slots_ptr, tiles_ptr, order_ptr, BM: tl.constexpr,
          GROUPED: tl.constexpr):
    """``(slot, token ids [BM] int64, row mask [BM])`` of row tile ``pid`` (slot -1: no adapter)."""
    if GROUPED:
        if pid < num_tiles:
            slot, tok, m_ok = _row_tile(pid, token_slots_ptr, tiles_ptr, order_ptr, BM, GROUPED)
            m_ok = m_ok & (tok * 0 + slot >= 0)  # a padding tile writes nothing (its range is empty with
            # the current planner; vector form: the interpreter rejects a bool scalar in a mask)
        else:  # a tile of the tokens without adapter, in token order
            tok = ((pid - num_tiles) * BM + tl.arange(0, BM)).to(tl.int64)
            in_range = tok < num_tokens
            m_ok = in_range & (tl.load(token_slots_ptr + tok, mask=in_range, other=0) < 0)
            slot = pid * 0 - 1
    else:
        slot, tok, m_ok = _row_tile(pid, token_slots_ptr, tiles_ptr, order_ptr, BM, GROUPED)
    return slot, tok, m_ok


@triton.jit(do_not_specialize=["num_tokens", "num_tiles", "split_k"])
def _expand_silu_kernel(
    gu_ptr, gu_stride, out_ptr, pool_ptr, table_ptr, table_stride,
    token_slots_ptr, tiles_ptr, order_ptr, rank_ptr, b_off_ptr, part_ptr,
    num_tokens, num_tiles, inter, split_k, scale,
    RB: tl.constexpr, SPLITS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUPED: tl.constexpr,
    PAGED: tl.constexpr, LOG2_P: tl.constexpr, FP32: tl.constexpr, USE_PDL: tl.constexpr,
):
    slot, tok, m_ok = _rows(tl.program_id(0), num_tokens, num_tiles, token_slots_ptr, tiles_ptr, order_ptr, BM,
                            GROUPED)
    n_lo = tl.program_id(1) * BN
    n = n_lo + tl.arange(0, BN)
    mask = m_ok[:, None] & (n < inter)[None, :]
    rows = gu_ptr + tok[:, None] * gu_stride + n[None, :]
    gate = tl.load(rows, mask=mask, other=0.0)
    up = tl.load(rows + inter, mask=mask, other=0.0)
    if slot >= 0:
        table = table_ptr + slot.to(tl.int64) * table_stride
        rank_g, b_g = _b_tile(pool_ptr, table, b_off_ptr, rank_ptr, slot, 0, n_lo, inter, RB, BN, LOG2_P, PAGED)
        rank_u, b_u = _b_tile(pool_ptr, table, b_off_ptr, rank_ptr, slot, 1, n_lo, inter, RB, BN, LOG2_P, PAGED)
        if USE_PDL:
            gdc_wait()  # the shrink's partials are complete and visible from here on
        part_rows = part_ptr + tok[:, None] * (2 * RB)
        split_stride = num_tokens * (2 * RB)
        gate = _plus_delta(gate, rank_g, b_g, part_rows, 0, m_ok, split_k, split_stride, scale, RB, SPLITS,
                           GROUPED, FP32)
        up = _plus_delta(up, rank_u, b_u, part_rows, 1, m_ok, split_k, split_stride, scale, RB, SPLITS,
                         GROUPED, FP32)
    else:
        finish_early(USE_PDL)  # no partials to read, but the grid must not complete before the shrink's
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # F.silu rounds to dtype before the product
    out = out_ptr + tok[:, None] * inter + n[None, :]
    tl.store(out, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def _check_pair(meta) -> None:
    cols, starts = meta.slice_cols, meta.slice_starts
    if len(cols) != 2 or cols[0] != cols[1] or starts != (0, cols[0]):
        _fail("meta", "of a gate/up pair of equal widths", (meta.targets, cols, starts))


def _check(gate_up: torch.Tensor, shrunk: LoraShrink) -> int:
    """Validate; return I."""
    if not isinstance(shrunk, LoraShrink):
        _fail("shrunk", "what lora_shrink returned", type(shrunk).__name__)
    meta = shrunk.meta
    _check_pair(meta)
    _check_tensor("gate_up", gate_up, (shrunk.num_tokens, meta.out_cols), shrunk.dtype, meta.rank.device)
    return meta.slice_cols[0]


def lora_silu_mul(gate_up: torch.Tensor, shrunk: LoraShrink, *, scale: float = 1.0,
                  config: dict | None = None) -> torch.Tensor:
    """``silu(gate) · up`` of ``gate_up [T, 2I]`` plus its LoRA delta, ``silu_mul(lora_expand(gate_up,
    shrunk, scale=scale))``; returns a new contiguous ``[T, I]``.  ``gate_up`` is consumed: the fused
    kernel leaves it as it was, the two kernels add the delta into it.

    shrunk: `lora_shrink`'s result for the gate/up pair (slices 0 and 1 of equal width I), launched
    right before this call on the same stream, after whatever wrote ``gate_up`` (this kernel is the
    shrink's programmatic dependent and may read ``gate_up`` before the shrink ends).  Its plan must
    cover every adapter token (`plan_lora_batch`'s ``max_groups`` at least the step's adapters): rows of
    tokens it drops are left unwritten.  Tiles taller than `CONFIGS` has and rank blocks above 64 take
    the two kernels.
    config: ``{"block_n": columns of I per program (a multiple of 64), "warps": n, "fused": bool}``
        overrides `CONFIGS` and the choice of kernels (``fused`` True: the fused one, rank <= 64).
    """
    inter = _check(gate_up, shrunk)
    plan, meta, batch, config = shrunk.plan, shrunk.meta, shrunk.batch, config or {}
    if plan is None:
        return silu_mul(gate_up)
    fused = config.get("fused", batch.block_m in CONFIGS) and meta.rank_block <= 64
    if not fused:
        return silu_mul(lora_expand(gate_up, shrunk, scale=scale, dependent=True))
    out = torch.empty(shrunk.num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    consts = plan.expand_options
    rows = batch.num_row_tiles + (cdiv(batch.num_tokens, batch.block_m) if batch.grouped else 0)
    pdl = consts["USE_PDL"]
    block_n, warps = CONFIGS.get(batch.block_m, CONFIGS[16])
    block_n = max(64, block_n * 16 // meta.rank_block)  # the B tiles' registers grow with the rank block
    block_n, warps = config.get("block_n", block_n), config.get("warps", warps)
    if block_n < 64 or block_n % 64:
        _fail("config block_n", "a multiple of 64", block_n)
    launch(_expand_silu_kernel, (rows, cdiv(inter, block_n)),
           gate_up, gate_up.stride(0), out, *shrunk.args, meta.b_offset, shrunk.part,
           shrunk.num_tokens, batch.num_row_tiles, inter, plan.split_k, float(scale),
           RB=meta.rank_block, SPLITS=consts["SPLITS"], BM=batch.block_m, BN=block_n, GROUPED=batch.grouped,
           PAGED=consts["PAGED"], LOG2_P=consts["LOG2_P"], FP32=consts["FP32"], USE_PDL=pdl, num_warps=warps,
           **({"launch_pdl": True} if pdl else {}))
    return out


def lora_silu_mul_ref(gate_up: torch.Tensor, shrunk, *, scale: float = 1.0, config: dict | None = None) -> torch.Tensor:
    """Torch reference of `lora_silu_mul` (same signature; ``shrunk`` from `lora_shrink_ref`)."""
    _check_pair(shrunk.meta)
    return silu_mul_ref(lora_expand_ref(gate_up, shrunk, scale=scale))
