"""The plan of the paged MoE LoRA kernels (`fused_moe_lora`, `moe_lora_sum`, `moe_lora_fused`):
a layer's LoRA inputs for one step (`MoeLora`), their checks, the launch config, the
alignment of pairs by (slot, expert) in group mode and the scratch (`plan_moe_lora` ->
`MoeLoraPlan`); the widths of the rank tiles (`lora_pads`, `tile_ranks`); and the device
helpers with which a program of those kernels finds its tile (`_tile`, `_num_tiles`) and
its slot's metadata (`_slot_row`, `_field`, `_skip`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from unipage.kernels.common import cdiv, config_devices, next_pow2
from unipage.kernels.moe_act import SILU, GatedActivation
from unipage.kernels.moe_align import (
    FIELDS,
    NUM_FIELDS,
    Alignment,
    MoeLoraMeta,
    expected_load,
    launch_config,
    moe_align,
    moe_align_ref,
    shape_key,
)
from unipage.kernels.moe_align import _ranks as align_ranks  # (the ranks `moe_align` groups by)
from unipage.kernels.moe_ranks import SlotRanks, check_active_slots


@dataclass(frozen=True)
class MoeLora:
    """The LoRA inputs of one MoE layer for one step."""

    pool: torch.Tensor  # [N, P] model dtype: this layer of the unified pool
    page_table: torch.Tensor  # [S, max_pages] int32: page ids of each slot's buffer
    token_slots: torch.Tensor  # [T] int32: adapter slot of each token, -1 = none
    meta: MoeLoraMeta  # this layer's offsets and ranks (`moe_lora_meta`)
    # at least the distinct adapter slots among the tokens (None: no bound): it picks the tuned config, and
    # group mode's alignment groups pairs by their slot's rank among that many (`moe_align`); a bound the
    # tokens break drops the LoRA of the slots ranked past it (on CPU tensors it is checked)
    active_slots: int | None = None
    ranks: SlotRanks | None = None  # `slot_ranks` of the step's tokens (made once for its layers), else None
    activation: GatedActivation = SILU  # the experts' gated activation (set by `fused_experts`)


@dataclass(frozen=True)
class MoeLoraPlan:
    """Per-step, per-layer launch state: routing-side work and scratch (`plan_moe_lora`)."""

    lora: MoeLora
    topk_ids: torch.Tensor  # [T, K] int32
    config: dict  # the "lora" launch config entry
    align: Alignment | None  # group mode: pairs by slot·E + expert; None in pair mode
    gate_up_z: torch.Tensor  # [split_k, TK, R_PAD] float32: split-K partials of x @ A_gu.T
    down_z: torch.Tensor  # [TK, RD_PAD] float32: act @ A_d.T, summed by the gate/up pass
    # the step's slot ranks where pairs group by rank (`moe_align`'s ``_ranks``: ``lora.ranks`` checked, or made
    # here once for the alignment and the fused GEMMs), else None; the torch plan keeps ``lora.ranks`` as given
    ranks: SlotRanks | None = None


def _check_lora(lora: MoeLora, topk_ids: torch.Tensor) -> None:
    meta, pool = lora.meta, lora.pool
    page_elems = pool.shape[-1] if pool.dim() == 2 else 0
    if pool.dim() != 2 or page_elems < 64 or page_elems & (page_elems - 1) or not pool.is_contiguous():
        raise ValueError(f"pool must be one contiguous layer [N, P], P a power of two >= 64, got "
                         f"{list(pool.shape)}")
    slots = meta.table.shape[0]
    pt = lora.page_table
    if pt.dim() != 2 or pt.shape[0] != slots or pt.dtype != torch.int32 or pt.stride(1) != 1:
        raise ValueError(f"page_table must be [S={slots}, max_pages] int32 with unit column stride, got "
                         f"{list(pt.shape)} {pt.dtype}")
    if topk_ids.dim() != 2 or lora.token_slots.shape != (topk_ids.shape[0],) \
            or lora.token_slots.dtype != torch.int32:
        raise ValueError(f"token_slots must be [T={topk_ids.shape[0]}] int32, got "
                         f"{list(lora.token_slots.shape)} {lora.token_slots.dtype}")
    devices = {t.device for t in (pool, pt, lora.token_slots, topk_ids, meta.table, meta.slot_flags)}
    if len(devices) != 1:
        raise ValueError(f"LoRA tensors must share one device, got {sorted(map(str, devices))}")
    _check_active(lora)


def _check_active(lora: MoeLora) -> None:
    """``active_slots``: None or an int >= 0 (0: no bound); on CPU, at least the distinct slots of the tokens
    (on a GPU that count would cost a host sync: the engine's own count is exact or a graph's class bound)."""
    bound = lora.active_slots
    check_active_slots(bound)
    if bound and lora.token_slots.device.type == "cpu":
        distinct = torch.unique(lora.token_slots[lora.token_slots >= 0]).numel()
        if distinct > bound:
            raise ValueError(f"active_slots={bound} but the tokens have {distinct} distinct adapter slots")


def lora_config(lora: MoeLora, topk_ids: torch.Tensor, config: dict | None = None) -> dict:
    """``config`` if given, else the tuned entry for the expected pairs per (adapter, expert) group."""
    if config is not None:
        return config
    meta = lora.meta
    load = expected_load(topk_ids.numel(), (lora.active_slots or meta.num_lora_slots) * meta.num_experts)
    return launch_config("lora", shape_key(meta.hidden, meta.inter, meta.num_experts, topk_ids.shape[1]),
                         load, config_devices(topk_ids.device))


def lora_pads(meta: MoeLoraMeta) -> tuple[int, int, int]:
    """Power-of-two widths (>= 16, the tensor-core minimum) of z, of a slice rank, of the down rank."""
    return tuple(max(16, next_pow2(max(n, 1)))
                 for n in (meta.max_gate_up_rows, meta.max_gate_up_rank, meta.max_down_rank))


def tile_ranks(meta: MoeLoraMeta, block_m: int) -> tuple[int, int]:
    """Register-tile heights of a gate/up slice's B and of the down A / B: the `lora_pads` widths for tiles
    of >= 16 pairs (tensor-core dots need >= 16 rows); in pair mode and small tiles (broadcast-reduce, no
    dot) the ranks' own powers of two, so a rank-8 tile holds no masked rows."""
    if block_m >= 16:
        return lora_pads(meta)[1:]
    return tuple(max(2, next_pow2(max(n, 1))) for n in (meta.max_gate_up_rank, meta.max_down_rank))


