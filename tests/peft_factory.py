"""Tiny random base models and PEFT LoRA adapters, saved to a directory, for tests.

Every builder returns an `Adapter`: the saved directory, the live `PeftModel`
(the oracle: its ``lora_A``/``lora_B``, ``scaling`` and ``get_delta_weight``)
and the base model's `ModelConfig`.  Adapters are made with
``init_lora_weights=False`` so A and B are both random, never zero.

Base models (all fp32, hidden 64, 2 layers, 4 heads of 16, 2 KV heads):

* `qwen3_moe_base` — transformers v5 Qwen3-MoE, 4 experts of width 32, fused
  3D expert parameters (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``).
* `llama_base` — dense Llama, MLP width 96.
* `v4_moe_base` — a plain torch module tree named like a transformers v4 MoE
  model (``model.layers.{l}.mlp.experts.{e}.gate_proj``, or Mixtral's
  ``block_sparse_moe.experts.{e}.w1``): transformers v5 has no per-expert
  modules, so per-expert adapters are trained on this.  It has no ``config``,
  so PEFT applies no v4 -> v5 conversion to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from unipage.config import ModelConfig

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


@dataclass
class Adapter:
    path: str  # the saved adapter directory
    peft: PeftModel  # the live model it was saved from
    model: ModelConfig  # the base model's shape


def model_config(hf_config) -> ModelConfig:
    """``ModelConfig.from_hf`` of a transformers config object, in fp32."""
    return ModelConfig.from_hf(hf_config.to_dict(), dtype="float32")


def qwen3_moe_config(**overrides) -> Qwen3MoeConfig:
    kwargs = dict(TINY, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2)
    return Qwen3MoeConfig(**(kwargs | overrides))


def llama_config(**overrides) -> LlamaConfig:
    return LlamaConfig(**(dict(TINY, intermediate_size=96) | overrides))


def qwen3_moe_base(seed: int = 0, **overrides) -> tuple[nn.Module, ModelConfig]:
    config = qwen3_moe_config(**overrides)
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config), model_config(config)


def llama_base(seed: int = 0, **overrides) -> tuple[nn.Module, ModelConfig]:
    config = llama_config(**overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config), model_config(config)


class _Node(nn.Module):
    """A module whose children are given by keyword."""

    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


def _linear(d_in: int, d_out: int) -> nn.Linear:
    return nn.Linear(d_in, d_out, bias=False)


def _v4_layer(hf: Qwen3MoeConfig, style: str) -> nn.Module:
    h, i, q = hf.hidden_size, hf.moe_intermediate_size, hf.num_attention_heads * hf.head_dim
    kv = hf.num_key_value_heads * hf.head_dim
    attn = _Node(q_proj=_linear(h, q), k_proj=_linear(h, kv), v_proj=_linear(h, kv), o_proj=_linear(q, h))
    names = ("gate_proj", "up_proj", "down_proj") if style == "qwen" else ("w1", "w3", "w2")
    experts = nn.ModuleList(
        _Node(**{names[0]: _linear(h, i), names[1]: _linear(h, i), names[2]: _linear(i, h)})
        for _ in range(hf.num_experts))
    moe = _Node(gate=_linear(h, hf.num_experts), experts=experts)
    return _Node(self_attn=attn, **{"mlp" if style == "qwen" else "block_sparse_moe": moe})


def v4_moe_base(style: str = "qwen", seed: int = 0, **overrides) -> tuple[nn.Module, ModelConfig]:
    """A v4-named MoE module tree (``style`` "qwen" or "mixtral") and its ModelConfig.

    Its shapes are those of `qwen3_moe_config(**overrides)`, so an adapter
    trained on it also fits the v5 Qwen3-MoE model of that config.
    """
    hf = qwen3_moe_config(**overrides)
    torch.manual_seed(seed)
    layers = nn.ModuleList(_v4_layer(hf, style) for _ in range(hf.num_hidden_layers))
    return _Node(model=_Node(layers=layers)), model_config(hf)


def make_adapter(directory, base: tuple[nn.Module, ModelConfig], seed: int = 0, dtype=None,
                 **lora_kwargs) -> Adapter:
    """Wrap ``base`` with a random LoRA (``LoraConfig(**lora_kwargs)``) and save it to ``directory``."""
    module, config = base
    torch.manual_seed(seed)
    peft_model = get_peft_model(module, LoraConfig(init_lora_weights=False, **lora_kwargs))
    if dtype is not None:
        peft_model.to(dtype)
    peft_model.save_pretrained(str(directory))
    return Adapter(str(directory), peft_model, config)


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
FUSED_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def fused_moe_adapter(directory, seed: int = 0, **lora_kwargs) -> Adapter:
    """Qwen3-MoE (v5, fused experts): attention + both expert parameters unless overridden."""
    kwargs = dict(r=4, lora_alpha=8, target_modules=ATTENTION, target_parameters=FUSED_EXPERTS)
    base_overrides = lora_kwargs.pop("base", {})
    return make_adapter(directory, qwen3_moe_base(seed, **base_overrides), seed, **(kwargs | lora_kwargs))


def per_expert_adapter(directory, style: str = "qwen", seed: int = 0, **lora_kwargs) -> Adapter:
    """A v4-style per-expert MoE adapter: attention + every expert's gate/up/down unless overridden."""
    projs = ["gate_proj", "up_proj", "down_proj"] if style == "qwen" else ["w1", "w3", "w2"]
    kwargs = dict(r=4, lora_alpha=8, target_modules=ATTENTION + projs)
    return make_adapter(directory, v4_moe_base(style, seed), seed, **(kwargs | lora_kwargs))


def dense_adapter(directory, seed: int = 0, **lora_kwargs) -> Adapter:
    """Dense Llama: every attention and MLP projection unless overridden."""
    kwargs = dict(r=8, lora_alpha=16, target_modules=ATTENTION + ["gate_proj", "up_proj", "down_proj"])
    return make_adapter(directory, llama_base(seed), seed, **(kwargs | lora_kwargs))
