"""Every kind of bad adapter input: the specific exception, a message naming the cause, nothing changed.

Each case starts from a valid adapter made by PEFT (copied into the test's own
directory), breaks one thing, and checks that `inspect_adapter` raises the
right `unipage.errors` class with a telling message and leaves the directory
byte-for-byte as it was.
"""

from __future__ import annotations

import json
import os
import shutil

import peft_factory as pf
import pytest
import torch
from safetensors.torch import load_file, save_file

from unipage.config import LoRAConfig, ModelConfig
from unipage.errors import (AdapterError, AdapterFormatError, AdapterPathError, AdapterRankError,
                            AdapterShapeError)
from unipage.peft_io import inspect_adapter, load_adapter_weights, resolve_adapter_dir

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::RuntimeWarning")

LORA = LoRAConfig(max_rank=64)
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
L0 = "base_model.model.model.layers.0"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Valid adapters made once by PEFT: name -> (directory, ModelConfig)."""
    root = tmp_path_factory.mktemp("made")
    adapters = {
        "dense": pf.dense_adapter(root / "dense", r=4, lora_alpha=8),
        "fused": pf.fused_moe_adapter(root / "fused"),
        "per_expert": pf.per_expert_adapter(root / "per_expert"),
        "per_expert_ranks": pf.per_expert_adapter(root / "per_expert_ranks", rank_pattern={"experts.2.gate_proj": 2}),
        "dora": pf.dense_adapter(root / "dora", use_dora=True, target_modules=["q_proj"]),
        "lora_bias": pf.dense_adapter(root / "lora_bias", lora_bias=True, target_modules=["q_proj"]),
        "modules_to_save": pf.dense_adapter(root / "modules_to_save", modules_to_save=["lm_head"],
                                            target_modules=["q_proj"]),
        "embeddings": pf.dense_adapter(root / "embeddings", target_modules=["embed_tokens"]),
        "lm_head": pf.dense_adapter(root / "lm_head", target_modules=["lm_head"]),
        "router_v4": pf.per_expert_adapter(root / "router_v4", target_modules=["gate"]),
        "router_v5": pf.fused_moe_adapter(root / "router_v5", target_modules=["q_proj"],
                                          target_parameters=["mlp.gate.weight"]),
    }
    return {name: (a.path, a.model) for name, a in adapters.items()}


@pytest.fixture
def copy(made, tmp_path):
    """``copy(name)`` -> (a fresh copy of adapter ``name``, its ModelConfig)."""
    def make(name: str):
        path, model = made[name]
        target = tmp_path / name
        shutil.copytree(path, target)
        return target, model
    return make


def snapshot(root) -> dict:
    root = str(root)
    if not os.path.isdir(root):
        return {}
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(root) for f in files}


def expect(exc: type, *phrases: str, path, model: ModelConfig, lora: LoRAConfig = LORA) -> str:
    """Inspect ``path``: must raise ``exc`` naming every phrase, and change nothing on disk."""
    before = snapshot(path)
    with pytest.raises(exc) as caught:
        inspect_adapter(path, model, lora)
    message = str(caught.value)
    for phrase in phrases:
        assert phrase in message, f"{phrase!r} not in {message!r}"
    assert isinstance(caught.value, AdapterError)
    assert snapshot(path) == before
    return message


def edit_config(path, **changes) -> None:
    config = json.loads((path / CONFIG).read_text())
    (path / CONFIG).write_text(json.dumps(config | changes))


def edit_tensors(path, edit) -> None:
    tensors = load_file(path / WEIGHTS)
    edit(tensors)
    save_file(tensors, path / WEIGHTS)


def rename(tensors: dict, old: str, new: str) -> None:
    for key in [k for k in tensors if old in k]:
        tensors[key.replace(old, new)] = tensors.pop(key)


# ---------------------------------------------------------------- files


def test_missing_directory(tmp_path, made):
    expect(AdapterFormatError, "no adapter directory", path=tmp_path / "nope", model=made["dense"][1])


def test_path_is_a_file(tmp_path, made):
    (tmp_path / "file").write_text("x")
    expect(AdapterFormatError, "not a directory", path=tmp_path / "file", model=made["dense"][1])


def test_missing_config(copy):
    path, model = copy("dense")
    (path / CONFIG).unlink()
    expect(AdapterFormatError, "no adapter_config.json", path=path, model=model)


def test_missing_safetensors(copy):
    path, model = copy("dense")
    (path / WEIGHTS).unlink()
    expect(AdapterFormatError, "no adapter_model.safetensors", path=path, model=model)


def test_pickle_only_is_refused(copy):
    path, model = copy("dense")
    torch.save(load_file(path / WEIGHTS), path / "adapter_model.bin")
    (path / WEIGHTS).unlink()
    expect(AdapterFormatError, "adapter_model.bin", "pickle", "Convert it to safetensors", path=path, model=model)


@pytest.mark.parametrize("text, phrase", [("{not json", "not valid JSON"), ("[1, 2]", "JSON object"),
                                          (b"\xff\xfe".decode("latin-1"), "not valid JSON")])
def test_corrupt_config(copy, text, phrase):
    path, model = copy("dense")
    (path / CONFIG).write_text(text, encoding="latin-1")
    expect(AdapterFormatError, CONFIG, phrase, path=path, model=model)


@pytest.mark.parametrize("cut", ["truncated", "garbage", "empty"])
def test_corrupt_safetensors(copy, cut):
    path, model = copy("dense")
    data = (path / WEIGHTS).read_bytes()
    broken = {"truncated": data[:-100], "garbage": b"definitely not safetensors", "empty": b""}[cut]
    (path / WEIGHTS).write_bytes(broken)
    expect(AdapterFormatError, WEIGHTS, "truncated or corrupt", path=path, model=model)


def test_no_tensors(copy):
    path, model = copy("dense")
    save_file({}, path / WEIGHTS)
    expect(AdapterFormatError, "no tensors", path=path, model=model)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("changes, phrase", [
    ({"peft_type": "IA3"}, "peft_type is 'IA3'"),
    ({"use_dora": True}, "DoRA"),
    ({"lora_bias": True}, "lora_bias"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"trainable_token_indices": [1]}, "trainable_token_indices"),
    ({"bias": "all"}, "bias='all'"),
    ({"r": "eight"}, "r must be an integer"),
    ({"lora_alpha": None}, "lora_alpha must be a number"),
    ({"rank_pattern": ["q_proj"]}, "rank_pattern must be an object"),
    ({"rank_pattern": {"q_proj": 0}}, "bad rank_pattern"),
    ({"rank_pattern": {"q_proj(": 4}}, "not a valid regex"),
])
def test_bad_config(copy, changes, phrase):
    path, model = copy("dense")
    edit_config(path, **changes)
    expect(AdapterFormatError, phrase, path=path, model=model)


def test_rank_in_config_disagrees_with_tensors(copy):
    path, model = copy("dense")
    edit_config(path, r=3)
    expect(AdapterRankError, "rank 4 in its weights but 3", path=path, model=model)


def test_rank_above_max_rank(copy):
    path, model = copy("dense")
    expect(AdapterRankError, "rank 4", "max_rank=2", path=path, model=model, lora=LoRAConfig(max_rank=2))


# ---------------------------------------------------------------- tensors


@pytest.mark.parametrize("half, other", [("lora_A", "lora_B"), ("lora_B", "lora_A")])
def test_missing_half_of_a_module(copy, half, other):
    path, model = copy("dense")
    edit_tensors(path, lambda t: t.pop(f"{L0}.self_attn.q_proj.{half}.weight"))
    expect(AdapterFormatError, "model.layers.0.self_attn.q_proj", f"has {other} but no {half}", path=path, model=model)


@pytest.mark.parametrize("edit, phrase", [
    (lambda t: rename(t, "layers.1.", "layers.5."), "layer 5 does not exist"),
    (lambda t: rename(t, "layers.0.self_attn.q_proj", "layers.0.self_attn.x_proj"), "not a LoRA target"),
    (lambda t: rename(t, "model.layers.0", "vision.blocks.0"), "not inside a decoder layer"),
    (lambda t: t.update({f"{L0}.self_attn.q_proj.lora_A.weight": torch.zeros(4, 65)}), "do not fit"),
    (lambda t: t.update({f"{L0}.self_attn.q_proj.lora_B.weight": torch.zeros(64, 3)}), "do not fit"),
    (lambda t: t.update({f"{L0}.self_attn.q_proj.lora_A.weight": torch.zeros(1, 4, 64)}), "2-D"),
    (lambda t: rename(t, "layers.0.mlp.gate_proj", "layers.0.mlp.shared_expert.gate_proj"), "a shared expert"),
    (lambda t: t.update({"base_model.model.lm_head.weight": torch.zeros(128, 64)}), "the LM head"),
])
def test_tensor_does_not_fit_the_model(copy, edit, phrase):
    path, model = copy("dense")
    edit_tensors(path, edit)
    expect(AdapterShapeError, phrase, path=path, model=model)


@pytest.mark.parametrize("edit, phrase", [
    (lambda t: t.update({f"{L0}.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64, dtype=torch.int8)}),
     "non-float"),
    (lambda t: t.update({f"{L0}.self_attn.q_proj.lora_magnitude_vector": torch.ones(64)}), "DoRA"),
    (lambda t: t.update({"base_model.model.model.norm.weight": torch.ones(64)}), "not a LoRA A/B weight"),
])
def test_tensor_that_is_not_plain_lora(copy, edit, phrase):
    path, model = copy("dense")
    edit_tensors(path, edit)
    expect(AdapterFormatError, phrase, path=path, model=model)


def test_wrong_base_model_width(copy):
    path, model = copy("dense")
    wider = ModelConfig(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=96, dtype="float32")
    expect(AdapterShapeError, "do not fit the base model", path=path, model=wider)


# ---------------------------------------------------------------- refused features, as PEFT saves them


@pytest.mark.parametrize("name, exc, phrase", [
    ("dora", AdapterFormatError, "DoRA"),
    ("lora_bias", AdapterFormatError, "lora_bias"),
    ("modules_to_save", AdapterFormatError, "modules_to_save"),
    ("embeddings", AdapterShapeError, "the token embeddings"),
    ("lm_head", AdapterShapeError, "the LM head"),
    ("router_v4", AdapterShapeError, "the MoE router"),
    ("router_v5", AdapterShapeError, "the MoE router"),
])
def test_refused_peft_features(copy, name, exc, phrase):
    path, model = copy(name)
    expect(exc, phrase, path=path, model=model)


# ---------------------------------------------------------------- MoE


def test_dense_mlp_module_in_an_moe_layer(copy, made):
    path, _ = copy("dense")
    expect(AdapterShapeError, "model.layers.0.mlp.", "layer 0 of the base model has no", path=path, model=made["fused"][1])


@pytest.mark.parametrize("name", ["fused", "per_expert"])
def test_expert_modules_in_a_dense_model(copy, made, name):
    path, _ = copy(name)
    expect(AdapterShapeError, "has no experts.", path=path, model=made["dense"][1])


def test_per_expert_ranks_differ(copy):
    path, model = copy("per_expert_ranks")
    expect(AdapterRankError, "layer 0", "gate", "different ranks", path=path, model=model)


def test_per_expert_missing_expert(copy):
    path, model = copy("per_expert")
    edit_tensors(path, lambda t: [t.pop(k) for k in list(t) if "layers.1.mlp.experts.3.up_proj" in k])
    expect(AdapterRankError, "layer 1", "up projections", "experts [3] have none", path=path, model=model)


def test_expert_index_beyond_the_model(copy):
    path, model = copy("per_expert")
    edit_tensors(path, lambda t: rename(t, "experts.3.", "experts.9."))
    expect(AdapterShapeError, "expert 9 does not exist", path=path, model=model)


def test_fused_shapes_fit_neither_parameter(copy):
    path, model = copy("fused")
    edit_tensors(path, lambda t: t.update({f"{L0}.mlp.experts.lora_A.weight": torch.zeros(16, 48)}))
    expect(AdapterShapeError, "fit neither fused expert parameter", path=path, model=model)


def test_fused_rows_not_a_multiple_of_experts(copy):
    path, model = copy("fused")
    edit_tensors(path, lambda t: t.update({f"{L0}.mlp.experts.lora_A.weight": torch.zeros(15, 32),
                                           f"{L0}.mlp.experts.lora_B.weight": torch.zeros(64, 15)}))
    expect(AdapterShapeError, "[4*r, 32]", path=path, model=model)


def test_two_fused_wrappers_on_one_parameter(copy):
    path, model = copy("fused")

    def duplicate_down(t):
        for half in ("lora_A", "lora_B"):
            t[f"{L0}.mlp.experts.base_layer.{half}.weight"] = t[f"{L0}.mlp.experts.{half}.weight"].clone()
    edit_tensors(path, duplicate_down)
    expect(AdapterFormatError, "both adapt experts.down of layer 0", path=path, model=model)


def test_mixed_expert_formats(copy, made):
    path, model = copy("per_expert")
    fused = load_file(os.path.join(made["fused"][0], WEIGHTS))

    def mix(t):
        for key in [k for k in t if "layers.1.mlp.experts." in k]:
            del t[key]
        t.update({k: v for k, v in fused.items() if "layers.1.mlp.experts." in k})
    edit_tensors(path, mix)
    expect(AdapterFormatError, "mixes per-expert modules", path=path, model=model)


# ---------------------------------------------------------------- paths


@pytest.fixture
def roots(copy, tmp_path):
    """An adapter root holding a valid adapter, and a valid adapter outside it."""
    inside, model = copy("dense")
    root = tmp_path / "root"
    root.mkdir()
    shutil.move(inside, root / "ok")
    outside, _ = copy("fused")
    return root, outside, model


def test_dotdot_escapes_the_roots(roots):
    root, outside, model = roots
    lora = LoRAConfig(adapter_roots=(str(root),))
    assert inspect_adapter(root / "ok", model, lora).path == os.path.realpath(root / "ok")
    escape = root / ".." / outside.name
    expect(AdapterPathError, "outside the adapter roots", path=escape, model=model, lora=lora)
    expect(AdapterPathError, "outside the adapter roots", path=root / ".." / "missing", model=model, lora=lora)


def test_symlinked_directory_escapes_the_roots(roots):
    root, outside, model = roots
    os.symlink(outside, root / "link")
    lora = LoRAConfig(adapter_roots=(str(root),))
    expect(AdapterPathError, "resolves to", "outside the adapter roots", path=root / "link", model=model, lora=lora)


@pytest.mark.parametrize("name", [CONFIG, WEIGHTS])
def test_symlinked_file_escapes_the_roots(roots, name):
    root, outside, model = roots
    (root / "ok" / name).unlink()
    os.symlink(outside / name, root / "ok" / name)
    lora = LoRAConfig(adapter_roots=(str(root),))
    expect(AdapterPathError, f"{name} links to", path=root / "ok", model=model, lora=lora)
    with pytest.raises(AdapterPathError):
        resolve_adapter_dir(root / "ok", lora.adapter_roots)


# ---------------------------------------------------------------- load after inspect


@pytest.mark.parametrize("name", [CONFIG, WEIGHTS])
def test_files_changed_between_inspect_and_load(copy, name):
    path, model = copy("dense")
    info = inspect_adapter(path, model, LORA)
    if name == CONFIG:
        edit_config(path, lora_alpha=99)
    else:
        edit_tensors(path, lambda t: t[f"{L0}.self_attn.q_proj.lora_A.weight"].mul_(2))
    with pytest.raises(AdapterFormatError, match="changed since they were inspected"):
        load_adapter_weights(info, model)
