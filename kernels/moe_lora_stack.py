"""Expert LoRA from dense stacks: the step's adapters' MoE LoRA weights gathered out of the pool's
pages into four dense tensors per layer, which the base expert GEMMs take as an extra K block.

Shape legend as `fused_moe`; M = the stack's entries (one adapter slot each), RE = gate/up A rows
per entry, RD = down rank per entry (powers of two), LE / LD = M·RE / M·RD rounded up to a multiple
of 16 (the tensor cores' K step).

The paged LoRA kernels (`fused_moe_lora`, `moe_lora_fused`) find every pair's weights through
its slot's metadata and page table: a chain of dependent loads per program or tile, and a
block-sparse operand built per tile.  A stack lays the weights out as the base GEMMs'
weights are, so the LoRA is three more plain grouped GEMMs' worth of work::

    a_gu [E, LE, H]   row m·RE + i: entry m's gate/up A row i (zero past its rows)
    b_gu [E, 2I, LE]  column m·RE + i: entry m's B entries for A row i (each slice at its columns)
    a_d  [E, LD, I]   row m·RD + r: entry m's down A row r
    b_d  [E, H, LD]   column m·RD + r: entry m's down B row r

    z      = x @ a_gu[e].T                     every entry's shrink, rounded    [TK, LE]
    h      = x @ W_gu[e].T + own(z) @ b_gu[e].T   (one more K block of the GEMM)  [TK, 2I]
    dz     = act @ a_d[e].T                    rounded                           [TK, LD]
    y      = w · (act @ W_d[e].T + own(dz) @ b_d[e].T)

where ``own`` keeps a pair's columns of its token's entry (``entry_of_slot``) and zeroes the
rest, so a token without an adapter, or whose slot has no entry, gets no delta.  z and dz are
rounded to the model dtype before their dots, as in the paged kernels; the deltas go into the
float32 accumulators before the activation or the weight, as in the fused paged path (the separate
paged pass adds them to the base GEMMs' rounded outputs, so bf16 results of the two differ by that).

`build_stack` makes a layer's stack for given slots from the pool (`fill_entry` per slot: the slot's
expert groups of the layer gathered by page once, then strided copies).  `experts` runs the MoE with it
(`fused_moe.fused_experts`'s ``stack``).  The GEMMs' extra block is `ext_delta`, called by
`fused_moe._moe_gemm_kernel` (EXT).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from unipage.kernels.common import next_pow2
from unipage.kernels.moe_align import FIELDS
from unipage.lora_layout import round_up

CHUNK = tl.constexpr(64)  # columns of the extra K block per dot (wider blocks need more shared memory)


@dataclass(frozen=True)
class MoeLoraStack:
    """One layer's stacked expert LoRA: entry m holds the slot ``s`` with ``entry_of_slot[s] == m``."""

    a_gu: torch.Tensor  # [E, LE, H]
    b_gu: torch.Tensor  # [E, 2I, LE]
    a_d: torch.Tensor  # [E, LD, I]
    b_d: torch.Tensor  # [E, H, LD]
    entry_of_slot: torch.Tensor  # [rows] int32: a slot's entry, -1 if it has none (a row for every token's slot)
    gate_up_rows: int  # RE
    down_rows: int  # RD


@dataclass(frozen=True)
class Ext:
    """The extra K block of one grouped GEMM: ``a`` [TK, L] (rows = pairs) masked to each pair's entry,
    times ``w`` [E, W_rows, L] (the GEMM's weight rows, K = L)."""

    a: torch.Tensor
    w: torch.Tensor
    entry_of_slot: torch.Tensor  # [rows] int32 (a row for every token's slot)
    token_slots: torch.Tensor  # [T] int32, -1 = no adapter
    rows: int  # columns of ``a`` per entry
    top_k: int  # pairs per token (pair p is token p // top_k's)

    def own(self) -> torch.Tensor:
        """``a`` in float32 with every column outside each pair's entry zeroed (the torch side of
        `ext_delta`)."""
        slot = self.token_slots.long().repeat_interleave(self.top_k)
        entry = torch.where(slot >= 0, self.entry_of_slot.long()[slot.clamp(min=0)], -1)
        cols = torch.arange(self.a.shape[1], device=self.a.device) // self.rows
        return self.a.float() * (cols[None, :] == entry[:, None])


