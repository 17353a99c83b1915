"""Slot ranks of a step: where the MoE LoRA alignment groups pairs by the *rank* of their adapter slot among
the step's distinct slots (`moe_align`'s ``active_slots`` below the tables' S), rank ``r`` of slot ``s`` is
how many of the tokens' distinct slots lie below ``s``.  They depend on the tokens' slots alone, so a step
makes them once (`slot_ranks`, one launch) for all its MoE layers (`MoeLora.ranks`); `moe_align` checks
given ones (`check_ranks`) and `ranks_ref` is the torch version.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unipage.kernels.common import next_pow2
from unipage.kernels.launch import launch

SlotRanks = tuple[torch.Tensor, torch.Tensor]  # `slot_ranks`: rank of each slot [S_PAD], slot of each rank [A_PAD]


def check_active_slots(active_slots) -> None:
    if active_slots is not None and (type(active_slots) is not int or active_slots < 0):
        raise ValueError(f"active_slots must be an int >= 0 or None, got {active_slots!r}")


@triton.jit
def _slot_ranks_kernel(slots_ptr, ranks_ptr, inverse_ptr, num_tokens, S_PAD: tl.constexpr, A_PAD: tl.constexpr,
                       BLOCK: tl.constexpr):
    """``ranks[s]``: how many of the tokens' distinct slots are below slot ``s``; ``inverse[r]``: the slot of
    rank ``r`` (0 past the last).  BLOCK tokens at a time against every slot (BLOCK·S_PAD compares)."""
    present = tl.zeros([S_PAD], tl.int32)
    ids = tl.arange(0, S_PAD)
    for start in range(0, num_tokens, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        slot = tl.load(slots_ptr + offs, mask=offs < num_tokens, other=-1)
        present = tl.maximum(present, tl.max((slot[:, None] == ids[None, :]).to(tl.int32), 0))
    rank = tl.cumsum(present, 0) - present
    tl.store(ranks_ptr + ids, rank)
    r = tl.arange(0, A_PAD)  # (an A_PAD x S_PAD match: an MoE model's tables hold tens of slots, not thousands)
    hit = (rank[None, :] == r[:, None]) & (present[None, :] > 0)
    tl.store(inverse_ptr + r, tl.sum(tl.where(hit, ids[None, :], 0), 1))


RANK_COMPARES = 4096  # token-slot compares `_slot_ranks_kernel` holds at once (16 tokens at least)


def slot_ranks(token_slots: torch.Tensor, num_slots: int, active_slots: int | None) -> SlotRanks | None:
    """``(rank of each slot [S_PAD], slot of each rank [A_PAD])`` int32 by `_slot_ranks_kernel` where the
    pairs group by rank (a bound ``active_slots`` > 0 below ``num_slots``); else None.  They depend on the
    tokens' slots alone, so a step computes them once for all its MoE layers (`moe_align`'s ``ranks``)."""
    check_active_slots(active_slots)
    if token_slots.dim() != 1 or token_slots.dtype != torch.int32 or not token_slots.is_contiguous():
        raise ValueError(f"token_slots must be a contiguous [T] int32 tensor, got {tuple(token_slots.shape)} "
                         f"{token_slots.dtype}")
    if type(num_slots) is not int or num_slots < 1:
        raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
    if not active_slots or active_slots >= num_slots:
        return None
    s_pad, a_pad = next_pow2(num_slots), next_pow2(active_slots)
    out = torch.empty(s_pad + a_pad, dtype=torch.int32, device=token_slots.device)
    launch(_slot_ranks_kernel, (1,), token_slots, out, out[s_pad:], token_slots.shape[0], S_PAD=s_pad, A_PAD=a_pad,
           BLOCK=max(16, RANK_COMPARES // s_pad), num_warps=4)
    return out[:s_pad], out[s_pad:]


def check_ranks(ranks: SlotRanks, token_slots: torch.Tensor, num_slots: int, active_slots: int) -> None:
    """Given ranks: `slot_ranks`' shapes, dtype and device; on CPU tensors also its values for these tokens
    (on a GPU that check would cost a host sync: the engine makes them from the step's own tokens)."""
    want = (next_pow2(num_slots), next_pow2(active_slots))
    if len(ranks) != 2 or tuple(r.shape for r in ranks) != tuple((n,) for n in want) \
            or any(r.dtype != torch.int32 or r.device != token_slots.device for r in ranks):
        raise ValueError(f"ranks must be slot_ranks' two int32 tensors of {want[0]} and {want[1]} entries on "
                         f"{token_slots.device}")
    if token_slots.device.type == "cpu":
        rank, inverse = ranks_ref(token_slots, num_slots, active_slots)
        if not (torch.equal(ranks[0][:num_slots].long(), rank) and torch.equal(ranks[1][:active_slots].long(),
                                                                              inverse)):
            raise ValueError("ranks are not slot_ranks of these tokens")


def ranks_ref(token_slots: torch.Tensor, num_slots: int, active_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rank of each slot [S], slot of each rank [A])`` (long), as `_slot_ranks_kernel`."""
    present = torch.zeros(num_slots + 1, dtype=torch.long, device=token_slots.device)
    present[token_slots.long().clamp(min=-1)] = 1  # -1 (no adapter) lands in the extra last entry
    present = present[:num_slots]
    rank = torch.cumsum(present, 0) - present
    hit = (rank[None, :] == torch.arange(active_slots, device=rank.device)[:, None]) & (present[None, :] > 0)
    inverse = (hit.long() * torch.arange(num_slots, device=rank.device)[None, :]).sum(1)
    return rank, inverse


def slot_ranks_ref(token_slots: torch.Tensor, num_slots: int, active_slots: int | None) -> SlotRanks | None:
    """`slot_ranks` computed by `ranks_ref`, in the same padded int32 tensors (CPU callers whose launches do
    not run, as `benchmarks/compile_check.py`'s)."""
    check_active_slots(active_slots)
    if not active_slots or active_slots >= num_slots:
        return None
    rank, inverse = ranks_ref(token_slots, num_slots, active_slots)
    padded = [torch.zeros(next_pow2(n), dtype=torch.int32, device=token_slots.device)
              for n in (num_slots, active_slots)]
    padded[0][:num_slots], padded[1][:active_slots] = rank, inverse
    return padded[0], padded[1]
