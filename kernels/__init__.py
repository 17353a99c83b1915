"""Triton kernels over the unified pool, each beside a torch reference with the same signature.

See docs/design.md ("Kernels") and each module's docstring for shapes and math.
"""

from unipage.kernels.attention import (AttentionConfig, paged_attention_decode, paged_attention_decode_ref,
                                       paged_attention_prefill, paged_attention_prefill_ref)
from unipage.kernels.kv_write import write_kv, write_kv_ref
from unipage.kernels.lora import lora_shrink_expand, lora_shrink_expand_ref
from unipage.kernels.lora_meta import DenseLoraMeta, LoraBatch, dense_lora_meta, plan_lora_batch

__all__ = [
    "AttentionConfig", "paged_attention_decode", "paged_attention_decode_ref", "paged_attention_prefill",
    "paged_attention_prefill_ref", "write_kv", "write_kv_ref",
    "lora_shrink_expand", "lora_shrink_expand_ref", "DenseLoraMeta", "LoraBatch", "dense_lora_meta",
    "plan_lora_batch",
]
