"""LoRA work of the MoE on a side stream, beside the base expert GEMMs (CUDA; the "lora" launch config's
``"overlap": true``).

The base expert GEMMs are bound by bandwidth, the LoRA passes by latency (few pairs per (adapter, expert)
group, a chain of dependent loads per program), so a LoRA pass beside a base GEMM can fill the GEMM's idle
issue slots.  The plan (its alignment by group) and the gate/up shrink need only the routing and ``x``, so
they run beside the base alignment and gate/up GEMM; the expand, which needs the GEMM's ``raw``, runs on the
main stream after the join.  The fused path's gate/up GEMM reads the shrink's z itself, so it joins before
that GEMM, and only the base alignment runs beside (948.6 against 962.9 us a Qwen3 layer at 4,096 tokens of
4 adapters, H200).  (The down delta beside the base down GEMM, into its own zeroed [TK, H] buffer summed
with ``y`` after, was slower at every load measured: the buffer's traffic costs more than the overlap
hides.  See docs/design.md.)

The side stream first waits for everything the main stream queued (`fork`), and the main stream waits for
it (`join`) before it reads what the side wrote.  What the side allocates is used by the main stream only
after that join and freed after it; what the main stream allocated and the side reads is freed only after
the join too, so the caching allocator never hands a block to one stream while the other still uses it.
In graph capture the fork and the join are captured.
"""

from __future__ import annotations

import torch
from unipage.kernels import fused_moe_lora as lora_ops

SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's side stream (high priority: its few small programs are dispatched between the GEMM's,
    not after them)."""
    stream = SIDE_STREAMS.get(device)
    if stream is None:
        stream = SIDE_STREAMS[device] = torch.cuda.Stream(device, priority=-1)
    return stream


def fork(device: torch.device) -> torch.cuda.Stream:
    """The side stream, after everything the main (current) stream has queued."""
    side = side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    return side


def join(device: torch.device) -> None:
    """The main (current) stream waits for everything queued on the side stream."""
    torch.cuda.current_stream(device).wait_stream(side_stream(device))


def lora_plan(ops, lora, topk_ids, x, config) -> tuple[lora_ops.MoeLoraPlan | None, bool]:
    """The layer's LoRA plan (None without LoRA), and whether its gate/up shrink was launched: with the
    "lora" config's ``"overlap": true`` the plan and the shrink go on the side stream, beside the base
    alignment and (separate pass) gate/up GEMM; the caller joins it before the expand, or (the fused path,
    ``"fused": true``, whose gate/up GEMM reads the shrink's z) before that GEMM.  (The fused path's
    ``"down"`` mode runs the separate gate/up pass: it overlaps as that pass does.)"""
    if lora is None or not lora.meta.any_lora:
        return None, False
    cfg = lora_ops.lora_config(lora, topk_ids, config)
    if not (ops.fused and x.is_cuda and cfg.get("overlap")):
        return ops.plan(lora, topk_ids, cfg), False
    try:
        with torch.cuda.stream(fork(x.device)):
            plan = ops.plan(lora, topk_ids, cfg)
            lora_ops.moe_lora_shrink(plan, x)
    except BaseException:  # whatever the side stream was given ends before the caller may free what it reads
        join(x.device)
        raise
    return plan, True
