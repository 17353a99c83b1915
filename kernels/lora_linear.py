"""A decode-size projection with its LoRA delta in one kernel: ``y = x @ W.T (+ bias) + LoRA``.

Shape legend as in `lora`: T tokens (at most ``BM``), D = d_in, C output columns (the slices of
``meta``, in order, covering ``W``'s rows), J slices, RB the rank block.

At decode sizes a projection is a read of ``W`` (T is 16 at setup (a)), and the separate path launches
two kernels after it, with a gap before each: the shrink and the expand (a read-modify-write of
``y``).  Here the shrink runs first (`lora.lora_shrink`, which writes the
Split-K partials of ``h = x @ A.T``) and one kernel then does the rest: each program takes all T
tokens and a column tile of ``BN`` columns inside one slice, streams its rows of ``W`` over
``D``, and in its epilogue adds the bias and, per token, ``round(h) @ B[slot]`` for its columns,
the B rows read from the slot's pool pages.  Rounding is the separate path's: the product plus the bias
is rounded to the model dtype (`F.linear`), then the delta added in fp32 and rounded.

On Hopper+ the kernel is a programmatic dependent of the shrink: it streams ``W`` while the
shrink runs and waits (``gdc_wait``) only before it reads the partials, so the shrink costs
little beyond its own launch.  ``x`` was complete before the shrink started (a plain shrink
starts after the kernel that wrote it; an early one starts its dependents only after waiting
for that kernel), and nothing else writes what the kernel reads before the wait.

`linear_lora` takes the kernel for batches of at most ``LINEAR["max_tokens"]`` tokens; otherwise it runs
the matmul with its bias (`skinny.linear`: ``F.linear`` unless the weight has a tuned skinny entry) and
`lora.lora_shrink_expand`.

Status (H200, bf16, 16 tokens over 8 adapters of rank 32, GPT-OSS-20B's attention; rows in
benchmarks/results/kernels-lora-linear-h200.jsonl and lora-breakdown-h200.jsonl): it agrees with the
separate path within bf16 rounding (its sums run in another order: the GPU tests at model shapes and
the engine's parity test against transformers + PEFT passed with it on, at 29e3a9c), and it saves
launches, but it is not faster.  Per layer over a 24-layer chain (measured at 29e3a9c, before the separate
path's bias went into its GEMM, which took another 2.3-2.5 us off its projections), the setting best over both shapes
took 33.3 us for qkv (2880 -> 5120; 32.0 us the best for qkv alone) against 27.9 us for the separate
launches, and 20.9 us for o (4096 -> 2880) against 23.6 us.  In the engine (setup (a)'s batch, one
process: fused, separate, fused again) the LoRA decode step took 11.76, 11.60 and 11.67 ms with the host
hidden.  qkv's 29.5 MB of W in 33.3 us (the shrink included) is 0.9 TB/s, a fifth of the read
bandwidth: the GEMM part is what is slow.  So ``max_tokens`` is 0 by default and the engine runs the
separate launches; ``LINEAR["max_tokens"] = 16`` turns the kernel on (benchmarks: ``--linear-config``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from unipage.kernels.common import finish_early, gdc_wait
from unipage.kernels.launch import launch
from unipage.kernels.lora import _sum_splits, lora_shrink, lora_shrink_expand, lora_shrink_expand_ref
from unipage.kernels.lora_meta import DenseLoraMeta, LoraBatch, next_pow2, plan_lora_batch
from unipage.kernels import skinny

__all__ = ["LINEAR", "check_config", "linear_lora", "linear_lora_ref", "fused_linear"]

# Launch settings: block_n, block_k, num_warps and stacked are the best of benchmarks/kernels_lora_linear.py
# --tune on an H200 (GPT-OSS-20B's qkv and o at 16 tokens); rank_chunk and num_stages were not swept.
# max_tokens 0 (the default: see the status above) turns the kernel off; at most MAX_TOKENS.
LINEAR = {"max_tokens": 0, "block_n": 32, "block_k": 128, "rank_chunk": 32, "stacked": True, "num_warps": 4,
          "num_stages": 4}
MAX_TOKENS = 64  # the kernel holds every token in one tile (and BM x rank_chunk stacked B rows)
TILE = 64  # width of the column tiles of `DenseLoraMeta.col_tile_table` that a program's tile lies in


@triton.jit
def _k_step(x_rows, w_cols, k, m_ok, n_ok, d_in, MASK_K: tl.constexpr, MASK_N: tl.constexpr, FP32: tl.constexpr):
    """``x[:, k] @ W[cols, k].T`` for one K step ``k`` [BK] (fp32 [BM, BN])."""
    x_mask = m_ok[:, None]
    w_mask = None
    if MASK_K:
        x_mask = x_mask & (k < d_in)[None, :]
        w_mask = (k < d_in)[:, None]
    if MASK_N:
        w_mask = n_ok[None, :] if w_mask is None else w_mask & n_ok[None, :]
    xk = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
    if w_mask is None:
        wk = tl.load(w_cols + k[:, None])
    else:
        wk = tl.load(w_cols + k[:, None], mask=w_mask, other=0.0)
    if FP32:
        return tl.dot(xk, wk, input_precision="ieee")
    return tl.dot(xk, wk)


@triton.jit
def _b_starts(tables, virt, ok, LOG2_P: tl.constexpr):
    """Pool element offsets (int64) of the B columns from virtual element ``virt`` of each row's slot buffer
    (page-table rows ``tables``): a row's BN columns lie inside one 64-run, so inside one page.  Not
    `lora._run_starts`, whose offsets carry a 64-alignment hint: these start BN-aligned."""
    page = tl.load(tables + (virt >> LOG2_P), mask=ok, other=0)
    return page.to(tl.int64) * (1 << LOG2_P) + (virt & ((1 << LOG2_P) - 1))


@triton.jit
def _stacked_b(pool_ptr, tables, row_virt, row_slot, row_rank, i_row, b_stride, n_ok, lanes, LOG2_P: tl.constexpr):
    """``[BM * RC, BN]``: row ``t * RC + j`` = rank row ``i_row`` of token t's B (zero past its rank or
    without a slot), this tile's columns."""
    ok = (row_slot >= 0) & (i_row < row_rank)
    start = _b_starts(tables, row_virt + i_row * b_stride, ok, LOG2_P)
    return tl.load(pool_ptr + start[:, None] + lanes[None, :], mask=ok[:, None] & n_ok[None, :], other=0.0)


