"""Expert LoRA fused into the base MoE's grouped GEMMs ("K-extension").

Shape legend: TK pairs, BM x BN a GEMM tile, S slots, C = ``lora_k // RK`` slot ids per
extra K step (at least ``16 // RK``), RK = the gate/up ranks' power of two (RD: the down
rank's, in the down GEMM and the epilogue down shrink, which takes its own C), LK = C·RK.

The separate LoRA pass (`fused_moe_lora`) reads the base GEMM's un-activated gate/up
output back, adds the delta, re-applies the activation and read-modify-writes ``y``:
activation traffic that costs more than the LoRA math.  Here the deltas are extra K
steps of the base GEMMs, into the same accumulator, so nothing is written twice::

    acc[m, :] += Σ_j S[m, j] · B[j, :]          S [BM, LK], B [LK, BN]

A tile (BM pairs of one expert) holds pairs of several adapters.  Its steps cover the slot
ids from the smallest to the largest of its pairs' slots, C consecutive ids per step
(ids no pair of the tile has read nothing; slot ids, or ranks: below); column ``j`` of the step from
``c0`` belongs to slot ``c0 + j // RK`` and rank row ``r = j % RK``.  ``S[m, j]`` is pair m's shrink
output ``z[m, a_row + r]`` when pair m's slot is that slot (and ``r`` < its rank), else 0 —
block-sparse, built by one masked load; ``B[j]`` is row ``r`` of that slot's B for this
expert, read from the slot's pool pages (one page lookup per run).  RK is the ranks' power of
two, not padded to 16: the dot's K is the whole step (LK >= 16), so a step of ``lora_k`` 32 holds
four rank-8 slots.  A step depends only on the tile's smallest slot id, never on another step, and
the first ``lora_steps`` steps are unrolled, so the compiler issues their loads together (a loop of
dependent steps cost ~0.8 us each on an H100).  Further slot ids take a loop, each step from the
next id a pair has.  The steps' dots run after the main K loop (before it, their shared memory came
on top of the loop's, past the limit), but the first step's addressing (`gate_up_prep`,
`down_prep`: the pairs' slots -> metadata -> page table, a chain of dependent loads) is done before
the loop, so that only its weight and z loads are left after it: with one program an SM (the
prefill tiles), the chain was paid once per tile with the SM idle.  A tile without LoRA pairs
does no step.  Scaling is folded into B.

Where the MoeLora bounds the step's slots below the tables' rows (the engine's decode and mixed-step
graphs), the ids are the slots' ranks among the step's (`pair_slots`; the plan's `moe_ranks` ranks), so the
steps follow the step's adapters wherever loads and evictions put them in the tables.  `fused_moe` with LoRA at
(b)'s mixed step (H200, Qwen3-30B-A3B, 4,096 tokens, 5 adapters; by rank against by slot id): 989.6
against 1,123.6 us with the adapters at rows 3, 17, 9, 28, 22, 993.8 against 1,082.3 at rows 12, 5, 20,
8, 1, and 984.9 against 979.4 at rows 0-3 and 31.

- gate/up GEMM: ``acc_gate += S_gate @ B_gate``, ``acc_up += S_up @ B_up`` before
  the activation; then the down shrink ``down_z[m] += act[m] @ A_down[slot, e].T``: a grouped
  pass over ``act`` after the GEMM (config ``"down_shrink": "pass"``, the default) or, with
  ``"epilogue"``, this column tile's share from the rounded ``act`` the GEMM stores (atomics).
- down GEMM: ``acc += S_down @ B_down`` before the bias and the routing weight.

``z`` (split-K partials of ``x @ A_gu.T``) and zeroed ``down_z`` come from
`fused_moe_lora.moe_lora_shrink`, run before the gate/up GEMM.

Status (H100, bf16, 8 adapters; benchmarks/results/kernels-moe-fused-sweeps-h100.jsonl):
exact, but slower than the separate pass at every size measured there.  On an H200, Qwen3-30B-A3B
(rank 8, adapters in runs), with ``"lora_k": 32``, one unrolled step and the down shrink in the
epilogue, it beats the separate pass from 2,048 tokens (4 adapters: 660-664 against 681 us a layer
at 2,048, 959-979 against 1,019-1,031 at 4,096; one adapter at 4,096: 922-937 against 998) but not at
1,024 tokens of one adapter (476-483 against 465), nor at decode sizes (256 tokens: 453 against
368); so that H200 entry past load 22.6 fuses from 2,048 tokens (``"fused_min_tokens"``), and since
b16eddc the entry of load 16 too (setup (b)'s mixed steps of 5 adapters in graphs of class 16: 933.1
against 1,034.6 us at 4,096 tokens, with e16e0cc's kernels; at 16 adapters round-robin 1,311.7 against
1,099.3); the other entries leave it off.  Config ``"fused": "down"`` (`fused_mode`) fuses the down delta
alone, after the separate gate/up pass.  In the "fused-down-sweep" rows it is 2.5-3.8 % faster than the separate
pass in three cases only (Qwen3-30B-A3B 8 x r16 at 256 and 1024 tokens, 16 x r8 at 1024) and
slower elsewhere (16, 64 and 4096 tokens, 16 x r8 at 256, GPT-OSS-20B); with the gate/up expand
capped at 128 registers (fec3979's kernels_moe rows) it is slower at 1024 tokens too.
"""

