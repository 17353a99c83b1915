"""PEFT adapters through inspect -> load -> pack -> scattered pool pages -> gather, against PEFT itself.

Oracle: the live `PeftModel` each adapter was saved from — its modules'
``lora_A``/``lora_B`` weights times ``scaling``, and ``get_delta_weight``,
which catches orientation and (for fused experts) interleave mistakes that a
symmetric test of our own reshapes would miss.
"""

from __future__ import annotations

import hashlib
import os
import re

import peft_factory as pf
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import PeftModel
from peft.tuners.lora.layer import LoraLayer, ParamWrapper
from peft.utils.other import get_pattern_key

from unipage.adapter_pack import gather_adapter, pack_adapter
from unipage.config import LoRAConfig
from unipage.lora_layout import TargetSpec, build_layout
from unipage.peft_io import (_pattern_value, inspect_adapter, load_adapter_weights,
                             resolve_adapter_dir)

# PEFT warns that pattern keys naming a fused expert parameter match nothing, yet applies them (checked here).
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore:The following .*_pattern keys did not match:RuntimeWarning")

PAGE_ELEMS = 256
LORA = LoRAConfig(max_rank=64)

_MODULE = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(.+)")
_DENSE = {f"self_attn.{p}": p for p in pf.ATTENTION} | {f"mlp.{p}": p for p in ("gate_proj", "up_proj", "down_proj")}
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)")
_EXPERT_PROJ = {"gate_proj": ("experts.gate_up", 0), "w1": ("experts.gate_up", 0),
                "up_proj": ("experts.gate_up", 1), "w3": ("experts.gate_up", 1),
                "down_proj": ("experts.down", 0), "w2": ("experts.down", 0)}
_FUSED_PARAM = {"gate_up_proj": "experts.gate_up", "down_proj": "experts.down"}


# ---------------------------------------------------------------- oracle


def _lora_modules(peft_model):
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            yield name, module


def _fused_parts(module: ParamWrapper):
    """Per expert e: A rows e*r..e*r+r, B columns j*E + e (PEFT's layout), and PEFT's delta [d_out, d_in]."""
    a, b = module.lora_A["default"].weight.detach().float(), module.lora_B["default"].weight.detach().float()
    num, rank, scale = module.num_experts, module.r["default"], module.scaling["default"]
    delta = module.get_delta_weight("default").detach().float()  # [E, d_out, d_in] for Qwen3-MoE
    for e in range(num):
        b_e = b[:, [j * num + e for j in range(rank)]]
        yield e, (a[e * rank:(e + 1) * rank], b_e.T * scale, delta[e])


def peft_oracle(peft_model) -> dict:
    """``(layer, target, expert) -> {part: (A [r, d_in], B.T*scaling [r, d_out], delta [d_out, d_in])}``."""
    out = {}
    for name, module in _lora_modules(peft_model):
        match = _MODULE.fullmatch(name)
        layer, rest = int(match[1]), match[2]
        if isinstance(module, ParamWrapper):
            for expert, part in _fused_parts(module):
                out[(layer, _FUSED_PARAM[module.parameter_name], expert)] = {0: part}
            continue
        a, b = module.lora_A["default"].weight.detach().float(), module.lora_B["default"].weight.detach().float()
        piece = (a, b.T * module.scaling["default"], module.get_delta_weight("default").detach().float())
        if rest in _DENSE:
            out[(layer, _DENSE[rest], -1)] = {0: piece}
        else:
            expert = _EXPERT.fullmatch(rest)
            target, part = _EXPERT_PROJ[expert[2]]
            out.setdefault((layer, target, int(expert[1])), {})[part] = piece
    return out


# ---------------------------------------------------------------- pool round trip


def place_in_pool(pool: torch.Tensor, pages: list[int], weights: dict, layout) -> None:
    """Pack ``weights`` and copy the pages into ``pool`` ``[L, N, P]`` at page ids ``pages``."""
    buf = pack_adapter(layout, weights, PAGE_ELEMS, pool.dtype)  # [L, n, P]
    assert buf.shape[1] == len(pages)
    pool[:, torch.tensor(pages)] = buf