def empty_stack(entries: int, experts: int, hidden: int, inter: int, gate_up_rows: int, down_rank: int,
                entry_of_slot: torch.Tensor, dtype: torch.dtype) -> MoeLoraStack:
    """A zeroed stack of ``entries`` entries for adapters of at most ``gate_up_rows`` gate/up A rows and down
    rank ``down_rank`` (each rounded up to a power of two), on ``entry_of_slot``'s device."""
    re, rd = next_pow2(max(gate_up_rows, 1)), next_pow2(max(down_rank, 1))
    le, ld = round_up(max(entries * re, 16), 16), round_up(max(entries * rd, 16), 16)
    like = {"dtype": dtype, "device": entry_of_slot.device}
    return MoeLoraStack(torch.zeros(experts, le, hidden, **like), torch.zeros(experts, 2 * inter, le, **like),
                        torch.zeros(experts, ld, inter, **like), torch.zeros(experts, hidden, ld, **like),
                        entry_of_slot, re, rd)


def fill_entry(stack: MoeLoraStack, entry: int, pool_l: torch.Tensor, pages: torch.Tensor, fields: dict) -> None:
    """Copy one slot's expert LoRA of this layer into ``entry`` (zeros where it has none): ``pool_l`` [N, P] the
    pool layer, ``pages`` [n] int64 the slot's page ids (device), ``fields`` its `moe_align.FIELDS` here."""
    re, rd = stack.gate_up_rows, stack.down_rows
    rows_gu, rows_d = slice(entry * re, (entry + 1) * re), slice(entry * rd, (entry + 1) * rd)
    for t in (stack.a_gu[:, rows_gu], stack.b_gu[:, :, rows_gu], stack.a_d[:, rows_d], stack.b_d[:, :, rows_d]):
        t.zero_()
    if not (fields["gu_rows"] or fields["down_rank"]):
        return
    if fields["gu_rows"] > re or fields["down_rank"] > rd:
        raise ValueError(f"an adapter with {fields['gu_rows']} gate/up A rows and down rank {fields['down_rank']} "
                         f"does not fit the stack's {re} and {rd}")
    experts, hidden, inter = stack.a_gu.shape[0], stack.a_gu.shape[2], stack.a_d.shape[2]
    read = _region(pool_l, pages, fields, experts)
    base = entry * re
    if fields["gu_rows"]:
        stack.a_gu[:, base: base + fields["gu_rows"]] = read(fields["gu_a"], fields["gu_rows"], hidden)
        for j in range(fields["gu_slices"]):
            a_row, rank, b, col, ncols = (fields[f"s{j}_{n}"] for n in ("a_row", "rank", "b", "col", "ncols"))
            if rank:
                rows = slice(base + a_row, base + a_row + rank)
                stack.b_gu[:, col: col + ncols, rows] = read(b, rank, ncols).transpose(1, 2)
    rank, base = fields["down_rank"], entry * rd
    if rank:
        stack.a_d[:, base: base + rank] = read(fields["down_a"], rank, inter)
        stack.b_d[:, :, base: base + rank] = read(fields["down_b"], rank, hidden).transpose(1, 2)


def _region(pool_l: torch.Tensor, pages: torch.Tensor, fields: dict, experts: int):
    """``read(offset, rows, cols) -> [E, rows, cols]``: a matrix of every expert group of the slot (rows 64-aligned,
    one virtual range per expert), as views of its expert groups' pages gathered once."""
    page_elems = pool_l.shape[1]
    start, stride = fields["expert_base"], fields["expert_stride"]
    first, last = start // page_elems, (start + experts * stride - 1) // page_elems
    flat = pool_l[pages[first: last + 1]].reshape(-1)
    at = start - first * page_elems

    def read(offset: int, rows: int, cols: int) -> torch.Tensor:
        return flat.as_strided((experts, rows, cols), (stride, round_up(cols), 1), at + offset)
    return read