@triton.jit(do_not_specialize=["num_tokens", "split_k"])
def _linear_lora_kernel(
    x_ptr, x_stride, w_ptr, bias_ptr, y_ptr, y_stride,
    pool_ptr, table_ptr, table_stride, token_slots_ptr, rank_ptr, b_off_ptr, part_ptr, col_tiles_ptr,
    num_tokens, d_in, split_k, scale,
    J: tl.constexpr, RB: tl.constexpr, RC: tl.constexpr, SPLITS: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, HAS_BIAS: tl.constexpr,
    LOG2_P: tl.constexpr, FP32: tl.constexpr, STACKED: tl.constexpr, USE_PDL: tl.constexpr,
):
    sub: tl.constexpr = 64 // BN  # programs per 64-column tile
    col_tile = col_tiles_ptr + (tl.program_id(0) // sub) * 4
    piece = tl.load(col_tile)
    width = tl.load(col_tile + 2)
    n_lo = tl.load(col_tile + 1) + (tl.program_id(0) % sub) * BN  # first column in the slice
    if n_lo >= width:
        finish_early(USE_PDL)
        return
    n = n_lo + tl.arange(0, BN)
    n_ok = n < width
    col = tl.load(col_tile + 3) + n  # column of y, row of W
    m = tl.arange(0, BM)
    m_ok = m < num_tokens
    k = tl.arange(0, BK)
    w_cols = w_ptr + col[None, :].to(tl.int64) * d_in  # [1, BN]
    x_rows = x_ptr + m[:, None] * x_stride  # [BM, 1]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, d_in // BK * BK, BK):  # whole K steps: only masks the tile shape needs
        acc += _k_step(x_rows, w_cols, k0 + k, m_ok, n_ok, d_in, False, not EVEN_N, FP32)
    if not EVEN_K:  # the tail of K
        acc += _k_step(x_rows, w_cols, d_in // BK * BK + k, m_ok, n_ok, d_in, True, True, FP32)
    dtype = y_ptr.dtype.element_ty
    if HAS_BIAS:  # into the product before it is rounded, as the separate path's F.linear does
        acc += tl.load(bias_ptr + col, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = acc.to(dtype)
    # the LoRA delta: per token, round(h) @ B[slot] over this tile's columns (B rows from pool pages)
    slots = tl.load(token_slots_ptr + m, mask=m_ok, other=-1)
    has = slots >= 0
    rank = tl.load(rank_ptr + slots * J + piece, mask=has, other=0)
    part_rows = part_ptr + m[:, None] * (J * RB) + piece * RB  # [BM, 1]
    b_stride = (width + 63) // 64 * 64
    if STACKED:  # the B rows of every token stacked, [BM * RC, BN], under a block-diagonal h: one dot
        r = tl.arange(0, BM * RC)
        row_tok = r // RC
        row_slot = tl.load(token_slots_ptr + row_tok, mask=row_tok < num_tokens, other=-1)
        row_rank = tl.load(rank_ptr + row_slot * J + piece, mask=row_slot >= 0, other=0)
        row_virt = tl.load(b_off_ptr + row_slot * J + piece, mask=row_slot >= 0, other=0) + n_lo
        tables = table_ptr + row_slot.to(tl.int64) * table_stride  # [BM * RC]
    else:  # per token, a broadcast-reduce over its [RC, BN] B rows
        b_virt = tl.load(b_off_ptr + slots * J + piece, mask=has, other=0)
        tables = table_ptr + slots.to(tl.int64) * table_stride  # [BM]
    lanes = tl.arange(0, BN)
    delta = tl.zeros((BM, BN), dtype=tl.float32)
    if STACKED:  # the first chunk's B rows before the wait: weights, read while the shrink finishes
        b_first = _stacked_b(pool_ptr, tables, row_virt, row_slot, row_rank, r % RC, b_stride, n_ok, lanes, LOG2_P)
    if USE_PDL:
        gdc_wait()  # the shrink's partials are complete and visible from here on
    for r0 in tl.static_range(0, RB, RC):
        i = r0 + tl.arange(0, RC)
        h = _sum_splits(part_rows, i, m_ok & has, i < RB, split_k, num_tokens * (J * RB), SPLITS)
        h = tl.where(has[:, None] & (i[None, :] < rank[:, None]), h.to(dtype).to(tl.float32), 0.0)  # [BM, RC]
        if STACKED:
            if r0 == 0:
                b = b_first
            else:  # [BM * RC, BN]
                b = _stacked_b(pool_ptr, tables, row_virt, row_slot, row_rank, r0 + r % RC, b_stride, n_ok, lanes,
                               LOG2_P)
            diag = m[:, None, None] == tl.arange(0, BM)[None, :, None]
            h_big = tl.reshape(tl.where(diag, h[:, None, :], 0.0), (BM, BM * RC)).to(dtype)
            if FP32:
                delta += tl.dot(h_big, b, input_precision="ieee")
            else:
                delta += tl.dot(h_big, b)
        else:
            ok = has[:, None] & (i[None, :] < rank[:, None])  # [BM, RC]
            start = _b_starts(tables[:, None], b_virt[:, None] + i[None, :] * b_stride + n_lo, ok, LOG2_P)
            b = tl.load(pool_ptr + start[:, :, None] + lanes[None, None, :],
                        mask=ok[:, :, None] & n_ok[None, None, :], other=0.0)  # [BM, RC, BN]
            delta += tl.sum(h[:, :, None] * b.to(tl.float32), axis=1)
    out = (out.to(tl.float32) + scale * delta).to(dtype)
    tl.store(y_ptr + m[:, None] * y_stride + col[None, :], out, mask=m_ok[:, None] & n_ok[None, :])


def _check_weight(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, meta: DenseLoraMeta) -> None:
    if not isinstance(w, torch.Tensor) or tuple(w.shape) != (meta.out_cols, meta.d_in):
        raise ValueError(f"linear_lora: w must be [{meta.out_cols}, {meta.d_in}] (the slices' columns by d_in), "
                         f"got {getattr(w, 'shape', type(w).__name__)}")
    if w.dtype != x.dtype or w.device != x.device or not w.is_contiguous():
        raise ValueError(f"linear_lora: w must be contiguous, {x.dtype} on {x.device}, got {w.dtype} on "
                         f"{w.device} with strides {w.stride()}")
    if bias is not None and (tuple(bias.shape) != (meta.out_cols,) or bias.dtype != x.dtype
                             or bias.device != x.device or not bias.is_contiguous()):
        raise ValueError(f"linear_lora: bias must be a contiguous [{meta.out_cols}] {x.dtype} tensor on "
                         f"{x.device}, got {tuple(bias.shape)} {bias.dtype} on {bias.device}")


def _covers(meta: DenseLoraMeta) -> bool:
    """Whether the slices lie end to end from column 0 (the fused kernel writes only their columns)."""
    ends = [s + c for s, c in zip(meta.slice_starts, meta.slice_cols)]
    return meta.slice_starts[0] == 0 and list(meta.slice_starts[1:]) == ends[:-1]


def fused_linear(count: int, meta: DenseLoraMeta, config: dict | None = None) -> bool:
    """Whether `linear_lora` takes the fused kernel for ``count`` tokens: at most ``max_tokens`` of them,
    some rank, and slices that cover the output.  (Either path of the shrink's batch plan leaves its
    partials per token.)"""
    cfg = LINEAR | (config or {})
    return 0 < count <= cfg["max_tokens"] and meta.max_rank > 0 and _covers(meta)


def check_config(cfg: dict) -> None:
    """ValueError unless ``cfg`` (all of `LINEAR`'s settings) is a valid launch setting of the fused kernel."""
    pow2 = lambda n: isinstance(n, int) and n > 0 and n & (n - 1) == 0  # noqa: E731
    if cfg["block_n"] not in (16, 32, 64):
        raise ValueError(f"linear_lora: config block_n must be 16, 32 or 64, got {cfg['block_n']}")
    if not (pow2(cfg["block_k"]) and cfg["block_k"] >= 16 and pow2(cfg["rank_chunk"])):
        raise ValueError(f"linear_lora: config block_k (>= 16) and rank_chunk must be powers of two, got "
                         f"{cfg['block_k']} and {cfg['rank_chunk']}")
    if not 0 <= cfg["max_tokens"] <= MAX_TOKENS:
        raise ValueError(f"linear_lora: config max_tokens must be in [0, {MAX_TOKENS}], got {cfg['max_tokens']}")


def _projection(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` in torch, the bias in the GEMM's epilogue (one launch, one rounding, as
    transformers' ``nn.Linear``): the reference's projection."""
    return F.linear(x, w, bias)


def linear_lora(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, pool: torch.Tensor,
                page_table: torch.Tensor, token_slots: torch.Tensor, meta: DenseLoraMeta, *,
                batch: LoraBatch | None = None, scale: float = 1.0, config: dict | None = None,
                early: bool = False) -> torch.Tensor:
    """``y = x @ w.T (+ bias)`` plus ``scale * round(x @ A[s, j].T) @ B[s, j]`` on slice ``j`` of the tokens
    with slot ``s = token_slots[t] >= 0`` (`lora.lora_shrink_expand`'s delta); returns the new ``y [T, C]``.

    ``w`` [C, D] contiguous, the model dtype (the slices' columns in order); ``bias`` [C] or None; the
    rest as for `lora.lora_shrink_expand`.  ``config`` overrides `LINEAR`.  ``early``: the shrink is
    launched as a programmatic dependent of the kernel before it (see `lora.lora_shrink`; the engine:
    whatever wrote ``x``).  Batches `fused_linear` refuses run the matmul with its bias and
    `lora.lora_shrink_expand` instead.
    """
    _check_weight(x, w, bias, meta)
    cfg = LINEAR | (config or {})
    if batch is None:
        batch = plan_lora_batch(token_slots, meta.num_slots)
    if not fused_linear(x.shape[0], meta, cfg):
        y = skinny.linear(x, w, bias)  # (F.linear but for weights with a tuned skinny entry)
        return lora_shrink_expand(y, x, pool, page_table, token_slots, meta, batch=batch, scale=scale, early=early)
    check_config(cfg)  # (only here: the engine's default path pays nothing for settings it does not use)
    block_n = cfg["block_n"]
    shrunk = lora_shrink(x, pool, page_table, token_slots, meta, batch=batch, early=early)
    plan, count = shrunk.plan, x.shape[0]
    y = torch.empty(count, meta.out_cols, dtype=x.dtype, device=x.device)
    tiles = meta.col_tile_table(TILE)
    pdl = "launch_pdl" in plan.expand_options
    launch(_linear_lora_kernel, (tiles.shape[0] * (TILE // block_n),),
           x, x.stride(0), w, bias if bias is not None else w, y, y.stride(0),
           pool, page_table, page_table.stride(0), token_slots, meta.rank, meta.b_offset, shrunk.part, tiles,
           count, meta.d_in, plan.split_k, float(scale),
           J=meta.num_slices, RB=meta.rank_block, RC=min(cfg["rank_chunk"], meta.rank_block),
           SPLITS=next_pow2(plan.split_k), BM=max(16, next_pow2(cfg["max_tokens"])), BN=block_n, BK=cfg["block_k"],
           EVEN_K=meta.d_in % cfg["block_k"] == 0, EVEN_N=all(c % block_n == 0 for c in meta.slice_cols),
           HAS_BIAS=bias is not None, LOG2_P=pool.shape[1].bit_length() - 1,
           FP32=x.dtype == torch.float32, STACKED=cfg["stacked"], USE_PDL=pdl,
           num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **({"launch_pdl": True} if pdl else {}))
    return y


def linear_lora_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, pool: torch.Tensor,
                    page_table: torch.Tensor, token_slots: torch.Tensor, meta: DenseLoraMeta, *,
                    batch: LoraBatch | None = None, scale: float = 1.0, config: dict | None = None,
                    early: bool = False) -> torch.Tensor:
    """Torch version of `linear_lora` (same signature): `F.linear`, then `lora_shrink_expand_ref`."""
    _check_weight(x, w, bias, meta)
    return lora_shrink_expand_ref(_projection(x, w, bias), x, pool, page_table, token_slots, meta, scale=scale)