def round_trip(adapter: pf.Adapter, seed: int = 0):
    """inspect -> load -> pack -> scattered pages of a noisy pool -> gather; returns (info, layout, gathered)."""
    info = inspect_adapter(adapter.path, adapter.model, LORA)
    layout = build_layout(adapter.model, list(info.layers))
    weights = load_adapter_weights(info, adapter.model)
    generator = torch.Generator().manual_seed(seed)
    need = layout.num_pages(PAGE_ELEMS)
    pool = torch.randn(adapter.model.num_layers, 3 * need + 7, PAGE_ELEMS, generator=generator)
    pages = torch.randperm(pool.shape[1], generator=generator)[:need].tolist()
    place_in_pool(pool, pages, weights, layout)
    return info, layout, gather_adapter(pool, pages, layout)


def full_delta(mats, entry) -> torch.Tensor:
    """``[d_out, d_in]``: the sum over slices of B_s.T @ A[rows of s], placed at the slice's columns."""
    d_out = entry.slices[-1].col + entry.slices[-1].b.cols
    delta = torch.zeros(d_out, entry.a.cols)
    for index, piece in enumerate(entry.slices):
        rows = mats.a[piece.a_row: piece.a_row + piece.rank]
        delta[piece.col: piece.col + piece.b.cols] += mats.b[index].T @ rows
    return delta


def assert_matches_peft(gathered: dict, layout, oracle: dict, check_delta: bool = True) -> None:
    entries = {(layer, e.target, e.expert): e for layer, e in layout.entries()}
    assert set(gathered) == set(entries) == set(oracle)
    for key, parts in oracle.items():
        entry, mats = entries[key], gathered[key]
        delta = full_delta(mats, entry)
        for part, (a, b_scaled, peft_delta) in parts.items():
            piece = entry.slices[part]
            torch.testing.assert_close(mats.a[piece.a_row: piece.a_row + piece.rank], a, rtol=0, atol=0)
            torch.testing.assert_close(mats.b[part], b_scaled, rtol=1e-6, atol=1e-7)
            if check_delta:
                cols = slice(piece.col, piece.col + piece.b.cols)
                torch.testing.assert_close(delta[cols], peft_delta, rtol=1e-5, atol=1e-6)
        for part in set(range(len(entry.slices))) - set(parts):  # a projection the adapter lacks
            assert entry.slices[part].rank == 0


# ---------------------------------------------------------------- formats


def test_fused_moe_with_rank_and_alpha_patterns(tmp_path):
    adapter = pf.fused_moe_adapter(tmp_path / "a", rank_pattern={"gate_up_proj": 6}, alpha_pattern={"down_proj": 3})
    info, layout, gathered = round_trip(adapter)
    assert info.expert_format == "fused" and info.max_rank == 6
    assert info.layers[0][-2:] == (TargetSpec("experts.gate_up", (6,)), TargetSpec("experts.down", (4,)))
    assert_matches_peft(gathered, layout, peft_oracle(adapter.peft))


@pytest.mark.parametrize("param", pf.FUSED_EXPERTS)
def test_fused_moe_one_parameter_in_moe_layers_only(tmp_path, param):
    adapter = pf.fused_moe_adapter(tmp_path / "a", r=3, lora_alpha=5, target_parameters=[param],
                                   base={"mlp_only_layers": [0]})
    info, layout, gathered = round_trip(adapter)
    target = "experts.gate_up" if "gate_up" in param else "experts.down"
    assert [s.target for s in info.layers[0]] == pf.ATTENTION  # dense layer: no experts
    assert [s.target for s in info.layers[1]] == pf.ATTENTION + [target]
    assert_matches_peft(gathered, layout, peft_oracle(adapter.peft))


@pytest.mark.parametrize("style", ["qwen", "mixtral"])
def test_per_expert_moe_with_different_gate_and_up_ranks(tmp_path, style):
    up = "up_proj" if style == "qwen" else "w3"
    adapter = pf.per_expert_adapter(tmp_path / "a", style=style, r=4, lora_alpha=6,
                                    rank_pattern={up: 2}, alpha_pattern={"experts.1." + up: 9})
    info, layout, gathered = round_trip(adapter)
    assert info.expert_format == "per_expert"
    assert TargetSpec("experts.gate_up", (4, 2)) in info.layers[1]
    assert_matches_peft(gathered, layout, peft_oracle(adapter.peft))