def build_stack(lora, slots: Sequence[int]) -> MoeLoraStack:
    """Gather the expert LoRA of ``slots`` (distinct, each < S; entry m = ``slots[m]``) out of ``lora``'s pool
    layer (a `fused_moe_lora.MoeLora`) into a new `MoeLoraStack`; slots without expert LoRA here get zeros."""
    meta, slots = lora.meta, [int(s) for s in slots]
    num_slots = meta.table.shape[0]
    if len(set(slots)) != len(slots) or not all(0 <= s < num_slots for s in slots):
        raise ValueError(f"slots must be distinct ids in [0, {num_slots}), got {slots}")
    entry_of_slot = torch.full((num_slots,), -1, dtype=torch.int32)
    entry_of_slot[slots] = torch.arange(len(slots), dtype=torch.int32)
    stack = empty_stack(len(slots), meta.num_experts, meta.hidden, meta.inter, meta.max_gate_up_rows,
                        meta.max_down_rank, entry_of_slot.to(lora.pool.device), lora.pool.dtype)
    table = meta.table.tolist()
    for m, slot in enumerate(slots):
        fill_entry(stack, m, lora.pool, lora.page_table[slot].long(), dict(zip(FIELDS, table[slot])))
    return stack


def check_stack(stack: MoeLoraStack, lora, x: torch.Tensor) -> None:
    """The stack must be of ``lora``'s layer shapes, in ``x``'s dtype and on its device."""
    meta = lora.meta
    want = {"a_gu": (meta.num_experts, None, meta.hidden), "b_gu": (meta.num_experts, 2 * meta.inter, None),
            "a_d": (meta.num_experts, None, meta.inter), "b_d": (meta.num_experts, meta.hidden, None)}
    for name, shape in want.items():
        t = getattr(stack, name)
        if t.dim() != 3 or any(w is not None and w != n for w, n in zip(shape, t.shape)) \
                or t.dtype != x.dtype or t.device != x.device or not t.is_contiguous():
            raise ValueError(f"stack.{name} must be contiguous {list(shape)} (None: any) {x.dtype} on {x.device}, "
                             f"got {list(t.shape)} {t.dtype} on {t.device}")
    if stack.entry_of_slot.dim() != 1 or stack.entry_of_slot.dtype != torch.int32 \
            or stack.entry_of_slot.device != x.device:
        raise ValueError(f"stack.entry_of_slot must be 1-D int32 on {x.device} (a row for every token's slot)")


def _check_covered(stack: MoeLoraStack, lora) -> None:
    """On CPU tensors: every token whose slot has expert LoRA here has an entry (a token without one would get
    no delta; on a GPU the check would cost a host sync, and the engine stacks a step's own slots)."""
    slots = lora.token_slots
    if slots.device.type != "cpu":
        return
    if slots.numel() and int(slots.max()) >= stack.entry_of_slot.shape[0]:
        raise ValueError(f"token slot {int(slots.max())} has no row in the stack's entry_of_slot "
                         f"({stack.entry_of_slot.shape[0]} rows)")
    has = slots[slots >= 0].long()
    has = has[lora.meta.slot_flags.long()[has] != 0]
    missing = sorted(set(has[stack.entry_of_slot.long()[has] < 0].tolist()))
    if missing:
        raise ValueError(f"the tokens' slots {missing} have expert LoRA but no entry in the stack")


def shrink_configs(cfg: dict) -> tuple[dict, dict]:
    """The two shrinks' launch settings (gate/up, down) for a base entry ``cfg``: its ``"stack"`` ones where
    tuned, else its GEMMs'."""
    tuned = cfg.get("stack", {})
    return tuned.get("gate_up", cfg["gate_up"]), tuned.get("down", cfg["down"])


