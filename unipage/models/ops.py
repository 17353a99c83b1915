"""The kernel set a model runs on, chosen by device.

CPU: the torch references (`*_ref`), which are also the kernels' test
oracles.  CUDA: the Triton kernels.  Both sets have the same signatures, so
the model code is one path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from unipage import kernels as K
from unipage.kernels import skinny


@dataclass(frozen=True)
class Ops:
    name: str  # "torch" or "triton"
    lora_shrink: Callable  # the dense LoRA shrink (lora_shrink signature), for:
    lora_silu_mul: Callable  # (gate_up, shrunk) -> silu(gate) * up of gate_up plus its LoRA delta
    linear_lora: Callable  # linear_lora signature: x @ w.T (+ bias) plus its LoRA delta
    attention_prefill: Callable
    attention_decode: Callable | None  # None: decode batches go through attention_prefill
    route: Callable  # route_topk signature
    experts: Callable  # fused_experts signature
    plans_lora: bool  # whether the LoRA ops use a LoraBatch plan (the references ignore it)
    rms_norm: Callable  # (x, weight, eps) -> normed
    add_rms_norm: Callable  # (h, delta, weight, eps) -> (h + delta, normed)
    rope_write_kv: Callable  # rope_write_kv signature: (q, k, v, cos, sin, pool, slot_mapping) -> q'
    silu_mul: Callable  # (gate_up [T, 2I]) -> silu(gate) * up
    lora_expand_stacked: Callable  # lora_expand_stacked signature: the expand from a shrink stack's h
    fill_entry: Callable  # fill_entry signature: a slot's A rows into a shrink stack's entry
    linear: Callable  # (x, w, bias) -> x @ w.T (+ bias): projections, shrink-stack GEMMs, gate/up, the router


TORCH = Ops("torch", lora_shrink=K.lora_shrink_ref, lora_silu_mul=K.lora_silu_mul_ref,
            linear_lora=K.linear_lora_ref, attention_prefill=K.paged_attention_prefill_ref, attention_decode=None,
            route=K.route_topk_ref, experts=K.fused_experts_ref, plans_lora=False,
            rms_norm=K.rms_norm_ref, add_rms_norm=K.add_rms_norm_ref, rope_write_kv=K.rope_write_kv_ref,
            silu_mul=K.silu_mul_ref, lora_expand_stacked=K.lora_expand_stacked_ref, fill_entry=K.fill_entry_ref,
            linear=F.linear)
TRITON = Ops("triton", lora_shrink=K.lora_shrink, lora_silu_mul=K.lora_silu_mul, linear_lora=K.linear_lora,
             attention_prefill=K.paged_attention_prefill, attention_decode=K.paged_attention_decode,
             route=K.route_topk, experts=K.fused_experts, plans_lora=True,
             rms_norm=K.rms_norm, add_rms_norm=K.add_rms_norm, rope_write_kv=K.rope_write_kv, silu_mul=K.silu_mul,
             lora_expand_stacked=K.lora_expand_stacked, fill_entry=K.fill_entry, linear=skinny.linear)


def ops_for(device: torch.device, kernels: str | None = None) -> Ops:
    """``kernels`` "torch" / "triton" forces a set; default: Triton on CUDA, torch elsewhere."""
    choice = kernels or ("triton" if device.type == "cuda" else "torch")
    if choice not in ("torch", "triton"):
        raise ValueError(f"kernels must be 'torch' or 'triton', got {kernels!r}")
    if choice == "triton" and device.type != "cuda":
        raise ValueError("the Triton kernels need a CUDA device; use kernels='torch' on CPU")
    return TRITON if choice == "triton" else TORCH
