"""Random weights at a checkpoint's shapes, made on the device (``load_format="dummy"``).

For benchmarks at real model shapes without the files: a directory with only
``config.json`` is enough.  `DummyCheckpoint` answers the same calls as
`unipage.models.weights.Checkpoint`; every tensor is drawn from a normal
distribution (std 0.02, norms 1 + noise) by a seeded generator on the target
device, so a 20B-parameter model appears in seconds and never touches the
host.  Which optional tensors exist follows the config: q/k/v biases for
Qwen2 and wherever ``attention_bias`` is set, an o bias where
``attention_bias`` is set, a separate ``lm_head`` unless the embeddings are tied.
"""

from __future__ import annotations

import torch

STD = 0.02


class DummyCheckpoint:
    """Random tensors by name and shape; the `Checkpoint` interface the model loader uses."""

    def __init__(self, hf: dict, dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
        self.model_dir, self.dtype, self.device = "<dummy>", dtype, device
        self.hf = hf
        self._gen = torch.Generator(device=device)
        self._gen.manual_seed(seed)

    def __contains__(self, name: str) -> bool:
        if name == "lm_head.weight":
            return not self.hf.get("tie_word_embeddings", False)
        if name.endswith("_proj.bias") and ".self_attn." in name:
            qkv_bias = self.hf["model_type"] == "qwen2" and not name.endswith("o_proj.bias")
            return qkv_bias or bool(self.hf.get("attention_bias", False))
        return True

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if shape is None:
            raise ValueError(f"a dummy checkpoint needs the shape of {name!r}")
        out = torch.empty(shape, dtype=self.dtype, device=self.device)
        if name.endswith("norm.weight"):
            return out.normal_(1.0, 0.1, generator=self._gen)
        return out.normal_(0.0, STD, generator=self._gen)

    def optional(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor | None:
        if name not in self:
            return None
        if shape is None:  # q/k/v biases are asked for without a shape: their width is the projection's
            shape = (self._bias_width(name),)
        return self.get(name, shape)

    def expert_weights(self, layer_prefix: str, num_experts: int, hidden: int,
                       inter: int) -> tuple[str, torch.Tensor, torch.Tensor]:
        style = "block_sparse_moe" if self.hf["model_type"] == "mixtral" else "mlp"
        prefix = f"{layer_prefix}.{style}"
        return (prefix, self.get(f"{prefix}.experts.gate_up_proj", (num_experts, 2 * inter, hidden)),
                self.get(f"{prefix}.experts.down_proj", (num_experts, hidden, inter)))

    def gptoss_experts(self, prefix: str, num_experts: int, hidden: int,
                       inter: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        w_gu = self.get(f"{prefix}.gate_up_proj", (num_experts, 2 * inter, hidden))
        b_gu = self.get(f"{prefix}.gate_up_proj_bias", (num_experts, 2 * inter))
        return (w_gu, b_gu, self.get(f"{prefix}.down_proj", (num_experts, hidden, inter)),
                self.get(f"{prefix}.down_proj_bias", (num_experts, hidden)))

    def _bias_width(self, name: str) -> int:
        heads = self.hf["num_attention_heads"]
        head_dim = self.hf.get("head_dim") or self.hf["hidden_size"] // heads
        if name.endswith("q_proj.bias"):
            return heads * head_dim
        if name.endswith("o_proj.bias"):
            return self.hf["hidden_size"]
        return self.hf.get("num_key_value_heads", heads) * head_dim
