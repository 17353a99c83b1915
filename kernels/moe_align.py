"""Planning shared by the MoE kernels: token-to-group alignment, the expert-LoRA
metadata of a layer (from the paged layout), and tuned launch configs.

Shape legend: T = tokens, K = top_k, TK = T·K routed *pairs* (pair ``p`` is token
``p // K``'s ``p % K``-th expert choice), E = experts, S = adapter slots,
G = groups, BM = tile height (``block_m``).

A grouped MoE GEMM runs tiles of BM pairs that share one *group* — the expert
for the base MoE, the (adapter slot, expert) pair for the LoRA deltas.
Alignment lists each group's pairs contiguously, padded to a multiple of BM::

    sorted_pairs  [max_blocks·BM] int32   group 0's pairs, padding, group 1's pairs, ...
                                          padding entries hold TK (out of range)
    block_group   [max_blocks]    int32   group of tile b; -1 for b >= num_blocks
    num_blocks    [1]             int32   tiles in use (device value: no host sync)

Pairs without a group (LoRA: token without adapter, or an adapter without
expert targets in this layer) appear nowhere.  The order of pairs inside a
group is unspecified.  Sizes are bounded without looking at the data: at most
``n = min(G, TK)`` groups are non-empty, each wastes at most BM-1 padding entries, so
``max_blocks = cdiv(TK + n·(BM-1), BM)`` — the grids are sized by it and tiles past
``num_blocks`` exit at once.

LoRA grouping given a bound A on the distinct slots among the step's tokens
(`moe_align`'s ``active_slots``, below the tables' S): a pair's group is its slot's
*rank* among them times E plus its expert, so G = A·E — the counts, the padded
groups and the tiles scale with the adapters a step has, not with the adapters
resident (setup (b) serves 16, so S = 32 table rows, at 4 a step: 4,096 groups and
a bound of 2,048 tiles at decode without ranks, 512 and 608 with them); the tiles
still name ``slot·E + expert``.  A slot ranked past A (a wrong bound) has no group.  The ranks
come from `moe_ranks` (once a step).

Expert-LoRA metadata (`moe_lora_meta`) is one int32 row per adapter slot
(fields `FIELDS`): the slot's expert-group base and stride and, relative to the
group start, the offsets, rows and ranks of gate/up A, of each gate/up B slice
(at most two: fused format, or gate and up) and of down A/B.  Rank 0 = the
adapter lacks that target in this layer.

Launch configs are JSON (``configs/moe_default.json`` and, when present,
``configs/moe_<device>.json`` written by ``benchmarks/kernels_moe.py --tune``),
keyed by shape, each a list of entries ordered by ``max_load`` — the tokens
per group (per expert for the base MoE, per (adapter, expert) for LoRA) the
entry is tuned for.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from unipage.kernels.common import cdiv, next_pow2
from unipage.kernels.common import device_key  # noqa: F401  (re-exported for the tuner)
from unipage.kernels.launch import launch
from unipage.kernels.moe_ranks import SlotRanks, check_active_slots, check_ranks, ranks_ref, slot_ranks
from unipage.lora_layout import AdapterLayout

CONFIG_DIR = Path(__file__).parent / "configs"
PLAN_ELEMS = 8192  # counts the alignment's plan program holds at once (chunks x groups)


def _plan_rows(g_pad: int) -> int:
    """Chunks whose counts the plan program loads at once: by the group count alone (so the
    number of chunks, which follows the batch, never makes a new compile)."""
    return min(16, max(1, PLAN_ELEMS // g_pad))


@dataclass(frozen=True)
class Alignment:
    sorted_pairs: torch.Tensor  # [max_blocks * block_m] int32; padding = num_pairs
    block_group: torch.Tensor  # [max_blocks] int32; -1 past the last tile
    num_blocks: torch.Tensor  # [1] int32
    block_m: int
    max_blocks: int
    num_pairs: int


@triton.jit
def swizzle(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Tile ``(m, n)`` of program ``pid``: GROUP_M consecutive m-tiles sweep n together (L2 reuse)."""
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