def _split_k(hidden: int, split_k: int) -> tuple[int, int]:
    """``(splits, elements per split)``: K cut into whole 64-runs, no split left empty."""
    runs = cdiv(hidden, 64)
    per = cdiv(runs, max(1, split_k))
    return cdiv(runs, per), per * 64


def _plan(lora: MoeLora, topk_ids: torch.Tensor, config: dict | None, align_fn, ranks_fn) -> MoeLoraPlan:
    _check_lora(lora, topk_ids)
    ranks = ranks_fn(lora)
    cfg, meta = lora_config(lora, topk_ids, config), lora.meta
    block_m = cfg["block_m"]
    if type(block_m) is not int or block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f'lora config "block_m" must be a power of two >= 1, got {block_m!r}')
    align = None
    if block_m > 1:
        align = align_fn(topk_ids, meta.num_experts, block_m, lora.token_slots, meta.slot_flags,
                         active_slots=lora.active_slots, ranks=ranks)
    r_pad, _, rd_pad = lora_pads(meta)
    splits, _ = _split_k(meta.hidden, cfg["split_k"])
    num_pairs, device = topk_ids.numel(), topk_ids.device
    return MoeLoraPlan(lora, topk_ids, cfg, align,
                       torch.empty(splits, num_pairs, r_pad, dtype=torch.float32, device=device),
                       torch.empty(num_pairs, rd_pad, dtype=torch.float32, device=device), ranks)


def plan_moe_lora(lora: MoeLora, topk_ids: torch.Tensor, config: dict | None = None) -> MoeLoraPlan:
    """Check the inputs, pick the launch config, align pairs by (slot, expert) in group mode
    (`moe_align`, on the device, no host sync) and allocate scratch.

    ``lora``: the layer's `MoeLora`; ``topk_ids`` [T, K] int32; ``config``: a "lora"
    launch-config entry (default: tuned by the expected pairs per group).
    """
    return _plan(lora, topk_ids, config, moe_align, _step_ranks)


def plan_moe_lora_ref(lora: MoeLora, topk_ids: torch.Tensor, config: dict | None = None) -> MoeLoraPlan:
    """`plan_moe_lora` with the torch alignment (CPU engine path)."""
    return _plan(lora, topk_ids, config, moe_align_ref, lambda lora: lora.ranks)


def _step_ranks(lora: MoeLora):
    """The ranks `moe_align` groups by (given ones checked, else made), kept for the fused GEMMs too."""
    return align_ranks(lora.token_slots, lora.meta.slot_flags, lora.active_slots, lora.ranks)


# ---------------------------------------------------------------------------------------------
# Device helpers: a program's tile and its slot's metadata


