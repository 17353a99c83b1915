"""Write a random Hugging Face checkpoint (``config.json`` + ``model.safetensors``) without transformers.

For the demo and benchmarks: the files are laid out as transformers writes
them (per-expert keys for MoE layers), so they load through the same
`Checkpoint` path as a real model — and transformers loads them too.
Supported: ``qwen3_moe`` (q/k norm, MoE) and ``llama`` (dense).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from unipage.config import ModelConfig


def _hf_config(model: ModelConfig, kind: str, vocab: int) -> dict:
    config = {
        "architectures": ["Qwen3MoeForCausalLM" if kind == "qwen3_moe" else "LlamaForCausalLM"],
        "model_type": kind, "vocab_size": vocab, "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads, "head_dim": model.head_dim, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "dtype": model.dtype, "hidden_act": "silu",
        "intermediate_size": model.intermediate_size or 4 * model.hidden_size,
    }
    if kind == "qwen3_moe":
        config.update(num_experts=model.num_experts, num_experts_per_tok=model.top_k, norm_topk_prob=True,
                      moe_intermediate_size=model.expert_intermediate_size, decoder_sparse_step=1,
                      mlp_only_layers=list(model.mlp_only_layers))
    return config


def _layer(model: ModelConfig, i: int, kind: str, rand) -> dict[str, torch.Tensor]:
    h, d = model.hidden_size, model.head_dim
    q, kv, p = model.num_heads * d, model.num_kv_heads * d, f"model.layers.{i}"
    out = {f"{p}.input_layernorm.weight": 1 + rand(h) * 0.1, f"{p}.post_attention_layernorm.weight": 1 + rand(h) * 0.1,
           f"{p}.self_attn.q_proj.weight": rand(q, h), f"{p}.self_attn.k_proj.weight": rand(kv, h),
           f"{p}.self_attn.v_proj.weight": rand(kv, h), f"{p}.self_attn.o_proj.weight": rand(h, q)}
    if kind == "qwen3_moe":
        out |= {f"{p}.self_attn.q_norm.weight": 1 + rand(d) * 0.1, f"{p}.self_attn.k_norm.weight": 1 + rand(d) * 0.1}
    if model.is_moe_layer(i):
        inter = model.expert_intermediate_size
        out[f"{p}.mlp.gate.weight"] = rand(model.num_experts, h)
        for e in range(model.num_experts):
            out |= {f"{p}.mlp.experts.{e}.gate_proj.weight": rand(inter, h),
                    f"{p}.mlp.experts.{e}.up_proj.weight": rand(inter, h),
                    f"{p}.mlp.experts.{e}.down_proj.weight": rand(h, inter)}
    else:
        inter = model.intermediate_size
        out |= {f"{p}.mlp.gate_proj.weight": rand(inter, h), f"{p}.mlp.up_proj.weight": rand(inter, h),
                f"{p}.mlp.down_proj.weight": rand(h, inter)}
    return out


def write_random_checkpoint(path: str | os.PathLike, model: ModelConfig, *, vocab: int = 512, seed: int = 0,
                            std: float = 0.05) -> str:
    """Save a random model of shape ``model`` (MoE: ``qwen3_moe``, dense: ``llama``); returns the directory."""
    kind = "qwen3_moe" if model.num_experts else "llama"
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, model.dtype)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    tensors = {"model.embed_tokens.weight": rand(vocab, model.hidden_size) * 20,
               "model.norm.weight": 1 + rand(model.hidden_size) * 0.1,
               "lm_head.weight": rand(vocab, model.hidden_size)}
    for i in range(model.num_layers):
        tensors |= _layer(model, i, kind, rand)
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(_hf_config(model, kind, vocab), f, indent=1)
    return os.fspath(path)