def max_blocks(num_pairs: int, num_groups: int, block_m: int) -> int:
    return cdiv(num_pairs + min(num_groups, num_pairs) * (block_m - 1), block_m)


def _ranked(token_slots, slot_flags, active_slots) -> bool:
    """Whether LoRA pairs group by their slot's rank: a bound (> 0) below the slots' count."""
    return token_slots is not None and bool(active_slots) and active_slots < slot_flags.shape[0]


def _check_align_args(topk_ids, num_experts, block_m, token_slots, slot_flags, active_slots=None) -> None:
    check_active_slots(active_slots)
    if topk_ids.dim() != 2 or topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be a contiguous [T, K] int32 tensor, got "
                         f"{tuple(topk_ids.shape)} {topk_ids.dtype}")
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"num_experts and block_m must be >= 1, got {num_experts}, {block_m}")
    if (token_slots is None) != (slot_flags is None):
        raise ValueError("token_slots and slot_flags go together (LoRA grouping) or not at all")
    if token_slots is not None:
        if token_slots.shape != (topk_ids.shape[0],) or token_slots.dtype != torch.int32:
            raise ValueError(f"token_slots must be [T={topk_ids.shape[0]}] int32, got "
                             f"{tuple(token_slots.shape)} {token_slots.dtype}")
        if slot_flags.dim() != 1 or slot_flags.dtype != torch.int32:
            raise ValueError(f"slot_flags must be [S] int32, got {tuple(slot_flags.shape)} {slot_flags.dtype}")


def _num_groups(num_experts: int, slot_flags: torch.Tensor | None) -> int:
    return num_experts if slot_flags is None else num_experts * slot_flags.shape[0]


