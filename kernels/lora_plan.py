"""The launch plan of the dense LoRA kernels (`lora`): per geometry and batch, their grids, constexprs and
launch options from the tuned config (`lora_meta.launch_config`), shared by every layer of the step with that
geometry (kept in ``LoraBatch.plans``).  The stacked expand of a shrink stack (`lora_stack`) has its own
column tile, config ``"stacked_block_n"`` (default ``block_n``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from unipage.kernels.common import fit_stages, gdc_wait, hopper_or_later
from unipage.kernels.lora_meta import DenseLoraMeta, LoraBatch, launch_config, next_pow2, rows_block, split_k_plan

RUN = 64  # elements per translated run; == unipage.lora_layout.ALIGN


def fail(name: str, expected: str, got) -> None:
    raise ValueError(f"lora_shrink_expand: {name} must be {expected}, got {got}")


@dataclass(frozen=True)
class LoraPlan:
    """The launch of one geometry (input width, slice widths and starts, rank block, dtype, page size,
    paged or not) on one batch: everything but the tensors.  Every layer with that geometry shares it
    (`cached_plan`)."""

    split_k: int
    k_per_split: int
    block_n: int
    shrink_grid: tuple[int, int, int]
    shrink_options: dict  # constexprs and launch options
    shrink_early: dict  # as a programmatic dependent of the kernel before it where the plan uses PDL
    expand_grid: tuple[int, int]
    expand_options: dict  # as a programmatic dependent of the shrink where the plan uses PDL
    expand_solo: dict  # as a plain launch
    stacked_block_n: int  # the stacked expand (`lora_stack`): its column tile, grid and launch
    stacked_grid: tuple[int, int]
    stacked_options: dict


def cached_plan(x, pool, meta: DenseLoraMeta, batch: LoraBatch, config: dict | None, contiguous: bool) -> LoraPlan:
    """`make_plan`, kept in ``batch.plans`` for the other layers of the step (not with a ``config`` override)."""
    if config:
        return make_plan(x, pool, meta, batch, config, contiguous)
    key = (meta.d_in, meta.slice_cols, meta.slice_starts, meta.rank_block, pool.dtype, pool.shape[1], contiguous,
           x.device)
    plan = batch.plans.get(key)
    if plan is None:
        plan = batch.plans[key] = make_plan(x, pool, meta, batch, None, contiguous)
    return plan


def make_plan(x, pool, meta: DenseLoraMeta, batch: LoraBatch, config: dict | None, contiguous: bool) -> LoraPlan:
    cfg = launch_config(meta, batch, pool.dtype, pool.device) | (config or {})
    pdl = use_pdl(cfg, pool.device)
    consts = {"J": meta.num_slices, "RB": meta.rank_block, "BM": batch.block_m, "GROUPED": batch.grouped,
              "PAGED": not contiguous, "LOG2_P": pool.shape[1].bit_length() - 1, "FP32": pool.dtype == torch.float32}
    # shrink
    if batch.grouped and meta.rank_block > RUN:
        cfg = {**cfg, "split_k": 1}  # the expand sums splits of [BM, 64]-rank chunks: keep it in registers
    rows = rows_block(meta, cfg)
    row_blocks = -(-(meta.num_slices * meta.rank_block) // rows)
    block_k, stages = fit_stages(cfg["block_k"], cfg["shrink_stages"], batch.block_m + rows, x.element_size(),
                                 x.device)  # x rows and A rows per stage
    block_k, split_k, k_per_split = split_k_plan(meta.d_in, block_k, batch.num_row_tiles * row_blocks, cfg,
                                                 x.device)
    shrink = dict(ROWS=rows, BK=block_k, EVEN_K=meta.d_in % block_k == 0, USE_PDL=pdl,
                  HOIST=k_per_split <= pool.shape[1], **consts, num_warps=cfg["shrink_warps"], num_stages=stages,
                  WAIT_PRIOR=False)
    early = shrink | ({"WAIT_PRIOR": True, "launch_pdl": True} if pdl and cfg.get("early", True) else {})
    # expand
    block_n, stacked_n = cfg["block_n"], cfg.get("stacked_block_n") or cfg["block_n"]
    for name, value in (("block_n", block_n), ("stacked_block_n", stacked_n)):
        if value < RUN or value % RUN:
            fail(f"config {name}", "a multiple of 64", value)
    expand = dict(RK=min(meta.rank_block, 64), SPLITS=next_pow2(split_k), BN=block_n,
                  WIDE=meta.rank_block <= 64 and not batch.grouped, Y_DIV=math.gcd(RUN, *meta.slice_starts),
                  EVEN_N=all(c % block_n == 0 for c in meta.slice_cols), USE_PDL=pdl, **consts,
                  num_warps=cfg["expand_warps"], num_stages=cfg["expand_stages"],
                  **({"launch_pdl": True} if pdl else {}))
    solo = {k: v for k, v in expand.items() if k != "launch_pdl"} | {"USE_PDL": False}
    stacked = solo | {"SPLITS": 1, "ENTRY": True, "BN": stacked_n,
                      "EVEN_N": all(c % stacked_n == 0 for c in meta.slice_cols)}
    return LoraPlan(split_k, k_per_split, block_n, (batch.num_row_tiles, split_k, row_blocks), shrink, early,
                    (batch.num_row_tiles, meta.col_tile_table(block_n).shape[0]), expand, solo, stacked_n,
                    (batch.num_row_tiles, meta.col_tile_table(stacked_n).shape[0]), stacked)


def use_pdl(cfg: dict, device: torch.device) -> bool:
    """Launch the expand as a programmatic dependent of the shrink (Hopper+, config ``"pdl"``, default on)."""
    return bool(cfg.get("pdl", True)) and gdc_wait is not None and hopper_or_later(device)
