"""Read a local Hugging Face checkpoint: ``config.json`` plus safetensors shards.

Shape legend: E = experts, H = hidden size, I = expert width.

`Checkpoint` opens every shard lazily (``model.safetensors``, or the shards
listed in ``model.safetensors.index.json``) and hands out tensors by name in
the wanted dtype and device.  MoE expert weights come back stacked whatever
the file holds:

* per-expert keys, as transformers writes them for Qwen3-MoE / OLMoE
  (``mlp.experts.{e}.{gate,up,down}_proj.weight``) and Mixtral
  (``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``);
* fused 3D parameters (``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and
  ``mlp.experts.down_proj`` ``[E, H, I]``).

`expert_weights` returns ``w_gate_up [E, 2I, H]`` (gate rows first) and
``w_down [E, H, I]``, the shapes the fused MoE kernels take.  Pickled
``*.bin`` checkpoints are refused.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from unipage.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
EXPERT_NAMES = {  # module prefix style -> (gate, up, down) per-expert names
    "mlp": ("gate_proj", "up_proj", "down_proj"),
    "block_sparse_moe": ("w1", "w3", "w2"),
}


def read_config(model_dir: str) -> dict:
    """The checkpoint's ``config.json`` as a dict (a `CheckpointError` if missing or malformed)."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{model_dir!r} is not a Hugging Face model directory: no config.json") from None
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(f"{path} has no model_type")
    return config


def _shard_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        return sorted({os.path.join(model_dir, name) for name in weight_map.values()})
    single = os.path.join(model_dir, SINGLE_FILE)
    if os.path.exists(single):
        return [single]
    if any(name.endswith(".bin") for name in os.listdir(model_dir)):
        raise CheckpointError(f"{model_dir!r} holds pickled .bin weights; only safetensors are loaded "
                              f"(convert with transformers' save_pretrained(safe_serialization=True))")
    raise CheckpointError(f"{model_dir!r} has no {SINGLE_FILE} or {INDEX_FILE}")


class Checkpoint:
    """Tensors of a checkpoint by name, converted on read."""

    def __init__(self, model_dir: str, dtype: torch.dtype, device: torch.device) -> None:
        self.model_dir, self.dtype, self.device = model_dir, dtype, device
        self._files = {}
        self._where: dict[str, str] = {}
        for path in _shard_files(model_dir):
            if not os.path.exists(path):
                raise CheckpointError(f"checkpoint shard {path} is missing")
            handle = safe_open(path, framework="pt")
            self._files[path] = handle
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                self._where[key] = path

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if name not in self._where:
            raise CheckpointError(f"checkpoint {self.model_dir!r} has no tensor {name!r}")
        tensor = self._files[self._where[name]].get_tensor(name)
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {list(tensor.shape)}, expected {list(shape)}")
        return tensor.to(device=self.device, dtype=self.dtype)

    def optional(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor | None:
        return self.get(name, shape) if name in self else None

    def expert_weights(self, layer_prefix: str, num_experts: int, hidden: int,
                       inter: int) -> tuple[str, torch.Tensor, torch.Tensor]:
        """``(moe prefix, w_gate_up [E, 2I, H], w_down [E, H, I])`` of one MoE layer, from either format."""
        for style, (gate, up, down) in EXPERT_NAMES.items():
            prefix = f"{layer_prefix}.{style}"
            fused = f"{prefix}.experts.gate_up_proj"
            if fused in self:
                w_gu = self._fused(fused, (num_experts, 2 * inter, hidden))
                return prefix, w_gu, self._fused(f"{prefix}.experts.down_proj", (num_experts, hidden, inter))
            if f"{prefix}.experts.0.{gate}.weight" in self:
                gates, ups = (self._stack(prefix, n, num_experts, (inter, hidden)) for n in (gate, up))
                w_down = self._stack(prefix, down, num_experts, (hidden, inter))
                return prefix, torch.cat([gates, ups], dim=1).contiguous(), w_down
        raise CheckpointError(f"no expert weights under {layer_prefix!r} (looked for mlp.experts.* and "
                              f"block_sparse_moe.experts.*)")

    def gptoss_experts(self, prefix: str, num_experts: int, hidden: int,
                       inter: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """GPT-OSS experts under ``prefix`` (``model.layers.{l}.mlp.experts``): ``w_gate_up [E, 2I, H]``,
        ``b_gate_up [E, 2I]`` (gate columns first: the file interleaves gate, up), ``w_down [E, H, I]``,
        ``b_down [E, H]``.  The file stores ``gate_up_proj [E, H, 2I]`` and ``down_proj [E, I, H]``."""
        w_gu = self.get(f"{prefix}.gate_up_proj", (num_experts, hidden, 2 * inter)).transpose(1, 2)
        b_gu = self.get(f"{prefix}.gate_up_proj_bias", (num_experts, 2 * inter))
        w_down = self.get(f"{prefix}.down_proj", (num_experts, inter, hidden)).transpose(1, 2).contiguous()
        b_down = self.get(f"{prefix}.down_proj_bias", (num_experts, hidden)).contiguous()
        return deinterleave(w_gu, 1), deinterleave(b_gu, 1), w_down, b_down

    def _stack(self, prefix: str, name: str, num_experts: int, shape: tuple[int, int]) -> torch.Tensor:
        return torch.stack([self.get(f"{prefix}.experts.{e}.{name}.weight", shape) for e in range(num_experts)])

    def _fused(self, name: str, shape: tuple[int, int, int]) -> torch.Tensor:
        tensor = self.get(name)
        if tuple(tensor.shape) == shape:
            return tensor.contiguous()
        if tuple(tensor.shape) == (shape[0], shape[2], shape[1]):
            return tensor.transpose(1, 2).contiguous()  # stored [E, d_in, d_out]
        raise CheckpointError(f"tensor {name!r} has shape {list(tensor.shape)}, expected {list(shape)}")


def deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Columns ``g0, u0, g1, u1, ...`` along ``dim`` -> ``g0, g1, ..., u0, u1, ...`` (contiguous)."""
    index = torch.arange(t.shape[dim], device=t.device)
    order = torch.cat([index[0::2], index[1::2]])
    return t.index_select(dim, order).contiguous()