@triton.jit
def _pair_groups(offs, topk_ids_ptr, slots_ptr, flags_ptr, ranks_ptr, num_pairs, top_k, num_experts, num_ranks,
                 LORA: tl.constexpr, RANKED: tl.constexpr):
    """Group of each pair in ``offs`` and whether it has one (RANKED: by its slot's rank among the step's
    slots; a rank past ``num_ranks`` has none)."""
    valid = offs < num_pairs
    expert = tl.load(topk_ids_ptr + offs, mask=valid, other=0)
    if LORA:
        slot = tl.load(slots_ptr + offs // top_k, mask=valid, other=-1)
        flag = tl.load(flags_ptr + tl.maximum(slot, 0), mask=valid & (slot >= 0), other=0)
        valid = valid & (flag != 0)
        if RANKED:
            slot = tl.load(ranks_ptr + tl.maximum(slot, 0), mask=valid, other=num_ranks)
            valid = valid & (slot < num_ranks)
        group = tl.where(valid, slot * num_experts + expert, 0)
    else:
        group = expert
    return group, valid


@triton.jit
def _fill_padding(sorted_ptr, num_pairs, max_blocks, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    for start in range(0, max_blocks * BLOCK_M, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs, tl.zeros([CHUNK], tl.int32) + num_pairs, mask=offs < max_blocks * BLOCK_M)


@triton.jit
def _plan_groups(counts, num_blocks_ptr, BLOCK_M: tl.constexpr):
    """Pad each group's count to BM; store the tile count; return the groups' starts and padded counts."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    tl.store(num_blocks_ptr, tl.sum(padded, 0) // BLOCK_M)
    return tl.cumsum(padded, 0) - padded, padded


@triton.jit
def _write_tile_groups(block_group_ptr, starts, padded, max_blocks, inverse_ptr, num_experts, BLOCK_M: tl.constexpr,
                       G_PAD: tl.constexpr, CHUNK: tl.constexpr, RANKED: tl.constexpr):
    """Group g owns tiles ``starts[g] / BM`` .. ``+ padded[g] / BM``: each group writes its own
    (one vector store per tile of the largest group); tiles past the last group get -1.  RANKED: a tile's
    group is written as its slot's, ``inverse[rank]·E + expert``."""
    groups = tl.arange(0, G_PAD)
    if RANKED:
        rank = groups // num_experts
        groups = tl.load(inverse_ptr + rank, mask=padded > 0, other=0) * num_experts + groups % num_experts
    first, tiles = starts // BLOCK_M, padded // BLOCK_M
    for j in range(tl.max(tiles, 0)):
        tl.store(block_group_ptr + first + j, groups, mask=j < tiles)
    used = tl.sum(tiles, 0)
    for start in range(0, max_blocks, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(block_group_ptr + offs, tl.full([CHUNK], -1, tl.int32), mask=(offs >= used) & (offs < max_blocks))


@triton.jit
def _scatter_chunk(offs, cursor_ptr, sorted_ptr, topk_ids_ptr, slots_ptr, flags_ptr, ranks_ptr, num_pairs, top_k,
                   num_experts, num_ranks, LORA: tl.constexpr, RANKED: tl.constexpr):
    """Each pair of the chunk takes the next free slot of its group."""
    group, valid = _pair_groups(offs, topk_ids_ptr, slots_ptr, flags_ptr, ranks_ptr, num_pairs, top_k, num_experts,
                                num_ranks, LORA, RANKED)
    pos = tl.atomic_add(cursor_ptr + group, 1, mask=valid, sem="relaxed")
    tl.store(sorted_ptr + pos, offs, mask=valid)


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _align_kernel(
    topk_ids_ptr,  # [TK] int32 expert of each pair
    slots_ptr, flags_ptr,  # LORA: [T] int32 token slots (-1 none), [S] int32 slot has expert LoRA
    ranks_ptr, inverse_ptr,  # RANKED: [S] int32 rank of each slot, [A] int32 slot of each rank (`moe_ranks.slot_ranks`)
    counts_ptr, cursor_ptr,  # [G_PAD] int32 scratch each
    sorted_ptr, block_group_ptr, num_blocks_ptr,  # outputs: see `Alignment`
    num_pairs, max_blocks, top_k, num_experts, num_ranks,
    LORA: tl.constexpr, RANKED: tl.constexpr, BLOCK_M: tl.constexpr, G_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # Small TK, one program: histogram -> padded prefix sums -> tile groups -> scatter.
    # Phases talk through global scratch, separated by CTA barriers.
    offs_g = tl.arange(0, G_PAD)
    tl.store(counts_ptr + offs_g, tl.zeros([G_PAD], tl.int32))
    _fill_padding(sorted_ptr, num_pairs, max_blocks, BLOCK_M, CHUNK)
    tl.debug_barrier()
    for start in range(0, num_pairs, CHUNK):
        group, valid = _pair_groups(start + tl.arange(0, CHUNK), topk_ids_ptr, slots_ptr, flags_ptr, ranks_ptr,
                                    num_pairs, top_k, num_experts, num_ranks, LORA, RANKED)
        tl.atomic_add(counts_ptr + group, 1, mask=valid, sem="relaxed")
    tl.debug_barrier()
    starts, padded = _plan_groups(tl.load(counts_ptr + offs_g, volatile=True), num_blocks_ptr, BLOCK_M)
    tl.store(cursor_ptr + offs_g, starts)
    tl.debug_barrier()
    _write_tile_groups(block_group_ptr, starts, padded, max_blocks, inverse_ptr, num_experts, BLOCK_M, G_PAD, CHUNK,
                       RANKED)
    for start in range(0, num_pairs, CHUNK):
        _scatter_chunk(start + tl.arange(0, CHUNK), cursor_ptr, sorted_ptr, topk_ids_ptr, slots_ptr, flags_ptr,
                       ranks_ptr, num_pairs, top_k, num_experts, num_ranks, LORA, RANKED)


# Large TK: the same phases over three launches, one program per chunk for the atomics and the
# padding fill (each chunk counts and scatters through its own row of the [chunks, G_PAD] scratch).


@triton.jit
def _chunk_end(chunk, per_chunk, num_pairs):
    """``(first, end)``: the pairs of program ``chunk`` (``per_chunk`` each, the last one fewer)."""
    first = chunk * per_chunk
    return first, tl.minimum(first + per_chunk, num_pairs)


@triton.jit(do_not_specialize=["num_pairs", "fill_total", "fill_per"])
def _align_count_kernel(topk_ids_ptr, slots_ptr, flags_ptr, ranks_ptr, counts_ptr, sorted_ptr, num_pairs, per_chunk,
                        fill_total, fill_per, top_k, num_experts, num_ranks, LORA: tl.constexpr, RANKED: tl.constexpr,
                        G_PAD: tl.constexpr, VEC: tl.constexpr):
    chunk = tl.program_id(0)
    row = counts_ptr + chunk * G_PAD
    tl.store(row + tl.arange(0, G_PAD), tl.zeros([G_PAD], tl.int32))
    fill_first = chunk * fill_per  # this chunk's share of the padding fill (the scatter overwrites the pairs' entries)
    last = tl.minimum(fill_first + fill_per, fill_total)
    for start in range(fill_first, last, VEC):
        offs = start + tl.arange(0, VEC)
        tl.store(sorted_ptr + offs, tl.zeros([VEC], tl.int32) + num_pairs, mask=offs < last)
    tl.debug_barrier()
    first, end = _chunk_end(chunk, per_chunk, num_pairs)
    group, valid = _pair_groups(first + tl.arange(0, VEC), topk_ids_ptr, slots_ptr, flags_ptr, ranks_ptr, end, top_k,
                                num_experts, num_ranks, LORA, RANKED)
    tl.atomic_add(row + group, 1, mask=valid, sem="relaxed")


@triton.jit
def _chunk_rows(counts_ptr, c0, num_chunks, CB: tl.constexpr, G_PAD: tl.constexpr):
    """Rows ``c0 .. c0 + CB`` of the ``[chunks, G_PAD]`` counts (zeros past the last), their offsets and mask."""
    rows = c0 + tl.arange(0, CB)
    offs = rows[:, None] * G_PAD + tl.arange(0, G_PAD)[None, :]
    ok = (rows < num_chunks)[:, None]
    return tl.load(counts_ptr + offs, mask=ok, other=0), offs, ok


@triton.jit(do_not_specialize=["max_blocks", "num_chunks"])
def _align_plan_kernel(counts_ptr, cursor_ptr, block_group_ptr, num_blocks_ptr, inverse_ptr, max_blocks, num_chunks,
                       num_experts, BLOCK_M: tl.constexpr, G_PAD: tl.constexpr, CHUNK: tl.constexpr, CB: tl.constexpr,
                       RANKED: tl.constexpr):
    # CB chunks' counts at a time: a few loads in flight, not one dependent loop step per chunk
    totals = tl.zeros([G_PAD], tl.int32)
    for c0 in range(0, num_chunks, CB):
        block, _, _ = _chunk_rows(counts_ptr, c0, num_chunks, CB, G_PAD)
        totals += tl.sum(block, 0)
    running, padded = _plan_groups(totals, num_blocks_ptr, BLOCK_M)
    starts = running
    for c0 in range(0, num_chunks, CB):  # chunk c starts after the earlier chunks' pairs of each group
        block, offs, ok = _chunk_rows(counts_ptr, c0, num_chunks, CB, G_PAD)
        tl.store(cursor_ptr + offs, running[None, :] + tl.cumsum(block, 0) - block, mask=ok)
        running += tl.sum(block, 0)
    _write_tile_groups(block_group_ptr, starts, padded, max_blocks, inverse_ptr, num_experts, BLOCK_M, G_PAD, CHUNK,
                       RANKED)


@triton.jit(do_not_specialize=["num_pairs"])
def _align_scatter_kernel(topk_ids_ptr, slots_ptr, flags_ptr, ranks_ptr, cursor_ptr, sorted_ptr, num_pairs, per_chunk,
                          top_k, num_experts, num_ranks, LORA: tl.constexpr, RANKED: tl.constexpr,
                          G_PAD: tl.constexpr, VEC: tl.constexpr):
    chunk = tl.program_id(0)
    first, end = _chunk_end(chunk, per_chunk, num_pairs)
    _scatter_chunk(first + tl.arange(0, VEC), cursor_ptr + chunk * G_PAD, sorted_ptr, topk_ids_ptr, slots_ptr,
                   flags_ptr, ranks_ptr, end, top_k, num_experts, num_ranks, LORA, RANKED)


ONE_PROGRAM_WORK = 2560  # pairs + padded groups up to which one program beats three launches


VEC = 1024  # lanes of a three-launch program: its chunk (<= VEC pairs) is a runtime value, so one compile
# (not exempt from specialization: chunks of 16·n pairs keep the hint that the program's first pair is 16-aligned)


def _launch_split(num_pairs: int, g_pad: int, chunk: int | None, one_program_max: int | None) -> tuple[bool, int]:
    """``(one program?, pairs per program)``.  The one program walks every pair and every group
    serially; three launches cost about 9 us whatever the size.  Measured on an H100 (E 128 / 32,
    16-1024 tokens, 0, 8 or 16 LoRA slots): one program wins while pairs + ``g_pad`` (the groups
    padded to a power of two) <= 2560 (2048 base pairs: 9.5 against 11.3 us; 512 pairs, 2048
    groups: 8.3 against 11.0; 2048 pairs, 1024 groups: 13.1 against 10.9), and about 16 programs
    are best (4096 pairs: 256 each 11.8 us, 1024 each 12.8 us); a program takes 256 to 1024 pairs,
    so past 16K pairs there are more."""
    if chunk is not None and (chunk < 1 or chunk & (chunk - 1)):
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    if one_program_max is None:
        one = num_pairs == 0 or num_pairs + g_pad <= ONE_PROGRAM_WORK
    else:
        one = num_pairs <= one_program_max
    if chunk is None:
        chunk = 1024 if one else min(1024, max(256, next_pow2(num_pairs // 16)))
    return one, chunk


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              token_slots: torch.Tensor | None = None, slot_flags: torch.Tensor | None = None, *,
              chunk: int | None = None, one_program_max: int | None = None,
              active_slots: int | None = None, ranks: SlotRanks | None = None) -> Alignment:
    """Group the routed pairs into tiles of ``block_m`` (see the module docstring).

    ``topk_ids``    [T, K] int32  expert of each pair.
    ``token_slots`` [T] int32     adapter slot of each token, -1 = none (LoRA grouping only).
    ``slot_flags``  [S] int32     non-zero where the slot has expert LoRA in this layer.
    Without ``token_slots`` the group is the expert; with it, ``slot·E + expert``.
    ``active_slots`` (LoRA): at most this many distinct slots among the tokens.  Below S, pairs are grouped
    by their slot's rank among them (`moe_ranks.slot_ranks`, one more launch), so the groups, the counts
    and the tiles scale with it, not with S; ``block_group`` still names ``slot·E + expert``.  The pairs of
    a slot ranked past it are dropped (see the module docstring).  ``ranks``: `slot_ranks` of these tokens,
    slots and bound, made once for the step's layers (None: this call launches it).
    One launch walks the pairs ``chunk`` (a power of two) at a time; three launches run one program
    per ``chunk`` pairs.  ``one_program_max`` pairs at most take one launch; by default
    `_launch_split` chooses both (one launch while pairs + padded groups <= `ONE_PROGRAM_WORK`).
    """
    _check_align_args(topk_ids, num_experts, block_m, token_slots, slot_flags, active_slots)
    num_pairs, top_k, device = topk_ids.numel(), topk_ids.shape[1], topk_ids.device
    lora, ranks = token_slots is not None, _ranks(token_slots, slot_flags, active_slots, ranks)
    groups = _num_groups(num_experts, slot_flags) if ranks is None else active_slots * num_experts
    blocks = max_blocks(num_pairs, groups, block_m)
    g_pad = next_pow2(groups)
    one, chunk = _launch_split(num_pairs, g_pad, chunk, one_program_max)
    out = Alignment(torch.empty(blocks * block_m, dtype=torch.int32, device=device),
                    torch.empty(blocks, dtype=torch.int32, device=device),
                    torch.empty(1, dtype=torch.int32, device=device), block_m, blocks, num_pairs)
    rank_of, slot_of = ranks if ranks is not None else (topk_ids, topk_ids)
    routing = (topk_ids, token_slots if lora else topk_ids, slot_flags if lora else topk_ids, rank_of)
    ranked = {"LORA": lora, "RANKED": ranks is not None}
    if one:
        scratch = torch.empty(2, g_pad, dtype=torch.int32, device=device)
        launch(_align_kernel, (1,), *routing, slot_of, scratch[0], scratch[1], out.sorted_pairs, out.block_group,
               out.num_blocks, num_pairs, blocks, top_k, num_experts, active_slots or 0, **ranked, BLOCK_M=block_m,
               G_PAD=g_pad, CHUNK=chunk, num_warps=8)
        return out
    chunks, vec = cdiv(num_pairs, chunk), VEC if 256 <= chunk <= VEC else next_pow2(chunk)  # tests' tiny chunks
    counts, cursor = torch.empty(2, chunks, g_pad, dtype=torch.int32, device=device)
    fill_total = blocks * block_m
    launch(_align_count_kernel, (chunks,), *routing, counts, out.sorted_pairs, num_pairs, chunk, fill_total,
           cdiv(fill_total, chunks), top_k, num_experts, active_slots or 0, **ranked, G_PAD=g_pad, VEC=vec,
           num_warps=4)
    launch(_align_plan_kernel, (1,), counts, cursor, out.block_group, out.num_blocks, slot_of, blocks, chunks,
           num_experts, BLOCK_M=block_m, G_PAD=g_pad, CHUNK=1024, CB=_plan_rows(g_pad), RANKED=ranked["RANKED"],
           num_warps=8)
    launch(_align_scatter_kernel, (chunks,), *routing, cursor, out.sorted_pairs, num_pairs, chunk, top_k,
           num_experts, active_slots or 0, **ranked, G_PAD=g_pad, VEC=vec, num_warps=4)
    return out


def _ranks(token_slots, slot_flags, active_slots, ranks: SlotRanks | None) -> SlotRanks | None:
    """The ranks `moe_align` groups by: None when it does not (`_ranked`), else ``ranks`` (checked) or
    `slot_ranks` of the tokens."""
    if not _ranked(token_slots, slot_flags, active_slots):
        return None
    if ranks is None:
        return slot_ranks(token_slots, slot_flags.shape[0], active_slots)
    check_ranks(ranks, token_slots, slot_flags.shape[0], active_slots)
    return ranks


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                  token_slots: torch.Tensor | None = None, slot_flags: torch.Tensor | None = None, *,
                  active_slots: int | None = None, ranks: SlotRanks | None = None) -> Alignment:
    """Torch version of `moe_align` (pairs in ascending order inside each group); no host sync.  It ranks
    the slots itself (``ranks``, checked as `moe_align` checks them, is not read)."""
    _check_align_args(topk_ids, num_experts, block_m, token_slots, slot_flags, active_slots)
    num_pairs, device = topk_ids.numel(), topk_ids.device
    ranked = _ranked(token_slots, slot_flags, active_slots)
    if ranked and ranks is not None:
        check_ranks(ranks, token_slots, slot_flags.shape[0], active_slots)
    groups = active_slots * num_experts if ranked else _num_groups(num_experts, slot_flags)
    blocks = max_blocks(num_pairs, groups, block_m)
    group = topk_ids.reshape(-1).long()
    if token_slots is not None:
        slot = token_slots.long().repeat_interleave(topk_ids.shape[1])
        has = (slot >= 0) & (slot_flags.long()[slot.clamp(min=0)] != 0)
        if ranked:
            rank, inverse = ranks_ref(token_slots, slot_flags.shape[0], active_slots)
            slot = rank[slot.clamp(min=0)]
            has &= slot < active_slots
        group = torch.where(has, slot * num_experts + group, groups)
    counts = torch.zeros(groups + 1, dtype=torch.long, device=device).scatter_add_(
        0, group, torch.ones_like(group))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[groups] = 0
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(group, stable=True)
    sorted_group = group[order]
    first = torch.cumsum(counts, 0) - counts
    dest = (ends - padded)[sorted_group] + torch.arange(num_pairs, device=device) - first[sorted_group]
    dest = torch.where(sorted_group < groups, dest, blocks * block_m)
    sorted_pairs = torch.full((blocks * block_m + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.int()
    starts = torch.arange(blocks, device=device) * block_m
    block_group = torch.searchsorted(ends[:groups], starts, right=True)
    if ranked:  # named by the slot, as the kernels read it
        block_group = inverse[(block_group // num_experts).clamp(max=active_slots - 1)] * num_experts \
            + block_group % num_experts
    block_group = torch.where(starts < ends[-1], block_group, -1).int()
    return Alignment(sorted_pairs[:-1], block_group, (ends[-1:] // block_m).int(), block_m, blocks, num_pairs)


# ---------------------------------------------------------------------------------------------
# Expert-LoRA metadata: where each slot's expert LoRA lives in one layer

# Per-slot fields of `MoeLoraMeta.table` (int32).  Offsets are relative to the
# slot's expert-0 group start; rank 0 = the adapter lacks the target here.
FIELDS = ("expert_base", "expert_stride", "gu_a", "gu_rows", "gu_slices",
           "s0_a_row", "s0_rank", "s0_b", "s0_col", "s0_ncols",
           "s1_a_row", "s1_rank", "s1_b", "s1_col", "s1_ncols",
           "down_a", "down_rank", "down_b")
_FIELD_INDEX = {name: i for i, name in enumerate(FIELDS)}
NUM_FIELDS = tl.constexpr(len(FIELDS))
F_BASE = tl.constexpr(_FIELD_INDEX["expert_base"])
F_STRIDE = tl.constexpr(_FIELD_INDEX["expert_stride"])
F_GU_A = tl.constexpr(_FIELD_INDEX["gu_a"])
F_GU_ROWS = tl.constexpr(_FIELD_INDEX["gu_rows"])
F_GU_SLICES = tl.constexpr(_FIELD_INDEX["gu_slices"])
F_SLICE0 = tl.constexpr(_FIELD_INDEX["s0_a_row"])
SLICE_FIELDS = tl.constexpr(5)  # a_row, rank, b, col, ncols
F_DOWN_A = tl.constexpr(_FIELD_INDEX["down_a"])
F_DOWN_RANK = tl.constexpr(_FIELD_INDEX["down_rank"])
F_DOWN_B = tl.constexpr(_FIELD_INDEX["down_b"])


@dataclass(frozen=True)
class MoeLoraMeta:
    """Where every slot's expert LoRA lives in one layer (built by `moe_lora_meta`)."""

    table: torch.Tensor  # [S, NUM_FIELDS] int32, fields `FIELDS`
    slot_flags: torch.Tensor  # [S] int32: 1 where the slot has an expert target in this layer
    hidden: int  # H (0 when no slot has expert LoRA)
    inter: int  # I
    num_experts: int  # E
    max_gate_up_rows: int  # largest R
    max_gate_up_rank: int  # largest gate/up slice rank
    max_down_rank: int
    num_lora_slots: int  # slots with expert LoRA in this layer

    @property
    def any_lora(self) -> bool:
        return self.num_lora_slots > 0


def slot_fields(layer_layout) -> list[int] | None:
    gate_up = layer_layout.targets.get(("experts.gate_up", 0))
    down = layer_layout.targets.get(("experts.down", 0))
    if gate_up is None and down is None:
        return None
    start = layer_layout.expert_base
    row = dict.fromkeys(FIELDS, 0)
    row.update(expert_base=start, expert_stride=layer_layout.expert_stride)
    if gate_up is not None:
        if len(gate_up.slices) > 2:
            raise ValueError(f"experts.gate_up has {len(gate_up.slices)} B slices; at most 2 are supported")
        row.update(gu_a=gate_up.a.offset - start, gu_rows=gate_up.a.rows, gu_slices=len(gate_up.slices))
        for j, piece in enumerate(gate_up.slices):
            row.update({f"s{j}_a_row": piece.a_row, f"s{j}_rank": piece.rank, f"s{j}_b": piece.b.offset - start,
                        f"s{j}_col": piece.col, f"s{j}_ncols": piece.b.cols})
    if down is not None:
        row.update(down_a=down.a.offset - start, down_rank=down.a.rows, down_b=down.slices[0].b.offset - start)
    return [row[name] for name in FIELDS]


def _layer_dims(layouts, layer: int) -> tuple[int, int, int]:
    """``(H, I, E)`` from the first slot with expert LoRA in ``layer``; zeros if none."""
    for layout in layouts:
        targets = layout.layers[layer].targets if layout is not None else {}
        experts = 1 + max((e for (_, e) in targets), default=-1)
        if ("experts.gate_up", 0) in targets:
            entry = targets[("experts.gate_up", 0)]
            return entry.a.cols, sum(s.b.cols for s in entry.slices) // 2, experts
        if ("experts.down", 0) in targets:
            entry = targets[("experts.down", 0)]
            return entry.slices[0].b.cols, entry.a.cols, experts
    return 0, 0, 0


def moe_lora_meta(layouts: list[AdapterLayout | None], layer: int,
                  device: torch.device | str = "cpu") -> MoeLoraMeta:
    """Per-slot offsets and ranks of the expert LoRA of ``layer`` (``layouts[s]``: slot ``s``'s adapter)."""
    rows = []
    for layout in layouts:
        fields = slot_fields(layout.layers[layer]) if layout is not None else None
        rows.append(dict(zip(FIELDS, fields or [0] * len(FIELDS))))
    flags = [int(r["gu_rows"] > 0 or r["down_rank"] > 0) for r in rows]
    table = torch.tensor([list(r.values()) for r in rows], dtype=torch.int32).reshape(len(rows), len(FIELDS))
    hidden, inter, experts = _layer_dims(layouts, layer)
    return MoeLoraMeta(table.to(device), torch.tensor(flags, dtype=torch.int32, device=device),
                       hidden, inter, experts,
                       max((r["gu_rows"] for r in rows), default=0),
                       max((max(r["s0_rank"], r["s1_rank"]) for r in rows), default=0),
                       max((r["down_rank"] for r in rows), default=0), sum(flags))


def lora_pairs(token_slots: torch.Tensor, slot_flags: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[TK]`` bool: the pairs whose token's slot has expert LoRA in this layer."""
    slot = token_slots.long().repeat_interleave(top_k)
    return (slot >= 0) & (slot_flags.long()[slot.clamp(min=0)] != 0)


# ---------------------------------------------------------------------------------------------
# Launch configs


def shape_key(hidden: int, inter: int, num_experts: int, top_k: int) -> str:
    return f"H{hidden}_I{inter}_E{num_experts}_K{top_k}"


@functools.cache
def _config_file(name: str) -> dict:
    path = CONFIG_DIR / name
    return json.loads(path.read_text()) if path.exists() else {}


def launch_config(kind: str, shape: str, load: float, device: str | tuple[str, ...]) -> dict:
    """The ``kind`` ("base" or "lora") entry for ``shape`` tuned for ``load`` tokens per group.

    Looks in ``moe_<device>.json`` for ``shape``, for each device key in turn (`config_devices`: the
    GPU's own, then its siblings'), else uses ``moe_default.json``; returns the first entry whose
    ``max_load`` is >= ``load`` (else the last).
    """
    devices = (device,) if isinstance(device, str) else device
    tables = (_config_file(f"moe_{key}.json").get(shape, {}).get(kind) for key in devices)
    table = next((t for t in tables if t), None)
    if not table:
        table = _config_file("moe_default.json")["default"][kind]
    for entry in table:
        if load <= entry["max_load"]:
            return entry
    return table[-1]


def expected_load(num_pairs: int, groups: int) -> float:
    """Expected pairs per non-empty group when ``num_pairs`` fall uniformly into ``groups``."""
    if groups <= 1:
        return float(num_pairs)
    occupied = groups * -math.expm1(num_pairs * math.log1p(-1.0 / groups))
    return num_pairs / max(occupied, 1.0)
