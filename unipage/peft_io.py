"""Read and validate PEFT LoRA adapter directories.

An adapter directory holds ``adapter_config.json`` and
``adapter_model.safetensors`` (a pickled ``adapter_model.bin`` is refused).
`inspect_adapter` reads the config and the safetensors *header* only, checks
everything against the base model and returns an `AdapterInfo`;
`load_adapter_weights` then reads the tensors, checks that they are the bytes
that were inspected, and returns them as `LoraMatrices` in exactly the shapes
of ``build_layout(model, info.layers)``, scaling folded into B.

Shape legend: E = experts of an MoE layer, H = hidden size, I = expert width,
r = rank of one PEFT module, d_in / d_out = a target's input / output width.

Tensor keys are ``base_model.model.<module>.lora_{A,B}.weight`` with ``lora_A``
``[r, d_in]`` and ``lora_B`` ``[d_out, r]``.  Modules accepted, under
``[model.]layers.{l}.``::

    self_attn.{q,k,v,o}_proj                   -> {q,k,v,o}_proj                  dense
    mlp.{gate,up,down}_proj                    -> {gate,up,down}_proj             dense
    mlp.experts.{e}.{gate,up,down}_proj        -> experts.gate_up / experts.down  per_expert (transformers v4)
    block_sparse_moe.experts.{e}.{w1,w3,w2}    -> experts.gate_up / experts.down  per_expert (Mixtral, v4)
    mlp.experts[.base_layer]                   -> experts.gate_up / experts.down  fused (peft target_parameters)

Per-expert gate and up become the two slices of ``experts.gate_up``: ranks
``(r_gate, r_up)``, A = gate A stacked over up A (a projection the adapter
lacks gets rank 0).

Fused 3D expert parameters (transformers v5: ``gate_up_proj`` ``[E, 2I, H]``,
``down_proj`` ``[E, H, I]``, used as ``F.linear(x, W[e])``): PEFT wraps each
targeted parameter in a ``ParamWrapper`` and nests the wrappers, so with both
targeted the inner one (gate_up_proj) is saved under ``mlp.experts.base_layer``
and the outer one (down_proj) under ``mlp.experts``; with one targeted it is
saved under ``mlp.experts``.  The shapes tell which is which (gate_up maps
H -> 2I, down maps I -> H; the two can never coincide).  A wrapper's
``lora_A`` is ``[E*r, d_in]`` with row ``e*r + j`` (expert-major) and its
``lora_B`` is ``[d_out, E*r]`` with column ``j*E + e`` (rank-major,
expert-minor), as in peft's ``ParamWrapper.get_delta_weight``.  A fused
gate_up is one slice of ``2I`` columns.

Ranks and alphas follow PEFT: ``rank_pattern`` / ``alpha_pattern`` keys are
regexes matched against a dotted suffix of the module name (for a fused
parameter, of ``<module>.<parameter>``), first key in file order wins.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_safetensors

from unipage.adapter_info import AdapterInfo, LoraModule
from unipage.adapter_pack import LoraMatrices
from unipage.config import DENSE_TARGETS, EXPERT_TARGETS, LoRAConfig, ModelConfig
from unipage.errors import (AdapterError, AdapterFormatError, AdapterPathError, AdapterRankError,
                            AdapterShapeError)
from unipage.lora_layout import TargetSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
KEY_PREFIX = "base_model.model."
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")

# Config fields that change what an adapter computes and that unipage does not implement.
UNSUPPORTED_FEATURES = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "a LoRA bias (lora_bias)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "layer_replication": "layer replication (layer_replication)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "velora_config": "the VeLoRA variant (velora_config)",
    "monteclora_config": "the MonteCLoRA variant (monteclora_config)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "the KaSA variant (kasa_config)",
}

# Modules an adapter may not touch: (pattern searched in the module name, what it is).
REFUSED_MODULES = (
    (re.compile(r"(^|\.)embed_tokens(\.|$)"), "the token embeddings"),
    (re.compile(r"(^|\.)lm_head(\.|$)"), "the LM head"),
    (re.compile(r"\.(mlp|block_sparse_moe)\.gate(\.|$)"), "the MoE router"),
    (re.compile(r"shared_expert"), "a shared expert"),
)

_LORA_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.(?P<half>lora_A|lora_B)\.weight")
_LAYER = re.compile(r"(?:model\.)?layers\.(?P<layer>\d+)\.(?P<rest>.+)")
_DENSE = re.compile(r"self_attn\.(?P<attn>[qkvo])_proj|mlp\.(?P<mlp>gate|up|down)_proj")
_PER_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
                         r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)")
_FUSED = re.compile(r"mlp\.experts(?:\.base_layer)*")
# per-expert projection -> (target, slice of experts.gate_up)
_EXPERT_PROJ = {"gate_proj": ("experts.gate_up", 0), "w1": ("experts.gate_up", 0),
                "up_proj": ("experts.gate_up", 1), "w3": ("experts.gate_up", 1),
                "down_proj": ("experts.down", 0), "w2": ("experts.down", 0)}
_PART_NAME = {("experts.gate_up", 0): "gate", ("experts.gate_up", 1): "up", ("experts.down", 0): "down"}


# ---------------------------------------------------------------- paths and files


def _inside(path: str, roots: tuple[str, ...]) -> bool:
    return any(os.path.commonpath([path, root]) == root for root in roots)


def resolve_adapter_dir(path, roots: tuple[str, ...]) -> str:
    """The realpath of adapter directory ``path``, which must lie inside one of ``roots``.

    Empty ``roots`` allows any directory.  The *resolved* path is checked, so
    neither ``..`` nor a symlink can leave the roots; the adapter files inside
    the directory are resolved and checked too.
    """
    real = os.path.realpath(os.fspath(path))
    roots = tuple(os.path.realpath(os.fspath(r)) for r in roots)
    if roots and not _inside(real, roots):
        raise AdapterPathError(f"adapter path {os.fspath(path)!r} resolves to {real}, "
                               f"outside the adapter roots {list(roots)}")
    if not os.path.exists(real):
        raise AdapterFormatError(f"no adapter directory at {os.fspath(path)!r}")
    if not os.path.isdir(real):
        raise AdapterFormatError(f"adapter path {os.fspath(path)!r} is not a directory")
    for name in (CONFIG_FILE, WEIGHTS_FILE, PICKLE_FILE):
        target = os.path.realpath(os.path.join(real, name))
        if roots and os.path.lexists(os.path.join(real, name)) and not _inside(target, roots):
            raise AdapterPathError(f"{os.path.join(real, name)} links to {target}, "
                                   f"outside the adapter roots {list(roots)}")
    return real


def _adapter_files(root: str) -> tuple[str, str]:
    """Paths of the config and the safetensors file of adapter directory ``root``."""
    config, weights = os.path.join(root, CONFIG_FILE), os.path.join(root, WEIGHTS_FILE)
    if not os.path.isfile(config):
        raise AdapterFormatError(f"{root} has no {CONFIG_FILE}: not a PEFT adapter directory")
    if os.path.isfile(weights):
        return config, weights
    if os.path.exists(os.path.join(root, PICKLE_FILE)):
        raise AdapterFormatError(
            f"{root} has only {PICKLE_FILE}, a pickle file; unipage refuses pickles because loading "
            f"one can run arbitrary code. Convert it to safetensors, e.g. "
            f"safetensors.torch.save_file(torch.load('{PICKLE_FILE}', weights_only=True), '{WEIGHTS_FILE}'), "
            f"or save the adapter with PeftModel.save_pretrained(..., safe_serialization=True)")
    raise AdapterFormatError(f"{root} has no {WEIGHTS_FILE}")


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise AdapterFormatError(f"cannot read {path}: {err}") from err


def _digest(config_bytes: bytes, weights_path: str) -> tuple[str, int]:
    """sha256 hex of config bytes + weights bytes, and the weights' size; streams the file."""
    digest, size = hashlib.sha256(config_bytes), 0
    try:
        with open(weights_path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
                size += len(chunk)
    except OSError as err:
        raise AdapterFormatError(f"cannot read {weights_path}: {err}") from err
    return digest.hexdigest(), size


# ---------------------------------------------------------------- adapter_config.json


def _parse_config(data: bytes, path: str) -> dict:
    """The config dict, checked: a LoRA adapter with no feature unipage lacks."""
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise AdapterFormatError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise AdapterFormatError(f"{path} must hold a JSON object, got {type(config).__name__}")
    if config.get("peft_type") != "LORA":
        raise AdapterFormatError(f"{path}: peft_type is {config.get('peft_type')!r}; "
                                 f"unipage serves only LoRA adapters (peft_type 'LORA')")
    for name, feature in UNSUPPORTED_FEATURES.items():
        if config.get(name):
            raise AdapterFormatError(f"{path}: the adapter uses {feature}, which unipage does not support")
    if config.get("bias", "none") != "none":
        raise AdapterFormatError(f"{path}: the adapter trains base-model biases (bias={config['bias']!r}), "
                                 f"which unipage does not support")
    _check_config_numbers(config, path)
    return config


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_config_numbers(config: dict, path: str) -> None:
    rank = config.get("r", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterFormatError(f"{path}: r must be an integer >= 1, got {rank!r}")
    if not _is_number(config.get("lora_alpha", 8)):
        raise AdapterFormatError(f"{path}: lora_alpha must be a number, got {config.get('lora_alpha')!r}")
    for name, valid in (("rank_pattern", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1),
                        ("alpha_pattern", _is_number)):
        patterns = config.get(name) or {}
        if not isinstance(patterns, dict):
            raise AdapterFormatError(f"{path}: {name} must be an object, got {patterns!r}")
        bad = {k: v for k, v in patterns.items() if not valid(v)}
        if bad:
            raise AdapterFormatError(f"{path}: bad {name} value(s) {bad}")


def _pattern_value(patterns: dict, name: str, default):
    """PEFT's rule: the first key whose regex matches a dotted suffix of ``name``; else ``default``."""
    for key, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({key})$", name):
                return value
        except re.error as err:
            raise AdapterFormatError(f"pattern key {key!r} is not a valid regex: {err}") from err
    return patterns.get(name, default)


def _rank_and_scaling(config: dict, pattern_name: str) -> tuple[int, float]:
    """Rank and LoRA scaling of the module PEFT knows as ``pattern_name``."""
    rank = _pattern_value(config.get("rank_pattern") or {}, pattern_name, config.get("r", 8))
    alpha = _pattern_value(config.get("alpha_pattern") or {}, pattern_name, config.get("lora_alpha", 8))
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


# ---------------------------------------------------------------- safetensors header


def _read_header(path: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the safetensors header only."""
    try:
        with safe_open(path, framework="pt") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            header = {name: (tuple(s.get_shape()), s.get_dtype()) for name, s in slices.items()}
    except (SafetensorError, OSError) as err:
        raise AdapterFormatError(f"{path} is not a readable safetensors file, it may be truncated "
                                 f"or corrupt: {err}") from err
    bad = {name: dtype for name, (_, dtype) in header.items() if dtype not in FLOAT_DTYPES}
    if bad:
        raise AdapterFormatError(f"{path}: tensors with non-float dtypes {bad}; LoRA weights must be "
                                 f"one of {list(FLOAT_DTYPES)}")
    if not header:
        raise AdapterFormatError(f"{path} holds no tensors")
    return {name: shape for name, (shape, _) in header.items()}


def _refused_module(name: str) -> str | None:
    for pattern, what in REFUSED_MODULES:
        if pattern.search(name):
            return what
    return None


def _stray_tensor(name: str) -> AdapterError:
    """The error for a tensor that is not a LoRA A or B weight."""
    what = _refused_module(name)
    if what:
        return AdapterShapeError(f"tensor {name} adapts {what}, which unipage does not support")
    for marker, feature in (("lora_magnitude_vector", "DoRA (use_dora)"), ("lora_B.bias", "a LoRA bias (lora_bias)"),
                            ("lora_embedding_", "an embedding LoRA"), ("trainable_tokens", "trainable tokens")):
        if marker in name:
            return AdapterFormatError(f"tensor {name} belongs to {feature}, which unipage does not support")
    return AdapterFormatError(f"tensor {name} is not a LoRA A/B weight (full weights such as "
                              f"modules_to_save are not supported)")


def _pair_tensors(shapes: dict) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """PEFT module name -> (lora_A shape, lora_B shape); every module needs both, both 2-D."""
    halves: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        match = _LORA_KEY.fullmatch(name)
        if match is None:
            raise _stray_tensor(name)
        if len(shape) != 2:
            raise AdapterShapeError(f"tensor {name} has shape {list(shape)}; LoRA weights are 2-D")
        halves.setdefault(match["module"], {})[match["half"]] = shape
    for module, pair in halves.items():
        for half in ("lora_A", "lora_B"):
            if half not in pair:
                other = "lora_B" if half == "lora_A" else "lora_A"
                raise AdapterFormatError(f"module {module} has {other} but no {half} weight")
    return {module: (pair["lora_A"], pair["lora_B"]) for module, pair in halves.items()}


# ---------------------------------------------------------------- one module


def _module_dims(model: ModelConfig, layer: int, target: str, per_expert_gate_up: bool) -> tuple[int, int]:
    """(d_in, d_out) of one PEFT module: half of gate_up's columns for per-expert gate or up."""
    d_in, d_out = model.target_dims(target, layer)
    return (d_in, d_out // 2) if per_expert_gate_up else (d_in, d_out)


def _check_layer(name: str, layer: int, model: ModelConfig, target: str) -> None:
    if layer >= model.num_layers:
        raise AdapterShapeError(f"module {name}: layer {layer} does not exist, the base model has "
                                f"{model.num_layers} layers")
    if target not in model.targets(layer):
        raise AdapterShapeError(f"module {name}: layer {layer} of the base model has no {target} "
                                f"(its LoRA targets are {list(model.targets(layer))})")


def _fused_target(name: str, layer: int, a: tuple, b: tuple, model: ModelConfig) -> tuple[str, str]:
    """(target, parameter name) of a fused expert wrapper, told by its shapes."""
    _check_layer(name, layer, model, "experts.down")
    dims = {param: (target, *model.target_dims(target, layer))
            for target, param in (("experts.gate_up", "gate_up_proj"), ("experts.down", "down_proj"))}
    for param, (target, d_in, d_out) in dims.items():
        if a[1] == d_in and b[0] == d_out:
            return target, param
    maps = ", ".join(f"{param} maps {d_in} -> {d_out}" for param, (_, d_in, d_out) in dims.items())
    raise AdapterShapeError(f"module {name}: lora_A {list(a)} / lora_B {list(b)} fit neither fused "
                            f"expert parameter of the base model ({maps})")


def _locate(name: str, a: tuple, b: tuple, model: ModelConfig) -> tuple[int, str, int, int, str]:
    """(layer, target, expert, part, name for rank/alpha patterns) of PEFT module ``name``."""
    what = _refused_module(name)
    if what:
        raise AdapterShapeError(f"module {name} adapts {what}, which unipage does not support")
    found = _LAYER.fullmatch(name)
    if found is None:
        raise AdapterShapeError(f"module {name} is not inside a decoder layer of the base model")
    layer, rest = int(found["layer"]), found["rest"]
    if match := _DENSE.fullmatch(rest):
        target = f"{match['attn'] or match['mlp']}_proj"
        _check_layer(name, layer, model, target)
        return layer, target, -1, 0, name
    if match := _PER_EXPERT.fullmatch(rest):
        target, part = _EXPERT_PROJ[match["proj"]]
        _check_layer(name, layer, model, target)
        expert = int(match["expert"])
        if expert >= model.num_experts:
            raise AdapterShapeError(f"module {name}: expert {expert} does not exist, the base model has "
                                    f"{model.num_experts} experts")
        return layer, target, expert, part, name
    if _FUSED.fullmatch(rest):
        target, param = _fused_target(name, layer, a, b, model)
        return layer, target, -1, 0, f"{name.replace('.base_layer', '')}.{param}"
    raise AdapterShapeError(f"module {name} is not a LoRA target unipage supports "
                            f"(attention q/k/v/o_proj, MLP gate/up/down_proj, MoE experts)")


def _plan_module(name: str, a: tuple, b: tuple, config: dict, model: ModelConfig) -> LoraModule:
    """Check one module's shapes and ranks against the base model and the config."""
    layer, target, expert, part, pattern_name = _locate(name, a, b, model)
    fused = target in EXPERT_TARGETS and expert < 0
    d_in, d_out = _module_dims(model, layer, target, target == "experts.gate_up" and not fused)
    copies = model.num_experts if fused else 1
    rank, rem = divmod(a[0], copies)
    if rem or a[1] != d_in or b[0] != d_out or b[1] != a[0]:
        expect = f"[{copies}*r, {d_in}] / [{d_out}, {copies}*r]" if fused else f"[r, {d_in}] / [{d_out}, r]"
        raise AdapterShapeError(f"module {name}: lora_A {list(a)} / lora_B {list(b)} do not fit the base "
                                f"model, which needs {expect}")
    config_rank, scaling = _rank_and_scaling(config, pattern_name)
    if rank != config_rank:
        raise AdapterRankError(f"module {name} has rank {rank} in its weights but {config_rank} in "
                               f"{CONFIG_FILE} (r / rank_pattern)")
    return LoraModule(name, layer, target, expert, part, rank, scaling, fused)


# ---------------------------------------------------------------- the whole adapter


def _module_order(module: LoraModule, model: ModelConfig) -> tuple:
    return module.layer, model.targets(module.layer).index(module.target), module.expert, module.part


def _plan_modules(shapes: dict, config: dict, model: ModelConfig) -> tuple[LoraModule, ...]:
    modules = [_plan_module(name, a, b, config, model) for name, (a, b) in _pair_tensors(shapes).items()]
    modules.sort(key=lambda m: _module_order(m, model))
    _check_unique(modules)
    _check_expert_format(modules)
    _check_experts_alike(modules, model)
    return tuple(modules)


def _check_unique(modules: list[LoraModule]) -> None:
    seen = {}
    for module in modules:
        key = (module.layer, module.target, module.expert, module.part)
        if key in seen:
            raise AdapterFormatError(f"modules {seen[key]} and {module.name} both adapt {module.target} "
                                     f"of layer {module.layer}")
        seen[key] = module.name


def _check_expert_format(modules: list[LoraModule]) -> None:
    kinds = {m.fused: m.name for m in modules if m.target in EXPERT_TARGETS}
    if len(kinds) == 2:
        raise AdapterFormatError(f"the adapter mixes per-expert modules ({kinds[False]}) with fused "
                                 f"expert parameters ({kinds[True]})")


def _check_experts_alike(modules: list[LoraModule], model: ModelConfig) -> None:
    """Per-expert modules: every expert of a layer adapted, all with the same rank."""
    ranks: dict[tuple[int, str, int], dict[int, int]] = {}
    for m in modules:
        if m.target in EXPERT_TARGETS and not m.fused:
            ranks.setdefault((m.layer, m.target, m.part), {})[m.expert] = m.rank
    for (layer, target, part), by_expert in ranks.items():
        proj = _PART_NAME[(target, part)]
        missing = sorted(set(range(model.num_experts)) - set(by_expert))
        if missing:
            raise AdapterRankError(f"layer {layer}: {proj} projections of experts {sorted(by_expert)} have "
                                   f"LoRA weights but experts {missing} have none; unipage needs every "
                                   f"expert of a layer adapted with the same rank")
        if len(set(by_expert.values())) > 1:
            raise AdapterRankError(f"layer {layer}: the experts' {proj} projections have different ranks "
                                   f"{by_expert}; unipage needs every expert of a layer to have the same rank")


def _layer_specs(modules: tuple[LoraModule, ...], model: ModelConfig) -> tuple[tuple[TargetSpec, ...], ...]:
    """Per layer, the TargetSpecs of the targets the adapter has (experts share one spec)."""
    ranks: dict[tuple[int, str], dict[int, int]] = {}
    fused: set[tuple[int, str]] = set()
    for m in modules:
        ranks.setdefault((m.layer, m.target), {})[m.part] = m.rank
        if m.fused:
            fused.add((m.layer, m.target))
    layers = []
    for layer in range(model.num_layers):
        specs = []
        for target in model.targets(layer):
            parts = ranks.get((layer, target))
            if parts is None:
                continue
            two_slices = target == "experts.gate_up" and (layer, target) not in fused
            specs.append(TargetSpec(target, (parts.get(0, 0), parts.get(1, 0)) if two_slices else (parts[0],)))
        layers.append(tuple(specs))
    return tuple(layers)


def _check_max_rank(modules: tuple[LoraModule, ...], max_rank: int) -> None:
    for module in modules:
        if module.rank > max_rank:
            raise AdapterRankError(f"module {module.name} has rank {module.rank}, above the configured "
                                   f"max_rank={max_rank}")


def inspect_adapter(path, model: ModelConfig, lora: LoRAConfig) -> AdapterInfo:
    """Validate the PEFT adapter at ``path`` against ``model`` and ``lora``; reads no tensor data."""
    root = resolve_adapter_dir(path, lora.adapter_roots)
    config_path, weights_path = _adapter_files(root)
    config_bytes = _read_bytes(config_path)
    config = _parse_config(config_bytes, config_path)
    modules = _plan_modules(_read_header(weights_path), config, model)
    _check_max_rank(modules, lora.max_rank)
    digest, size = _digest(config_bytes, weights_path)
    present = {m.target for m in modules}
    order = [t for t in DENSE_TARGETS + EXPERT_TARGETS if t in present]
    experts = [m for m in modules if m.target in EXPERT_TARGETS]
    return AdapterInfo(
        path=root, rank=config.get("r", 8), alpha=float(config.get("lora_alpha", 8)),
        use_rslora=bool(config.get("use_rslora", False)), max_rank=max(m.rank for m in modules),
        targets=tuple(order), layers=_layer_specs(modules, model),
        expert_format=("fused" if experts[0].fused else "per_expert") if experts else None,
        digest=digest, file_bytes=size, modules=modules)


# ---------------------------------------------------------------- tensors


def read_verified(info: AdapterInfo) -> dict[str, torch.Tensor]:
    """All tensors of the adapter, after checking the files still hash to ``info.digest``."""
    config_bytes = _read_bytes(os.path.join(info.path, CONFIG_FILE))
    data = _read_bytes(os.path.join(info.path, WEIGHTS_FILE))
    digest = hashlib.sha256(config_bytes)
    digest.update(data)
    if digest.hexdigest() != info.digest:
        raise AdapterFormatError(f"the adapter files in {info.path} changed since they were inspected; "
                                 f"inspect the adapter again")
    return load_safetensors(data)


def _expert_pieces(module: LoraModule, a: torch.Tensor, b: torch.Tensor, num_experts: int):
    """Yield ``(expert, A [r, d_in], B [d_out, r])`` of one module (every expert when fused)."""
    if not module.fused:
        yield module.expert, a, b
        return
    a3 = a.reshape(num_experts, module.rank, a.shape[1])  # row e*r + j
    b3 = b.reshape(b.shape[0], module.rank, num_experts)  # column j*E + e
    for expert in range(num_experts):
        yield expert, a3[expert], b3[:, :, expert]


def _module_tensors(module: LoraModule, tensors: dict, model: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora_A, lora_B) of one module in fp32, shapes re-checked against the plan."""
    prefix = KEY_PREFIX + module.name
    a, b = tensors[f"{prefix}.lora_A.weight"].float(), tensors[f"{prefix}.lora_B.weight"].float()
    copies = model.num_experts if module.fused else 1
    d_in, d_out = _module_dims(model, module.layer, module.target,
                               module.target == "experts.gate_up" and not module.fused)
    if a.shape != (copies * module.rank, d_in) or b.shape != (d_out, copies * module.rank):
        raise AdapterFormatError(f"module {module.name} changed shape since it was inspected")
    return a, b


def _matrices(key: tuple, parts: dict, info: AdapterInfo, model: ModelConfig) -> LoraMatrices:
    """LoraMatrices of ``key`` from its parts ``{part: (A [r, d_in], B [r, d_out] scaled)}``."""
    layer, target, _ = key
    spec = next(s for s in info.layers[layer] if s.target == target)
    if len(spec.ranks) == 1:
        a, b = parts[0]
        if target == "experts.gate_up" and model.gate_up_interleaved:
            b = torch.cat([b[:, 0::2], b[:, 1::2]], dim=1)  # GPT-OSS: the engine's gate columns come first
        return LoraMatrices(a.contiguous(), (b.contiguous(),))
    d_in, d_out = _module_dims(model, layer, target, True)
    empty = (torch.zeros(0, d_in), torch.zeros(0, d_out))
    gate, up = parts.get(0, empty), parts.get(1, empty)
    return LoraMatrices(torch.cat([gate[0], up[0]]).contiguous(), (gate[1].contiguous(), up[1].contiguous()))


def load_adapter_weights(info: AdapterInfo, model: ModelConfig) -> dict:
    """``(layer, target, expert) -> LoraMatrices`` (fp32, scaling folded into B).

    Shapes are those of ``build_layout(model, info.layers)``: A ``[R, d_in]``,
    each B slice ``[r, ncols]`` (rank-major: PEFT's ``lora_B`` transposed).
    """
    tensors = read_verified(info)
    parts: dict[tuple, dict[int, tuple]] = {}
    for module in info.modules:
        a, b = _module_tensors(module, tensors, model)
        for expert, a_e, b_e in _expert_pieces(module, a, b, model.num_experts):
            key = (module.layer, module.target, expert)
            parts.setdefault(key, {})[module.part] = (a_e, b_e.t() * module.scaling)
    return {key: _matrices(key, p, info, model) for key, p in parts.items()}