def experts(ops, x, w_gate_up, w_down, topk_weights, topk_ids, lora, stack: MoeLoraStack, cfg: dict,
            gate_up_bias=None, down_bias=None, activation=None) -> torch.Tensor:
    """The routed experts with ``stack``'s LoRA (``ops``: `fused_moe`'s Triton or torch stages)."""
    check_stack(stack, lora, x)
    _check_covered(stack, lora)
    num_pairs, inter, top_k = topk_ids.numel(), w_gate_up.shape[1] // 2, topk_ids.shape[1]
    align = ops.align(topk_ids, w_gate_up.shape[0], cfg["block_m"])
    gate_up_cfg, down_cfg = shrink_configs(cfg)
    z = torch.empty(num_pairs, stack.a_gu.shape[1], dtype=x.dtype, device=x.device)
    ops.project(x, stack.a_gu, topk_ids, align, z, gate_up_cfg, a_div=top_k)
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    ops.gate_up(x, w_gate_up, topk_ids, align, act, config=cfg, bias=gate_up_bias, activation=activation,
                ext=Ext(z, stack.b_gu, stack.entry_of_slot, lora.token_slots, stack.gate_up_rows, top_k))
    dz = torch.empty(num_pairs, stack.a_d.shape[1], dtype=x.dtype, device=x.device)
    ops.project(act, stack.a_d, topk_ids, align, dz, down_cfg, a_div=1)
    y = torch.empty(num_pairs, w_down.shape[1], dtype=x.dtype, device=x.device)
    ops.down(act, w_down, topk_ids, topk_weights, align, y, cfg, bias=down_bias,
             ext=Ext(dz, stack.b_d, stack.entry_of_slot, lora.token_slots, stack.down_rows, top_k))
    return y.view(topk_ids.shape[0], top_k, -1).sum(dim=1)


# ---------------------------------------------------------------------------------------------
# Device side: the GEMMs' extra K block


@triton.jit
def ext_delta(acc, acc_up, ext_a_ptr, ext_w_ptr, entry_ptr, slots_ptr, pairs, pair_ok, top_k, expert, cols, N,
              stride_ea, stride_ewe, GATED: tl.constexpr, EXT_K: tl.constexpr, EXT_L: tl.constexpr,
              EXT_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``acc (+)= own(ext_a[pairs]) @ ext_w[expert, cols].T`` (and ``acc_up`` from rows ``N + cols``) over the
    block's EXT_L columns (EXT_K: their power of two), in chunks of at most `CHUNK` columns; a chunk none of
    whose entries a pair of the tile has is skipped (its weights are not read).  Column j is entry
    ``j // EXT_ROWS``'s; a pair takes its token's entry's columns, zeros elsewhere."""
    slot = tl.load(slots_ptr + tl.where(pair_ok, pairs // top_k, 0), mask=pair_ok, other=-1)
    entry = tl.load(entry_ptr + tl.maximum(slot, 0), mask=slot >= 0, other=-1)
    lo = tl.min(tl.where(entry >= 0, entry, 1 << 30), 0)
    hi = tl.max(entry, 0)
    CH: tl.constexpr = CHUNK if EXT_K > CHUNK else EXT_K
    for c in tl.static_range((EXT_L + CH - 1) // CH):
        if (hi >= c * CH // EXT_ROWS) & (lo <= ((c + 1) * CH - 1) // EXT_ROWS):
            j = c * CH + tl.arange(0, CH)
            own = pair_ok[:, None] & ((j // EXT_ROWS)[None, :] == entry[:, None]) & (j < EXT_L)[None, :]
            a = tl.load(ext_a_ptr + pairs[:, None].to(tl.int64) * stride_ea + j[None, :], mask=own, other=0.0)
            ok = (cols < N)[None, :] & (j < EXT_L)[:, None]
            w = ext_w_ptr + expert.to(tl.int64) * stride_ewe + cols[None, :] * EXT_L + j[:, None]  # [CH, BN]
            acc = tl.dot(a, tl.load(w, mask=ok, other=0.0), acc, input_precision=DOT_PRECISION)
            if GATED:
                acc_up = tl.dot(a, tl.load(w + N * EXT_L, mask=ok, other=0.0), acc_up,
                                input_precision=DOT_PRECISION)
    return acc, acc_up