def test_per_expert_gate_only_gets_a_rank_zero_up_slice(tmp_path):
    adapter = pf.per_expert_adapter(tmp_path / "a", target_modules=["gate_proj", "down_proj"])
    info, layout, gathered = round_trip(adapter)
    assert info.layers[0] == (TargetSpec("experts.gate_up", (4, 0)), TargetSpec("experts.down", (4,)))
    assert_matches_peft(gathered, layout, peft_oracle(adapter.peft))


def test_per_expert_matches_peft_conversion_to_fused_v5_model(tmp_path):
    """PEFT converts a v4 per-expert adapter when loading it on the v5 Qwen3-MoE: a second oracle."""
    adapter = pf.per_expert_adapter(tmp_path / "a", r=4, lora_alpha=8)
    _, layout, gathered = round_trip(adapter)
    base, _ = pf.qwen3_moe_base()
    converted = PeftModel.from_pretrained(base, adapter.path)
    oracle = peft_oracle(converted)
    assert {key for key in oracle} == set(gathered)
    for layer, entry in layout.entries():
        key = (layer, entry.target, entry.expert)
        peft_delta = oracle[key][0][2]
        torch.testing.assert_close(full_delta(gathered[key], entry), peft_delta, rtol=1e-5, atol=1e-6)


def test_dense_rslora_alpha_not_r(tmp_path):
    adapter = pf.dense_adapter(tmp_path / "a", r=8, lora_alpha=5, use_rslora=True)
    info, layout, gathered = round_trip(adapter)
    assert (info.rank, info.alpha, info.use_rslora, info.expert_format) == (8, 5.0, True, None)
    assert info.targets == tuple(pf.ATTENTION) + ("gate_proj", "up_proj", "down_proj")
    assert_matches_peft(gathered, layout, peft_oracle(adapter.peft))


def test_dense_rank_and_alpha_patterns_and_layers_to_transform(tmp_path):
    adapter = pf.dense_adapter(
        tmp_path / "a", r=4, lora_alpha=8, layers_to_transform=[1],
        rank_pattern={"q_proj": 2, "model.layers.1.mlp.down_proj": 12, r"layers\.\d+\.self_attn\.v_proj": 6},
        alpha_pattern={"o_proj": 3, "down_proj": 5, "mlp.up_proj": 7})
    info, layout, gathered = round_trip(adapter)
    assert info.layers[0] == () and layout.layers[0].size == 0
    ranks = {s.target: s.ranks[0] for s in info.layers[1]}
    assert ranks == {"q_proj": 2, "k_proj": 4, "v_proj": 6, "o_proj": 4, "gate_proj": 4, "up_proj": 4,
                     "down_proj": 12}
    assert info.max_rank == 12
    assert_matches_peft(gathered, layout, peft_oracle(adapter.peft))


def test_attention_only(tmp_path):
    adapter = pf.dense_adapter(tmp_path / "a", r=16, lora_alpha=16, target_modules=pf.ATTENTION)
    info, layout, gathered = round_trip(adapter)
    assert info.targets == tuple(pf.ATTENTION)
    assert_matches_peft(gathered, layout, peft_oracle(adapter.peft))


def test_bfloat16_adapter_loads_as_fp32(tmp_path):
    adapter = pf.dense_adapter(tmp_path / "a", r=4, target_modules=["q_proj", "down_proj"], dtype=torch.bfloat16)
    info = inspect_adapter(adapter.path, adapter.model, LORA)
    weights = load_adapter_weights(info, adapter.model)
    assert all(m.a.dtype == torch.float32 for m in weights.values())
    _, layout, gathered = round_trip(adapter)
    assert_matches_peft(gathered, layout, peft_oracle(adapter.peft), check_delta=False)


