"""What is known about an adapter without its tensors, and synthetic adapters.

Pure Python (no torch), so the bookkeeping and the simulator can use it.
`unipage.peft_io.inspect_adapter` fills an `AdapterInfo` from a PEFT
directory; `synthetic_info` describes an adapter that has no files — for the simulator,
the bookkeeping tests and benchmarks that only need its shape and size.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from unipage.config import ATTENTION_TARGETS, ModelConfig
from unipage.lora_layout import TargetSpec


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One PEFT LoRA module (or fused 3D expert parameter) and where its matrices go."""

    name: str  # PEFT module name, e.g. "model.layers.0.mlp.experts.3.gate_proj"
    layer: int
    target: str  # unipage target, e.g. "experts.gate_up"
    expert: int  # expert of a per-expert module; -1 for dense targets and fused experts
    part: int  # slice of a per-expert experts.gate_up: 0 gate, 1 up; else 0
    rank: int  # r of the module (of each expert when fused)
    scaling: float  # alpha / r, or alpha / sqrt(r) with rslora
    fused: bool  # A [E*r, d_in] expert-major rows, B [d_out, E*r] column j*E + e

    def __reduce__(self):  # pickled field by field: a slots dataclass's default way is several times slower
        return LoraModule, (self.name, self.layer, self.target, self.expert, self.part, self.rank, self.scaling,
                            self.fused)


@dataclass(frozen=True)
class AdapterInfo:
    """Everything known about an adapter without loading its tensor data."""

    path: str  # realpath of the adapter directory
    rank: int  # r in adapter_config.json (the default of every module)
    alpha: float  # lora_alpha in adapter_config.json
    use_rslora: bool  # scaling alpha / sqrt(r) instead of alpha / r
    max_rank: int  # largest rank of any module (rank_pattern honoured)
    targets: tuple[str, ...]  # unipage targets present, in buffer order
    layers: tuple[tuple[TargetSpec, ...], ...]  # per model layer, for lora_layout.build_layout
    expert_format: str | None  # "per_expert", "fused", or None without expert targets
    digest: str  # sha256 hex of adapter_config.json bytes + adapter_model.safetensors bytes
    file_bytes: int  # size of adapter_model.safetensors
    modules: tuple[LoraModule, ...] = field(default=(), repr=False)  # what load_adapter_weights reads


def _layer_specs(model: ModelConfig, layer: int, rank: int, targets) -> tuple[TargetSpec, ...]:
    specs = [TargetSpec(t, (rank,)) for t in model.targets(layer) if t in targets]
    if "experts" in targets and model.is_moe_layer(layer):
        specs += [TargetSpec("experts.gate_up", (rank,)), TargetSpec("experts.down", (rank,))]
    return tuple(specs)


def synthetic_info(model: ModelConfig, rank: int, targets=ATTENTION_TARGETS,
                   digest: str | None = None, alpha: float | None = None) -> AdapterInfo:
    """A file-less adapter of ``rank`` on ``targets`` (``"experts"`` = every expert, fused format)."""
    layers = tuple(_layer_specs(model, layer, rank, tuple(targets)) for layer in range(model.num_layers))
    present = tuple(dict.fromkeys(s.target for specs in layers for s in specs))
    params = sum(rank * sum(model.target_dims(s.target, i)) * (model.num_experts if s.target.startswith("experts") else 1)
                 for i, specs in enumerate(layers) for s in specs)
    digest = digest or hashlib.sha256(repr((rank, present, layers)).encode()).hexdigest()
    return AdapterInfo(path="", rank=rank, alpha=float(alpha or rank), use_rslora=False, max_rank=rank,
                       targets=present, layers=layers, expert_format="fused" if "experts" in targets else None,
                       digest=digest, file_bytes=params * model.dtype_bytes)