@triton.jit
def _tile(pid_m, slots_ptr, flags_ptr, topk_ids_ptr, sorted_ptr, block_group_ptr,
          num_pairs, top_k, num_experts, BLOCK_M: tl.constexpr):
    """Pairs of tile ``pid_m``, their validity, and the tile's (slot, expert); slot -1 = no work.
    In pair mode the slot may still lack LoRA in this layer: see `_skip`."""
    if BLOCK_M == 1:  # pair mode: tile m is pair m
        pairs = pid_m + tl.arange(0, 1)
        slot = tl.load(slots_ptr + pid_m // top_k)
        expert = tl.load(topk_ids_ptr + pid_m)
    else:
        pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        group = tl.load(block_group_ptr + pid_m)
        slot = group // num_experts
        expert = group % num_experts
    return pairs, pairs < num_pairs, slot, expert


F_PAD = tl.constexpr(32)  # a metadata row in registers: the fields, then the slot's flag
F_FLAG = NUM_FIELDS
GATHER_SLOTS = 64  # up to this many slots a program loads the whole table (registers: S_PAD x F_PAD)
assert len(FIELDS) < F_PAD.value, "a metadata row and its flag must fit in F_PAD"


@triton.jit
def _slot_row(meta_ptr, flags_ptr, slot, num_slots, S_PAD: tl.constexpr):
    """``(row, at)``: where a program reads its slot's metadata; field ``F`` is
    ``_field(row, at + F)``.  ``S_PAD`` 0 (group mode's tile kernels, and any kernel above
    `GATHER_SLOTS` slots): ``at`` points at the slot's row of the table (slot 0's for slot -1), ``row``
    is unused.  ``S_PAD`` > 0 (pair mode, and `moe_lora_sum` in any mode: the table's rows padded):
    ``row`` [F_PAD] int32 holds the slot's fields and, at ``F_FLAG``, its flag (zeros for slot -1), and
    ``at`` is 0: the whole table and every flag are loaded and the row picked in registers, so these
    loads need not wait for the slot's own — one dependent memory round trip fewer before the weights,
    worth more at decode than the reductions that pick the fields out (in group mode's tiles it is the
    other way round)."""
    f = tl.arange(0, F_PAD)
    if S_PAD > 0:
        s = tl.arange(0, S_PAD)[:, None]
        ok = s < num_slots
        table = tl.load(meta_ptr + s * NUM_FIELDS + f[None, :], mask=ok & (f[None, :] < NUM_FIELDS), other=0)
        flag = tl.load(flags_ptr + s + f[None, :] * 0, mask=ok & (f[None, :] == F_FLAG), other=0)
        row = tl.sum(tl.where(s == slot, table + flag, 0), axis=0)
        at = tl.full([], 0, tl.int32)
    else:
        row = f * 0  # unused
        at = meta_ptr + tl.maximum(slot, 0) * NUM_FIELDS
    return row, at


@triton.jit
def _field(row, at, S_PAD: tl.constexpr):
    """The slot's metadata field at ``at`` (see `_slot_row`)."""
    if S_PAD > 0:
        value = tl.sum(tl.where(tl.arange(0, F_PAD) == at, row, 0))
    else:
        value = tl.load(at)
    return value


@triton.jit
def _skip(row, flags_ptr, slot, BLOCK_M: tl.constexpr, S_PAD: tl.constexpr):
    """Whether a tile has no LoRA work: no slot, or (pair mode) a slot without LoRA in this layer.
    Called after the tile's metadata loads are issued (through slot 0 when slot is -1 and ``S_PAD``
    is 0; a gathered row is zeros then)."""
    if BLOCK_M == 1:
        if S_PAD > 0:
            flag = tl.sum(tl.where(tl.arange(0, F_PAD) == F_FLAG, row, 0))
        else:
            flag = tl.load(flags_ptr + tl.maximum(slot, 0))
        skip = (slot < 0) | (flag == 0)
    else:
        skip = slot < 0
    return skip


@triton.jit
def _num_tiles(num_blocks_ptr, num_pairs, BLOCK_M: tl.constexpr):
    if BLOCK_M == 1:
        n = num_pairs
    else:
        n = tl.load(num_blocks_ptr)
    return n


def _slots_pad(plan: MoeLoraPlan) -> int:
    """`_slot_row`'s S_PAD: in pair mode the table's rows padded (`table_pad`); 0 (the row read through
    the slot) in group mode."""
    return table_pad(plan) if plan.config["block_m"] == 1 else 0


def table_pad(plan: MoeLoraPlan) -> int:
    """`_slot_row`'s S_PAD for a program that serves one slot: the metadata table's rows padded to a power
    of two, or 0 (the row read through the slot) above `GATHER_SLOTS` rows."""
    slots = plan.lora.meta.table.shape[0]
    return next_pow2(slots) if slots <= GATHER_SLOTS else 0
