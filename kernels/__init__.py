"""Triton kernels over the unified pool, each beside a torch reference with the same signature.

See docs/design.md ("Kernels") and each module's docstring for shapes and math.
"""

from unipage.kernels.attention import AttentionConfig, paged_attention_decode, paged_attention_prefill
from unipage.kernels.attention_ref import paged_attention_decode_ref, paged_attention_prefill_ref
from unipage.kernels.elementwise import (add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref, rope_qk,
                                         rope_qk_ref, silu_mul, silu_mul_ref)
from unipage.kernels.fused_moe import (fused_experts, fused_experts_ref, fused_moe, fused_moe_ref, moe_down,
                                       moe_down_ref, moe_gate_up, moe_gate_up_ref, route_topk, route_topk_ref)
from unipage.kernels.fused_moe_lora import (MoeLora, MoeLoraMeta, MoeLoraPlan, moe_lora_down, moe_lora_down_ref,
                                            moe_lora_gate_up, moe_lora_gate_up_ref, moe_lora_meta, plan_moe_lora,
                                            plan_moe_lora_ref)
from unipage.kernels.kv_write import rope_write_kv, rope_write_kv_ref, write_kv, write_kv_ref
from unipage.kernels.lora import (LoraShrink, LoraShrinkRef, lora_expand, lora_expand_ref, lora_shrink, lora_shrink_expand,
                                  lora_shrink_expand_ref, lora_shrink_ref)
from unipage.kernels.lora_linear import linear_lora, linear_lora_ref
from unipage.kernels.lora_stack import fill_entry, fill_entry_ref, lora_expand_stacked, lora_expand_stacked_ref
from unipage.kernels.lora_silu import lora_silu_mul, lora_silu_mul_ref
from unipage.kernels.skinny import skinny_linear, skinny_linear_ref
from unipage.kernels.lora_meta import DenseLoraMeta, LoraBatch, dense_lora_meta, plan_block_m, plan_lora_batch

__all__ = [
    "AttentionConfig", "paged_attention_decode", "paged_attention_decode_ref", "paged_attention_prefill",
    "paged_attention_prefill_ref", "write_kv", "write_kv_ref", "rope_write_kv", "rope_write_kv_ref",
    "lora_shrink_expand", "lora_shrink_expand_ref", "LoraShrink", "LoraShrinkRef", "lora_shrink", "lora_shrink_ref",
    "lora_expand", "lora_expand_ref", "linear_lora", "linear_lora_ref", "lora_silu_mul", "lora_silu_mul_ref",
    "lora_expand_stacked", "lora_expand_stacked_ref", "fill_entry", "fill_entry_ref",
    "DenseLoraMeta", "LoraBatch",
    "dense_lora_meta", "plan_block_m", "plan_lora_batch",
    "fused_experts", "fused_experts_ref", "fused_moe", "fused_moe_ref", "moe_down", "moe_down_ref", "moe_gate_up",
    "moe_gate_up_ref", "route_topk", "route_topk_ref", "MoeLora", "MoeLoraMeta", "MoeLoraPlan", "moe_lora_down",
    "moe_lora_down_ref", "moe_lora_gate_up", "moe_lora_gate_up_ref", "moe_lora_meta", "plan_moe_lora",
    "plan_moe_lora_ref",
    "skinny_linear", "skinny_linear_ref",
    "rms_norm", "rms_norm_ref", "add_rms_norm", "add_rms_norm_ref", "rope_qk", "rope_qk_ref", "silu_mul",
    "silu_mul_ref",
]
