"""Write random LoRA adapters as real PEFT directories.

For demos, benchmarks and the simulator's examples, where installing `peft`
and building a full model just to save an adapter would be heavy.  The files
are what `peft` itself writes (``adapter_config.json`` and
``adapter_model.safetensors`` with ``base_model.model.`` keys; B stored
``[d_out, r]``), so they load through the same path as any trained adapter —
`unipage.peft_io` — and PEFT loads them too (checked in the tests).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from unipage.config import ATTENTION_TARGETS, DENSE_MLP_TARGETS, ModelConfig

EXPERT_FORMATS = ("per_expert", "fused")


def _pair(gen: torch.Generator, rows: int, d_in: int, d_out: int, cols: int, std: float):
    a = torch.randn(rows, d_in, generator=gen) * std
    b = torch.randn(d_out, cols, generator=gen) * std
    return a, b


def _layer_tensors(model: ModelConfig, layer: int, targets, rank: int, expert_format: str,
                   gen: torch.Generator, std: float) -> dict[str, torch.Tensor]:
    out = {}
    prefix = f"base_model.model.model.layers.{layer}"
    for target in targets:
        if target in model.targets(layer) and target in ATTENTION_TARGETS + DENSE_MLP_TARGETS:
            d_in, d_out = model.target_dims(target, layer)
            group = "self_attn" if target in ATTENTION_TARGETS else "mlp"
            a, b = _pair(gen, rank, d_in, d_out, rank, std)
            out[f"{prefix}.{group}.{target}.lora_A.weight"] = a
            out[f"{prefix}.{group}.{target}.lora_B.weight"] = b
    if "experts" in targets and model.is_moe_layer(layer):
        write = _fused_experts if expert_format == "fused" else _per_expert
        out.update(write(model, layer, prefix, rank, gen, std))
    return out


def _per_expert(model: ModelConfig, layer: int, prefix: str, rank: int, gen, std: float) -> dict:
    h, i = model.hidden_size, model.expert_intermediate_size
    out = {}
    for e in range(model.num_experts):
        for proj, (d_in, d_out) in (("gate_proj", (h, i)), ("up_proj", (h, i)), ("down_proj", (i, h))):
            a, b = _pair(gen, rank, d_in, d_out, rank, std)
            out[f"{prefix}.mlp.experts.{e}.{proj}.lora_A.weight"] = a
            out[f"{prefix}.mlp.experts.{e}.{proj}.lora_B.weight"] = b
    return out


def _fused_experts(model: ModelConfig, layer: int, prefix: str, rank: int, gen, std: float) -> dict:
    """Both 3D parameters targeted: gate_up is the inner wrapper (``base_layer``), down the outer."""
    h, i, n = model.hidden_size, model.expert_intermediate_size, model.num_experts * rank
    out = {}
    for where, (d_in, d_out) in (("mlp.experts.base_layer", (h, 2 * i)), ("mlp.experts", (i, h))):
        a, b = _pair(gen, n, d_in, d_out, n, std)
        out[f"{prefix}.{where}.lora_A.weight"] = a
        out[f"{prefix}.{where}.lora_B.weight"] = b
    return out


def _config(targets, rank: int, alpha: float, use_rslora: bool, expert_format: str) -> dict:
    modules = [t for t in targets if t != "experts"]
    params = []
    if "experts" in targets:
        if expert_format == "fused":
            params = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        else:
            modules += [m for m in DENSE_MLP_TARGETS if m not in modules]
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "use_rslora": use_rslora, "target_modules": sorted(modules), "target_parameters": params or None,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "rank_pattern": {}, "alpha_pattern": {}, "base_model_name_or_path": None,
    }


def write_random_adapter(path: str | os.PathLike, model: ModelConfig, *, rank: int, alpha: float,
                         targets=ATTENTION_TARGETS + ("experts",), expert_format: str = "per_expert",
                         use_rslora: bool = False, seed: int = 0, std: float = 0.05,
                         dtype: torch.dtype = torch.float32) -> str:
    """Save a random rank-``rank`` LoRA for ``model`` in PEFT's format; returns the directory.

    ``targets``: attention/dense names (``q_proj`` .. ``down_proj``) and
    ``"experts"`` for every expert of every MoE layer, per-expert modules or
    the fused 3D parameters (``expert_format``).
    """
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"expert_format must be one of {EXPERT_FORMATS}, got {expert_format!r}")
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model.num_layers):
        tensors.update(_layer_tensors(model, layer, tuple(targets), rank, expert_format, gen, std))
    os.makedirs(path, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()},
              os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(_config(tuple(targets), rank, alpha, use_rslora, expert_format), f, indent=2)
    return os.fspath(path)
