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
the shrink (Hopper+).  A column tile of one step (short tiles) loads everything but the partials
before it waits; a tile of several steps (tall tiles) waits, sums its ``h`` once, then streams B and
gate/up a step of ``CHUNK`` columns at a time.
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

# (columns of I per program, columns per step, warps) at rank block 16, by tile height (1: the GEMV path);
# a larger rank block takes proportionally fewer columns.  Measured on the H100
# (`benchmarks/kernels_lora_silu.py`: Llama-3.1-8B gate/up, r16, 16 adapters, shrink included), fused
# against two kernels (`lora_expand` into gate_up, then `silu_mul`): 16 tokens (GEMV) 17.9 against 23.4 us,
# 256 tokens (tiles of 16) 34.4 against 36.8 us, 512 (tiles of 32) 50.9 against 58.1 us, 1,024 and 4,096
# (tiles of 64) 86.7 / 240 against 95.2 / 327 us.  Tall tiles need the column steps: one 64 x 128 tile
# per program took 140 / 439 us there, and 128-column steps 135 / 412 us (registers).
CONFIGS = {1: (512, 512, 4), 16: (128, 128, 4), 32: (256, 64, 8), 64: (512, 64, 8)}


@triton.jit
def _b_rows(pool_ptr, table, b_off_ptr, slot, piece, rank, n_lo, inter, RB: tl.constexpr, BN: tl.constexpr,
            LOG2_P: tl.constexpr, PAGED: tl.constexpr):
    """B rows ``[RB, BN]`` of slice ``piece`` (0 gate, 1 up) at columns ``n_lo + [0, BN)`` (rows past
    ``rank`` read 0)."""
    i = tl.arange(0, RB)
    b_virt = tl.load(b_off_ptr + slot * 2 + piece) + i * ((inter + 63) // 64 * 64)
    return load_runs(pool_ptr, table, b_virt + n_lo, i < rank, inter - n_lo, BN, 64, LOG2_P, PAGED)


@triton.jit
def _h_rows(part_rows, piece, rank, m_ok, split_k, split_stride, RB: tl.constexpr, SPLITS: tl.constexpr, dtype):
    """``h [BM, RB]`` of slice ``piece``: its Split-K partials summed and rounded to the model dtype."""
    i = tl.arange(0, RB)
    return _sum_splits(part_rows + piece * RB, i, m_ok, i < rank, split_k, split_stride, SPLITS).to(dtype)


@triton.jit
def _plus(v, rank, h, b, scale, GROUPED: tl.constexpr, FP32: tl.constexpr):
    """``round(v + scale * h @ b)`` for a slice the slot has (rank > 0), else ``v`` bit for bit."""
    if rank > 0:
        v = (v.to(tl.float32) + scale * _product(h, b, GROUPED, FP32)).to(v.dtype)
    return v


@triton.jit
def _gate_up(gu_rows, n, m_ok, inter):
    """``(gate, up, mask)``: the ``[BM, len(n)]`` tiles of gate_up's rows at columns ``n`` of I."""
    mask = m_ok[:, None] & (n < inter)[None, :]
    gate = tl.load(gu_rows + n[None, :], mask=mask, other=0.0)
    up = tl.load(gu_rows + inter + n[None, :], mask=mask, other=0.0)
    return gate, up, mask


@triton.jit
def _store_act(out_rows, n, mask, gate, up):
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # F.silu rounds to dtype before the product
    tl.store(out_rows + n[None, :], (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


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
    RB: tl.constexpr, SPLITS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CHUNK: tl.constexpr,
    GROUPED: tl.constexpr, PAGED: tl.constexpr, LOG2_P: tl.constexpr, FP32: tl.constexpr, USE_PDL: tl.constexpr,
):
    slot, tok, m_ok = _rows(tl.program_id(0), num_tokens, num_tiles, token_slots_ptr, tiles_ptr, order_ptr, BM,
                            GROUPED)
    n_lo = tl.program_id(1) * BN
    gu_rows = gu_ptr + tok[:, None] * gu_stride
    out_rows = out_ptr + tok[:, None] * inter
    if slot < 0:
        finish_early(USE_PDL)  # no partials to read, but the grid must not complete before the shrink's
        for n0 in range(n_lo, tl.minimum(n_lo + BN, inter), CHUNK):
            n = tl.multiple_of(n0, 64) + tl.arange(0, CHUNK)
            gate, up, mask = _gate_up(gu_rows, n, m_ok, inter)
            _store_act(out_rows, n, mask, gate, up)
    else:
        table = table_ptr + slot.to(tl.int64) * table_stride
        rank_g = tl.load(rank_ptr + slot * 2)
        rank_u = tl.load(rank_ptr + slot * 2 + 1)
        part_rows = part_ptr + tok[:, None] * (2 * RB)
        split_stride = num_tokens * (2 * RB)
        if CHUNK == BN:  # one chunk: everything but the partials loaded before the wait
            n = n_lo + tl.arange(0, CHUNK)
            gate, up, mask = _gate_up(gu_rows, n, m_ok, inter)
            b_g = _b_rows(pool_ptr, table, b_off_ptr, slot, 0, rank_g, n_lo, inter, RB, CHUNK, LOG2_P, PAGED)
            b_u = _b_rows(pool_ptr, table, b_off_ptr, slot, 1, rank_u, n_lo, inter, RB, CHUNK, LOG2_P, PAGED)
            if USE_PDL:
                gdc_wait()  # the shrink's partials are complete and visible from here on
            h_g = _h_rows(part_rows, 0, rank_g, m_ok, split_k, split_stride, RB, SPLITS, gate.dtype)
            h_u = _h_rows(part_rows, 1, rank_u, m_ok, split_k, split_stride, RB, SPLITS, gate.dtype)
            gate = _plus(gate, rank_g, h_g, b_g, scale, GROUPED, FP32)
            up = _plus(up, rank_u, h_u, b_u, scale, GROUPED, FP32)
            _store_act(out_rows, n, mask, gate, up)
        else:  # chunks of CHUNK columns: h summed once, then B and gate/up streamed chunk by chunk
            # (prefetching the next chunk's gate/up in registers measured slower: 279 against 240 us at 4,096 tokens)
            if USE_PDL:
                gdc_wait()
            dtype = gu_ptr.dtype.element_ty
            h_g = _h_rows(part_rows, 0, rank_g, m_ok, split_k, split_stride, RB, SPLITS, dtype)
            h_u = _h_rows(part_rows, 1, rank_u, m_ok, split_k, split_stride, RB, SPLITS, dtype)
            for n0 in range(n_lo, tl.minimum(n_lo + BN, inter), CHUNK):
                n = tl.multiple_of(n0, 64) + tl.arange(0, CHUNK)
                gate, up, mask = _gate_up(gu_rows, n, m_ok, inter)
                b_g = _b_rows(pool_ptr, table, b_off_ptr, slot, 0, rank_g, n0, inter, RB, CHUNK, LOG2_P, PAGED)
                b_u = _b_rows(pool_ptr, table, b_off_ptr, slot, 1, rank_u, n0, inter, RB, CHUNK, LOG2_P, PAGED)
                _store_act(out_rows, n, mask, _plus(gate, rank_g, h_g, b_g, scale, GROUPED, FP32),
                           _plus(up, rank_u, h_u, b_u, scale, GROUPED, FP32))


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
    tokens it drops are left unwritten.  Rank blocks above 64 take the two kernels.
    config: ``{"block_n": columns of I per program, "chunk": columns per step (a power of two >= 64
        dividing block_n), "warps": n, "fused": bool}`` overrides `CONFIGS` and the choice of kernels
        (``fused`` True: the fused one, rank <= 64).
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
    block_n, chunk, warps = _config(batch.block_m, meta.rank_block, config)
    launch(_expand_silu_kernel, (rows, cdiv(inter, block_n)),
           gate_up, gate_up.stride(0), out, *shrunk.args, meta.b_offset, shrunk.part,
           shrunk.num_tokens, batch.num_row_tiles, inter, plan.split_k, float(scale),
           RB=meta.rank_block, SPLITS=consts["SPLITS"], BM=batch.block_m, BN=block_n, CHUNK=chunk,
           GROUPED=batch.grouped,
           PAGED=consts["PAGED"], LOG2_P=consts["LOG2_P"], FP32=consts["FP32"], USE_PDL=pdl, num_warps=warps,
           **({"launch_pdl": True} if pdl else {}))
    return out


def _config(block_m: int, rank_block: int, config: dict) -> tuple[int, int, int]:
    """``(columns per program, columns per step, warps)``: `CONFIGS` (the nearest tile height at or
    below ``block_m``), the step narrowed for a rank block above 16, then ``config``'s overrides."""
    block_n, chunk, warps = CONFIGS[max(m for m in CONFIGS if m <= block_m)]
    block_n, chunk = (max(64, n * 16 // rank_block) for n in (block_n, chunk))  # B's registers grow with the rank
    block_n, chunk, warps = config.get("block_n", block_n), config.get("chunk", chunk), config.get("warps", warps)
    chunk = min(chunk, block_n)
    if chunk < 64 or chunk & (chunk - 1) or block_n % chunk:
        _fail("config block_n / chunk", "chunk a power of two >= 64 dividing block_n", (block_n, chunk))
    return block_n, chunk, warps


def lora_silu_mul_ref(gate_up: torch.Tensor, shrunk, *, scale: float = 1.0, config: dict | None = None) -> torch.Tensor:
    """Torch reference of `lora_silu_mul` (same signature; ``shrunk`` from `lora_shrink_ref`)."""
    _check_pair(shrunk.meta)
    return silu_mul_ref(lora_expand_ref(gate_up, shrunk, scale=scale))