def test_several_adapters_share_one_pool(tmp_path):
    adapters = [
        pf.fused_moe_adapter(tmp_path / "fused", seed=1, r=2),
        pf.fused_moe_adapter(tmp_path / "fused8", seed=2, r=8, lora_alpha=3, use_rslora=True),
        pf.per_expert_adapter(tmp_path / "per_expert", seed=3, r=5, lora_alpha=10),
        pf.fused_moe_adapter(tmp_path / "attention", seed=4, r=16, target_parameters=None),
    ]
    plans = []
    for adapter in adapters:
        info = inspect_adapter(adapter.path, adapter.model, LORA)
        plans.append((info, build_layout(adapter.model, list(info.layers))))
    need = [layout.num_pages(PAGE_ELEMS) for _, layout in plans]
    generator = torch.Generator().manual_seed(7)
    pool = torch.randn(2, sum(need) + 11, PAGE_ELEMS, generator=generator)
    free = torch.randperm(pool.shape[1], generator=generator).tolist()
    tables = [free[sum(need[:i]): sum(need[:i + 1])] for i in range(len(need))]
    for adapter, (info, layout), table in zip(adapters, plans, tables):
        place_in_pool(pool, table, load_adapter_weights(info, adapter.model), layout)
    for adapter, (_, layout), table in zip(adapters, plans, tables):
        assert_matches_peft(gather_adapter(pool, table, layout), layout, peft_oracle(adapter.peft))


# ---------------------------------------------------------------- info and paths


def test_info_digest_size_and_realpath(tmp_path):
    adapter = pf.dense_adapter(tmp_path / "real", r=2, target_modules=["q_proj"])
    os.symlink(tmp_path / "real", tmp_path / "link")
    info = inspect_adapter(tmp_path / "link", adapter.model, LORA)
    config = (tmp_path / "real" / "adapter_config.json").read_bytes()
    weights = (tmp_path / "real" / "adapter_model.safetensors").read_bytes()
    assert info.path == os.path.realpath(tmp_path / "real")
    assert info.digest == hashlib.sha256(config + weights).hexdigest()
    assert info.file_bytes == len(weights)
    assert info == inspect_adapter(adapter.path, adapter.model, LORA)  # pure: same answer twice


def test_different_content_different_digest(tmp_path):
    first = pf.dense_adapter(tmp_path / "a", seed=1, r=2, target_modules=["q_proj"])
    second = pf.dense_adapter(tmp_path / "b", seed=2, r=2, target_modules=["q_proj"])
    digests = {inspect_adapter(a.path, a.model, LORA).digest for a in (first, second)}
    assert len(digests) == 2


def test_resolve_inside_roots(tmp_path):
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    os.symlink(root / "b", root / "a" / "to_b")
    roots = (str(root),)
    assert resolve_adapter_dir(root / "a" / ".." / "b", roots) == os.path.realpath(root / "b")
    assert resolve_adapter_dir(root / "a" / "to_b", roots) == os.path.realpath(root / "b")
    assert resolve_adapter_dir(root / "a", ()) == os.path.realpath(root / "a")


# ---------------------------------------------------------------- PEFT's pattern matching

NAMES = ["model.layers.0.self_attn.q_proj", "model.layers.10.self_attn.q_proj", "model.layers.1.mlp.down_proj",
         "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.3.up_proj",
         "model.layers.0.block_sparse_moe.experts.2.w3"]
KEYS = ["q_proj", "self_attn.q_proj", "layers.1.self_attn.q_proj", "model.layers.0.self_attn.q_proj",
        r"layers\.1\d*\..*q_proj", "^model.layers.0.self_attn.q_proj", "gate_up_proj", r".*\.gate_up_proj",
        "experts.3.up_proj", "up_proj", "p_proj", "proj", "down_proj", "w3", "experts.2.w3", "layers.1.mlp.down_proj"]


@settings(max_examples=300, deadline=None)
@given(keys=st.lists(st.sampled_from(KEYS), unique=True, max_size=5), name=st.sampled_from(NAMES))
def test_pattern_matching_agrees_with_peft(keys, name):
    patterns = {key: index + 2 for index, key in enumerate(keys)}
    expected = patterns.get(get_pattern_key(patterns.keys(), name), 1)
    assert _pattern_value(patterns, name, 1) == expected