from __future__ import annotations

import triton
import triton.language as tl
from unipage.kernels.common import load_bases, run_bases
from unipage.kernels.moe_align import (
    F_BASE,
    F_DOWN_A,
    F_DOWN_B,
    F_DOWN_RANK,
    F_GU_SLICES,
    F_SLICE0,
    F_STRIDE,
    NUM_FIELDS,
    SLICE_FIELDS,
)

NONE = tl.constexpr(1 << 30)  # "no slot": larger than any slot id
MAX_STEPS = 8  # unrolled steps at most ("lora_steps"): each adds its loads and dots to the compiled kernel


@triton.jit
def pair_slots(slots_ptr, flags_ptr, ranks_ptr, num_ranks, pairs, pair_ok, top_k, RANKED: tl.constexpr):
    """``[BM]`` the id of each pair's slot where its token has expert LoRA in this layer, else NONE.  The id
    is the slot, or with RANKED its rank among the step's slots (`moe_ranks`; a rank past ``num_ranks`` has
    no LoRA, as in the alignment): the steps then cover the step's adapters, not the slot ids, which loads
    and evictions scatter over the table (3 steps a tile for 5 adapters in 16 rows, say, against 2)."""
    slot = tl.load(slots_ptr + tl.where(pair_ok, pairs // top_k, 0), mask=pair_ok, other=-1)
    flag = tl.load(flags_ptr + tl.maximum(slot, 0), mask=slot >= 0, other=0)
    if RANKED:
        rank = tl.load(ranks_ptr + tl.maximum(slot, 0), mask=flag != 0, other=NONE)
        slot = tl.where(rank < num_ranks, rank, NONE)
    else:
        slot = tl.where(flag != 0, slot, NONE)
    return slot


@triton.jit
def _real(ids, ok, inverse_ptr, RANKED: tl.constexpr):
    """The slots of ids from `pair_slots` (where ``ok``; 0 elsewhere), for their metadata and page tables."""
    if RANKED:
        slot = tl.load(inverse_ptr + _zero_unless(ids, ok), mask=ok, other=0)
    else:
        slot = _zero_unless(ids, ok)
    return slot


@triton.jit
def _slot_range(slot):
    """``(lo, hi)``: the smallest and the largest slot id among the tile's LoRA pairs (``lo > hi``
    when it has none).  ``slot | -(slot >> 30)`` is -1 for NONE, else the slot: no compare and select
    on ``slot`` here (with the 2-D compares of `_chunk_at`, Triton 3.6's layout pass mis-rewrote one)."""
    return tl.min(slot, 0), tl.max(slot | -(slot >> 30), 0)


@triton.jit
def _next_slot(slot, at):
    """The smallest slot id ``>= at`` among the tile's pairs (NONE if none; ``at <= NONE``, so the sum
    cannot overflow): the loop after the unrolled steps skips ids no pair has (resident slots are
    sparse when many adapters are loaded).  By a multiply, not a select: see `_zero_unless`."""
    return tl.min(slot + (slot < at).to(tl.int32) * NONE, 0)


@triton.jit
def _chunk_at(slot, c0, C: tl.constexpr):
    """The step over slot ids ``[c0, c0 + C)``: those ids (NONE for ids no pair of the tile has), each
    pair's position in it and whether it is in it.  Both per-pair results come out of the [BM, C] match
    by reductions, not from compares on ``slot`` itself: Triton 3.6's layout pass broke on the latter."""
    ids = tl.arange(0, C)
    hit = ((slot[:, None] == (c0 + ids)[None, :]) & ((c0 + ids) < NONE)[None, :]).to(tl.int32)  # [BM, C]
    chunk = tl.where(tl.max(hit, 0) > 0, c0 + ids, NONE)
    return chunk, tl.sum(hit * ids[None, :], 1), tl.max(hit, 1) > 0


@triton.jit
def _rows(chunk, RK: tl.constexpr, C: tl.constexpr):
    """For each of the LK = C·RK extra K rows: its slot (NONE = unused), chunk position, rank row."""
    j = tl.arange(0, C * RK)
    c, r = j // RK, j % RK
    slot = tl.sum(tl.where(c[:, None] == tl.arange(0, C)[None, :], chunk[None, :], 0), 1)
    return slot, c, r


@triton.jit
def _zero_unless(x, ok):
    """``x`` where ``ok``, else 0, by a multiply: a select on these per-pair masks made Triton 3.6's layout
    pass fail (its condition and result left in different layouts)."""
    return x * ok.to(x.dtype)


@triton.jit
def _field(meta_ptr, slot, field, ok):
    """``meta[slot, field]`` per element (``field`` scalar or per element); 0 where not ``ok``."""
    return tl.load(meta_ptr + _zero_unless(slot, ok) * NUM_FIELDS + field, mask=ok, other=0)


@triton.jit
def _group_off(meta_ptr, slot, ok, expert):
    return _field(meta_ptr, slot, F_BASE, ok) + expert * _field(meta_ptr, slot, F_STRIDE, ok)


@triton.jit
def _slice_field(meta_ptr, slot, ok, UP: tl.constexpr):
    """Index of the first field of the gate (slice 0) or up (the last slice) B slice of each slot."""
    if UP:
        slices = _field(meta_ptr, slot, F_GU_SLICES, ok)
        field = F_SLICE0 + (tl.maximum(slices, 1) - 1) * SLICE_FIELDS
    else:
        field = F_SLICE0 + slot * 0
    return field


@triton.jit
def _paged_bases(pt_ptr, stride_pt, slot, virt, ok, cols_left, BLOCK_N: tl.constexpr, RUN: tl.constexpr,
                 PAGE_SHIFT: tl.constexpr):
    """`common.run_bases` of ``[rows, BLOCK_N]``: row i = slot[i]'s virtual elements ``virt[i] + [0, BLOCK_N)``."""
    pt = pt_ptr + _zero_unless(slot, ok).to(tl.int64)[:, None] * stride_pt
    return run_bases(pt, virt, ok, cols_left, BLOCK_N, RUN, PAGE_SHIFT, True)


@triton.jit
def _z_rows(slot, inside, pairs, meta_ptr, inverse_ptr, UP: tl.constexpr, R_PAD: tl.constexpr,
            RANKED: tl.constexpr):
    """Each pair's offset in ``z``'s first split at its slot's gate (or up) slice, and that slice's rank
    (0 for pairs not in the step)."""
    slot = _real(slot, inside, inverse_ptr, RANKED)
    field = _slice_field(meta_ptr, slot, inside, UP)
    a_row = _field(meta_ptr, slot, field, inside)
    return _zero_unless(pairs, inside).to(tl.int64) * R_PAD + a_row, _field(meta_ptr, slot, field + 1, inside)


@triton.jit
def _chunk_s(z_ptr, z_rows, pos, num_pairs, R_PAD: tl.constexpr, RK: tl.constexpr, SPLIT_K: tl.constexpr,
             C: tl.constexpr):
    """``S [BM, C·RK]`` float32: pair m's z entries (``z_rows`` from `_z_rows`) in the column block of its
    chunk position ``pos``, zeros elsewhere (one masked load per split)."""
    rows, rank = z_rows
    j = tl.arange(0, C * RK)
    c, r = j // RK, j % RK
    mask = (pos[:, None] == c[None, :]) & (r[None, :] < rank[:, None])
    s = tl.zeros((rows.shape[0], C * RK), tl.float32)
    for split in tl.static_range(SPLIT_K):
        at = rows + (split * num_pairs).to(tl.int64) * R_PAD
        s += tl.load(z_ptr + at[:, None] + r[None, :], mask=mask, other=0.0)
    return s


@triton.jit
def _gate_up_bases(chunk, expert, n0, inter, pt_ptr, meta_ptr, inverse_ptr, stride_pt, UP: tl.constexpr,
                   RK: tl.constexpr, C: tl.constexpr, BLOCK_N: tl.constexpr, RUN: tl.constexpr,
                   PAGE_SHIFT: tl.constexpr, RANKED: tl.constexpr):
    """Page-run bases of ``[C·RK, BLOCK_N]``: rows of the chunk's slots' gate (or up) B for this expert and
    column tile."""
    row_slot, _, r = _rows(chunk, RK, C)
    row_ok = row_slot < NONE
    row_slot = _real(row_slot, row_ok, inverse_ptr, RANKED)
    field = _slice_field(meta_ptr, row_slot, row_ok, UP)
    rank = _field(meta_ptr, row_slot, field + 1, row_ok)
    stride = (_field(meta_ptr, row_slot, field + 4, row_ok) + 63) // 64 * 64
    virt = _group_off(meta_ptr, row_slot, row_ok, expert) + _field(meta_ptr, row_slot, field + 2, row_ok) + r * stride
    if UP:  # up column n is the slice's local column n + I - col (the fused format's up half starts at I)
        virt += inter - _field(meta_ptr, row_slot, field + 3, row_ok)
    return _paged_bases(pt_ptr, stride_pt, row_slot, virt + n0, row_ok & (r < rank), inter - n0, BLOCK_N, RUN,
                        PAGE_SHIFT)


@triton.jit
def gate_up_prep(c0, slot, pairs, expert, n0, inter, pt_ptr, meta_ptr, inverse_ptr, stride_pt, R_PAD: tl.constexpr,
                 RK: tl.constexpr, C: tl.constexpr, BLOCK_N: tl.constexpr, RUN: tl.constexpr,
                 PAGE_SHIFT: tl.constexpr, RANKED: tl.constexpr):
    """The addressing of the gate/up step over slot ids ``[c0, c0 + C)``: each pair's chunk position, the
    page-run bases of gate B and up B, and the pairs' z rows (`gate_up_apply` does the loads and dots).
    Everything here follows a chain of dependent loads (slots -> metadata -> page table), so the fused
    GEMM runs its first step's before the main K loop, which then hides that chain."""
    chunk, pos, inside = _chunk_at(slot, c0, C)
    return (pos,
            _gate_up_bases(chunk, expert, n0, inter, pt_ptr, meta_ptr, inverse_ptr, stride_pt, False, RK, C,
                           BLOCK_N, RUN, PAGE_SHIFT, RANKED),
            _gate_up_bases(chunk, expert, n0, inter, pt_ptr, meta_ptr, inverse_ptr, stride_pt, True, RK, C,
                           BLOCK_N, RUN, PAGE_SHIFT, RANKED),
            _z_rows(slot, inside, pairs, meta_ptr, inverse_ptr, False, R_PAD, RANKED),
            _z_rows(slot, inside, pairs, meta_ptr, inverse_ptr, True, R_PAD, RANKED))


@triton.jit
def first_steps(slots_ptr, flags_ptr, ranks_ptr, inverse_ptr, num_ranks, pairs, pair_ok, top_k, expert, n0, N,
                pt_ptr, meta_ptr, stride_pt, R_PAD: tl.constexpr, RK: tl.constexpr, RD: tl.constexpr,
                C: tl.constexpr, DOWN_C: tl.constexpr, BLOCK_N: tl.constexpr, RUN: tl.constexpr,
                PAGE_SHIFT: tl.constexpr, GATED: tl.constexpr, DOWN_SHRINK: tl.constexpr, RANKED: tl.constexpr):
    """``(slot, prep, prep_down)`` for the fused GEMM to take before its main K loop: the tile's pairs' slots
    (`pair_slots`) and its first step's addressing from the smallest of them, of gate/up B (GATED; else
    ``prep`` is ``prep_down``) and of down A (GATED with DOWN_SHRINK, over DOWN_C slot ids) or down B (else;
    with neither, ``prep_down`` is ``prep``)."""
    slot = pair_slots(slots_ptr, flags_ptr, ranks_ptr, num_ranks, pairs, pair_ok, top_k, RANKED)
    first = tl.min(slot, 0)
    if GATED:
        prep = gate_up_prep(first, slot, pairs, expert, n0, N, pt_ptr, meta_ptr, inverse_ptr, stride_pt, R_PAD, RK,
                            C, BLOCK_N, RUN, PAGE_SHIFT, RANKED)
        if DOWN_SHRINK:
            prep_down = down_prep(first, slot, expert, n0, N, pt_ptr, meta_ptr, inverse_ptr, stride_pt, F_DOWN_A,
                                  RD, DOWN_C, BLOCK_N, RUN, PAGE_SHIFT, RANKED)
        else:
            prep_down = prep
    else:
        prep_down = down_prep(first, slot, expert, n0, N, pt_ptr, meta_ptr, inverse_ptr, stride_pt, F_DOWN_B, RD,
                              C, BLOCK_N, RUN, PAGE_SHIFT, RANKED)
        prep = prep_down
    return slot, prep, prep_down


@triton.jit
def gate_up_apply(acc, acc_up, prep, n0, inter, num_pairs, z_ptr, pool_ptr, R_PAD: tl.constexpr, RK: tl.constexpr,
                  SPLIT_K: tl.constexpr, C: tl.constexpr, BLOCK_N: tl.constexpr, RUN: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """The gate and up deltas of a step addressed by `gate_up_prep`."""
    pos, gate, up, z_gate, z_up = prep
    dtype = pool_ptr.dtype.element_ty
    b_gate = load_bases(pool_ptr, gate[0], gate[1], inter - n0, BLOCK_N, RUN)
    b_up = load_bases(pool_ptr, up[0], up[1], inter - n0, BLOCK_N, RUN)
    s_gate = _chunk_s(z_ptr, z_gate, pos, num_pairs, R_PAD, RK, SPLIT_K, C)
    s_up = _chunk_s(z_ptr, z_up, pos, num_pairs, R_PAD, RK, SPLIT_K, C)
    acc = tl.dot(s_gate.to(dtype), b_gate, acc, input_precision=DOT_PRECISION)
    acc_up = tl.dot(s_up.to(dtype), b_up, acc_up, input_precision=DOT_PRECISION)
    return acc, acc_up


@triton.jit
def gate_up_delta(acc, acc_up, prep, slot, pairs, expert, n0, inter, num_pairs, z_ptr, pool_ptr, pt_ptr, meta_ptr,
                  inverse_ptr, stride_pt, R_PAD: tl.constexpr, RK: tl.constexpr, SPLIT_K: tl.constexpr,
                  C: tl.constexpr, STEPS: tl.constexpr, BLOCK_N: tl.constexpr, RUN: tl.constexpr,
                  PAGE_SHIFT: tl.constexpr, DOT_PRECISION: tl.constexpr, RANKED: tl.constexpr):
    """Add the gate/up LoRA deltas of the tile's pairs (``slot`` from `pair_slots`) to ``acc`` / ``acc_up``:
    the first step from ``prep`` (`gate_up_prep` at the tile's smallest slot id), STEPS - 1 more unrolled
    steps, then a loop over the slot ids left."""
    lo, hi = _slot_range(slot)
    if lo <= hi:  # a tile without LoRA pairs skips the unrolled steps
        acc, acc_up = gate_up_apply(acc, acc_up, prep, n0, inter, num_pairs, z_ptr, pool_ptr, R_PAD, RK, SPLIT_K, C,
                                    BLOCK_N, RUN, DOT_PRECISION)
        for i in tl.static_range(1, STEPS):
            step = gate_up_prep(lo + i * C, slot, pairs, expert, n0, inter, pt_ptr, meta_ptr, inverse_ptr, stride_pt,
                                R_PAD, RK, C, BLOCK_N, RUN, PAGE_SHIFT, RANKED)
            acc, acc_up = gate_up_apply(acc, acc_up, step, n0, inter, num_pairs, z_ptr, pool_ptr, R_PAD, RK,
                                        SPLIT_K, C, BLOCK_N, RUN, DOT_PRECISION)
    c0 = _next_slot(slot, tl.minimum(lo + STEPS * C, NONE))  # (lo is NONE in a tile without LoRA pairs)
    while c0 <= hi:
        step = gate_up_prep(c0, slot, pairs, expert, n0, inter, pt_ptr, meta_ptr, inverse_ptr, stride_pt, R_PAD,
                            RK, C, BLOCK_N, RUN, PAGE_SHIFT, RANKED)
        acc, acc_up = gate_up_apply(acc, acc_up, step, n0, inter, num_pairs, z_ptr, pool_ptr, R_PAD, RK, SPLIT_K,
                                    C, BLOCK_N, RUN, DOT_PRECISION)
        c0 = _next_slot(slot, c0 + C)
    return acc, acc_up


@triton.jit
def _down_bases(chunk, expert, n0, width, pt_ptr, meta_ptr, inverse_ptr, stride_pt, FIELD: tl.constexpr,
                RD: tl.constexpr, C: tl.constexpr, BLOCK_N: tl.constexpr, RUN: tl.constexpr,
                PAGE_SHIFT: tl.constexpr, RANKED: tl.constexpr):
    """Page-run bases of ``[C·RD, BLOCK_N]``: rows of the chunk's slots' down A (``FIELD`` F_DOWN_A, rows of I)
    or down B (F_DOWN_B, rows of H = ``width``) for this expert and column tile."""
    row_slot, _, r = _rows(chunk, RD, C)
    row_ok = row_slot < NONE
    row_slot = _real(row_slot, row_ok, inverse_ptr, RANKED)
    rank = _field(meta_ptr, row_slot, F_DOWN_RANK, row_ok)
    virt = _group_off(meta_ptr, row_slot, row_ok, expert) + _field(meta_ptr, row_slot, FIELD, row_ok) \
        + r * ((width + 63) // 64 * 64)
    return _paged_bases(pt_ptr, stride_pt, row_slot, virt + n0, row_ok & (r < rank), width - n0, BLOCK_N, RUN,
                        PAGE_SHIFT)


@triton.jit
def down_prep(c0, slot, expert, n0, width, pt_ptr, meta_ptr, inverse_ptr, stride_pt, FIELD: tl.constexpr,
              RD: tl.constexpr, C: tl.constexpr, BLOCK_N: tl.constexpr, RUN: tl.constexpr, PAGE_SHIFT: tl.constexpr,
              RANKED: tl.constexpr):
    """The addressing of a down step over slot ids ``[c0, c0 + C)`` (down A: `down_shrink`; down B:
    `down_delta`): each pair's chunk position, whether it is in the step, the weights' page-run bases."""
    chunk, pos, inside = _chunk_at(slot, c0, C)
    return pos, inside, _down_bases(chunk, expert, n0, width, pt_ptr, meta_ptr, inverse_ptr, stride_pt, FIELD, RD, C,
                                    BLOCK_N, RUN, PAGE_SHIFT, RANKED)


@triton.jit
def _down_z_block(down_z_ptr, pairs, pos, inside, RD: tl.constexpr, RD_PAD: tl.constexpr, C: tl.constexpr):
    """Pointers ``[BM, C·RD]`` into ``down_z`` [TK, RD_PAD] and the mask of each pair's own slot's column block."""
    j = tl.arange(0, C * RD)
    mine = inside[:, None] & (pos[:, None] == (j // RD)[None, :])
    return down_z_ptr + _zero_unless(pairs, inside).to(tl.int64)[:, None] * RD_PAD + (j % RD)[None, :], mine


@triton.jit
def _down_shrink_apply(act, prep, pairs, n0, inter, down_z_ptr, pool_ptr, RD: tl.constexpr, RD_PAD: tl.constexpr,
                       C: tl.constexpr, BLOCK_N: tl.constexpr, RUN: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pos, inside, bases = prep
    a = load_bases(pool_ptr, bases[0], bases[1], inter - n0, BLOCK_N, RUN)
    part = tl.dot(act, tl.trans(a), input_precision=DOT_PRECISION)  # [BM, C·RD]: every slot of the chunk
    ptrs, mine = _down_z_block(down_z_ptr, pairs, pos, inside, RD, RD_PAD, C)
    tl.atomic_add(ptrs, part, mask=mine, sem="relaxed")


@triton.jit
def down_shrink(act, prep, slot, pairs, expert, n0, inter, down_z_ptr, pool_ptr, pt_ptr, meta_ptr, inverse_ptr,
                stride_pt, RD: tl.constexpr, RD_PAD: tl.constexpr, C: tl.constexpr, STEPS: tl.constexpr,
                BLOCK_N: tl.constexpr, RUN: tl.constexpr, PAGE_SHIFT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                RANKED: tl.constexpr):
    """``down_z[m] += act[m, cols] @ A_down[slot_m, e][:, cols].T`` for this column tile (``act`` [BM, BN]
    in the model dtype, as stored); the first step from ``prep`` (`down_prep` of down A)."""
    lo, hi = _slot_range(slot)
    if lo <= hi:
        _down_shrink_apply(act, prep, pairs, n0, inter, down_z_ptr, pool_ptr, RD, RD_PAD, C, BLOCK_N, RUN,
                           DOT_PRECISION)
        for i in tl.static_range(1, STEPS):
            step = down_prep(lo + i * C, slot, expert, n0, inter, pt_ptr, meta_ptr, inverse_ptr, stride_pt, F_DOWN_A,
                             RD, C, BLOCK_N, RUN, PAGE_SHIFT, RANKED)
            _down_shrink_apply(act, step, pairs, n0, inter, down_z_ptr, pool_ptr, RD, RD_PAD, C, BLOCK_N, RUN,
                               DOT_PRECISION)
    c0 = _next_slot(slot, tl.minimum(lo + STEPS * C, NONE))  # (lo is NONE in a tile without LoRA pairs)
    while c0 <= hi:
        step = down_prep(c0, slot, expert, n0, inter, pt_ptr, meta_ptr, inverse_ptr, stride_pt, F_DOWN_A, RD, C,
                         BLOCK_N, RUN, PAGE_SHIFT, RANKED)
        _down_shrink_apply(act, step, pairs, n0, inter, down_z_ptr, pool_ptr, RD, RD_PAD, C, BLOCK_N, RUN,
                           DOT_PRECISION)
        c0 = _next_slot(slot, c0 + C)


@triton.jit
def _down_apply(acc, prep, pairs, n0, hidden, down_z_ptr, pool_ptr, RD: tl.constexpr, RD_PAD: tl.constexpr,
                C: tl.constexpr, BLOCK_N: tl.constexpr, RUN: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pos, inside, bases = prep
    b = load_bases(pool_ptr, bases[0], bases[1], hidden - n0, BLOCK_N, RUN)
    ptrs, mine = _down_z_block(down_z_ptr, pairs, pos, inside, RD, RD_PAD, C)
    s = tl.load(ptrs, mask=mine, other=0.0)
    return tl.dot(s.to(pool_ptr.dtype.element_ty), b, acc, input_precision=DOT_PRECISION)


@triton.jit
def down_delta(acc, prep, slot, pairs, expert, n0, hidden, down_z_ptr, pool_ptr, pt_ptr, meta_ptr, inverse_ptr,
               stride_pt, RD: tl.constexpr, RD_PAD: tl.constexpr, C: tl.constexpr, STEPS: tl.constexpr,
               BLOCK_N: tl.constexpr, RUN: tl.constexpr, PAGE_SHIFT: tl.constexpr, DOT_PRECISION: tl.constexpr,
               RANKED: tl.constexpr):
    """``acc[m] += down_z[m] @ B_down[slot_m, e][:, cols]`` (before the bias and the routing weight); the first
    step from ``prep`` (`down_prep` of down B)."""
    lo, hi = _slot_range(slot)
    if lo <= hi:
        acc = _down_apply(acc, prep, pairs, n0, hidden, down_z_ptr, pool_ptr, RD, RD_PAD, C, BLOCK_N, RUN,
                          DOT_PRECISION)
        for i in tl.static_range(1, STEPS):
            step = down_prep(lo + i * C, slot, expert, n0, hidden, pt_ptr, meta_ptr, inverse_ptr, stride_pt,
                             F_DOWN_B, RD, C, BLOCK_N, RUN, PAGE_SHIFT, RANKED)
            acc = _down_apply(acc, step, pairs, n0, hidden, down_z_ptr, pool_ptr, RD, RD_PAD, C, BLOCK_N, RUN,
                              DOT_PRECISION)
    c0 = _next_slot(slot, tl.minimum(lo + STEPS * C, NONE))  # (lo is NONE in a tile without LoRA pairs)
    while c0 <= hi:
        step = down_prep(c0, slot, expert, n0, hidden, pt_ptr, meta_ptr, inverse_ptr, stride_pt, F_DOWN_B, RD, C,
                         BLOCK_N, RUN, PAGE_SHIFT, RANKED)
        acc = _down_apply(acc, step, pairs, n0, hidden, down_z_ptr, pool_ptr, RD, RD_PAD, C, BLOCK_N, RUN,
                          DOT_PRECISION)
        c0 = _next_slot(slot, c0 + C)
    return acc


# ---------------------------------------------------------------------------------------------
# Launch arguments


FUSED_MODES = {False: "", True: "all", "down": "down"}


def fused_mode(plan) -> str:
    """Which base GEMMs take the plan's LoRA deltas (config key ``"fused"``): ``""`` (false, the
    default: none, the separate pass `fused_moe_lora`), ``"all"`` (true: both GEMMs) or ``"down"``
    (the gate/up side runs the separate pass, which leaves ``down_z``; only the down delta is extra
    K steps of the base down GEMM, so the separate pass's read-modify-write of ``y`` is gone)."""
    if plan is None:
        return ""
    return config_mode(plan.config, plan.topk_ids.shape[0])


def config_mode(config: dict, num_tokens: int) -> str:
    """`fused_mode` of a "lora" launch config at a step of ``num_tokens`` tokens: its ``"fused"`` value's
    mode for a step of at least ``"fused_min_tokens"`` tokens (default 0), else ``""`` (Qwen3-30B-A3B's
    H200 entry past load 22.6 fuses from 2,048 tokens: at 1,024 tokens of one adapter, the same load,
    the separate pass was faster)."""
    value = config.get("fused", False)
    if type(value) not in (bool, str) or value not in FUSED_MODES:
        raise ValueError(f'lora config "fused" must be false, true or "down", got {value!r}')
    width = config.get("lora_k", 64)
    if type(width) is not int or width < 16 or width & (width - 1):
        raise ValueError(f'lora config "lora_k" must be a power of two >= 16, got {width!r}')
    least = config.get("fused_min_tokens", 0)
    if type(least) is not int or least < 0:
        raise ValueError(f'lora config "fused_min_tokens" must be an int >= 0, got {least!r}')
    return FUSED_MODES[value] if num_tokens >= least else ""


BASE_STAGE_KEYS = ("block_n", "block_k", "group_m", "num_warps", "num_stages", "tma", "maxnreg")


def fused_base(base: dict, plan, mode: str) -> dict:
    """The base launch config ``base`` with the fused path's own GEMM settings (config ``"fused_base"``:
    ``{"gate_up": {...}, "down": {...}}``, launch settings of `BASE_STAGE_KEYS` merged into that stage) for
    the GEMMs `fused_mode` ``mode`` fuses: both ("all"), or the down GEMM alone ("down", whose gate/up GEMM
    runs for the separate pass).
    E.g. ``{"gate_up": {"maxnreg": 128}}``: the LoRA epilogue would take the gate/up GEMM from 128 to 186
    registers a thread (Qwen3-30B-A3B's decode tile on sm_90), one program an SM instead of two; capped (no
    spills), the decode mix (256 tokens, 4 adapters, H200) took 409.5 against 452.4 us, still behind the
    separate pass's 367.6, so no tuned entry sets it."""
    extra = plan.config.get("fused_base", {})
    if not isinstance(extra, dict) or not set(extra) <= {"gate_up", "down"}:
        raise ValueError(f'lora config "fused_base" must map "gate_up" / "down" to launch settings, got {extra!r}')
    out = dict(base)
    for stage, settings in extra.items():
        if not isinstance(settings, dict) or not set(settings) <= set(BASE_STAGE_KEYS):
            raise ValueError(f'lora config "fused_base.{stage}" takes keys of {BASE_STAGE_KEYS}, got {settings!r}')
        if mode == "all" or stage == "down":
            out[stage] = {**base[stage], **settings}
    return out


def down_shrink_in_epilogue(plan) -> bool:
    """Config ``"down_shrink"``: "pass" (default: `fused_moe_lora.moe_lora_down_shrink`, a grouped pass
    over ``act`` between the GEMMs) or "epilogue" (the gate/up GEMM's epilogue, atomics: slower on an
    H100, 472 against 415 us over the base at Qwen3-30B-A3B's 4096 tokens)."""
    mode = plan.config.get("down_shrink", "pass")
    if mode not in ("epilogue", "pass"):
        raise ValueError(f'lora config "down_shrink" must be "epilogue" or "pass", got {mode!r}')
    return mode == "epilogue"


def gemm_args(plan, gated: bool, block_n: int) -> tuple[tuple, dict]:
    """``(args, constexprs)`` of `fused_moe._moe_gemm_kernel`'s fused LoRA for ``plan``
    (`moe_lora_plan.MoeLoraPlan`, whose shrink has run): ``args`` = (z, down_z, pool, page table, metadata,
    the slots' ranks and the ranks' slots (``plan.ranks``, or the metadata in their place without RANKED),
    top_k, the bound on the step's slots, page-table row stride).  Config ``"lora_k"`` (default 64, a power of two
    >= 16): the extra K of one step, so a step holds C = ``lora_k // RK`` slot ids (at least ``16 // RK``,
    the dot's minimum), RK being the gate/up ranks' power of two in the gate/up GEMM, the down rank's (RD)
    in the down GEMM (`tile_ranks`: the dot's K is the whole step, so a rank-8 row block needs no padding
    to 16); the gate/up GEMM's epilogue down shrink takes its own count by RD (``DOWN_SLOTS``);
    ``"lora_steps"`` (default 2): the steps unrolled (`gate_up_delta`; 0 counts as 1, since the first
    step's addressing runs before the main K loop)."""
    from unipage.kernels.fused_moe_lora import _chunk
    from unipage.kernels.moe_lora_plan import _split_k, lora_pads, tile_ranks

    lora, meta = plan.lora, plan.lora.meta
    r_pad, _, rd_pad = lora_pads(meta)
    rk, rd = tile_ranks(meta, 1)
    splits, _ = _split_k(meta.hidden, plan.config["split_k"])
    width, steps = plan.config.get("lora_k", 64), plan.config.get("lora_steps", 2)
    if "chunks" in plan.config:
        raise ValueError('lora config "chunks" was removed: steps now cover consecutive slot ids (see "lora_steps")')
    if type(steps) is not int or not 0 <= steps <= MAX_STEPS:
        raise ValueError(f'lora config "lora_steps" must be an int in [0, {MAX_STEPS}], got {steps!r}')
    rows = rk if gated else rd
    slots, down_slots = max(width // rows, 16 // rows, 1), max(width // rd, 16 // rd, 1)  # (each dot spans >= 16)
    ranks = plan.ranks
    ids = ranks if ranks is not None else (meta.table, meta.table)  # (not read without RANKED)
    args = (plan.gate_up_z if gated else plan.down_z, plan.down_z, lora.pool, lora.page_table, meta.table, *ids,
            plan.topk_ids.shape[1], lora.active_slots or 0, lora.page_table.stride(0))
    constexprs = {"FUSED": True, "RANKED": ranks is not None, "R_PAD": r_pad if gated else rd_pad, "RK": rk,
                  "RD": rd, "RD_PAD": rd_pad,
                  "SPLIT_K": splits, "CHUNK_SLOTS": slots, "DOWN_SLOTS": down_slots,
                  "STEPS": max(steps, 1),  # (the first: `gate_up_prep`, before the main loop)
                  "RUN": min(block_n, _chunk(meta.inter) if gated else 64),
                  "PAGE_SHIFT": lora.pool.shape[1].bit_length() - 1, "DOWN_SHRINK": down_shrink_in_epilogue(plan)}
    return args, constexprs
