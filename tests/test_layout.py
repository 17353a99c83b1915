"""The adapter buffer layout: exact offsets on a small case, and invariants on random shapes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unipage.adapter_pack import gather_adapter, pack_adapter, random_lora_weights
from unipage.config import ModelConfig
from unipage.lora_layout import TargetSpec, build_layout, round_up

MOE = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                  num_experts=3, top_k=2, expert_intermediate_size=40, mlp_only_layers=(1,))


def test_exact_offsets():
    layout = build_layout(MOE, [
        (TargetSpec("q_proj", (8,)), TargetSpec("experts.gate_up", (4, 2)), TargetSpec("experts.down", (4,))),
        (TargetSpec("down_proj", (16,)),)])
    layer0 = layout.layers[0]
    q = layer0.targets[("q_proj", -1)]
    assert (q.a.offset, q.a.rows, q.a.stride, q.slices[0].b.offset) == (0, 8, 64, 512)
    gate_up = layer0.targets[("experts.gate_up", 0)]
    assert (gate_up.a.offset, gate_up.a.rows) == (1024, 6)  # gate A (4 rows) over up A (2 rows)
    gate, up = gate_up.slices
    assert (gate.a_row, gate.col, gate.b.offset, gate.b.cols, gate.b.stride) == (0, 0, 1408, 40, 64)
    assert (up.a_row, up.col, up.b.offset, up.rank) == (4, 40, 1664, 2)
    down = layer0.targets[("experts.down", 0)]
    assert (down.a.offset, down.slices[0].b.offset) == (1792, 2048)
    assert (layer0.expert_base, layer0.expert_stride) == (1024, 1280)
    assert layer0.targets[("experts.gate_up", 2)].a.offset == 1024 + 2 * 1280
    assert layer0.size == 1024 + 3 * 1280
    assert layout.layers[1].size == 16 * 128 + 16 * 64
    assert layout.layer_elems == 4864 and layout.num_pages(1024) == 5


def test_fused_gate_up_is_one_slice_over_both_halves():
    layout = build_layout(MOE, [(TargetSpec("experts.gate_up", (4,)),), ()])
    [piece] = layout.layers[0].targets[("experts.gate_up", 0)].slices
    assert (piece.col, piece.b.cols, piece.rank) == (0, 80, 4)


def test_wrong_specs_are_refused():
    with pytest.raises(ValueError, match="layers"):
        build_layout(MOE, [()])
    with pytest.raises(ValueError, match="no LoRA target"):
        build_layout(MOE, [(TargetSpec("gate_proj", (4,)),), ()])
    with pytest.raises(ValueError, match="do not split"):
        build_layout(MOE, [(TargetSpec("experts.gate_up", (1, 1, 1)),), ()])


@st.composite
def models_and_specs(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    experts = draw(st.sampled_from([0, 2, 5]))
    num_layers = draw(st.integers(1, 4))
    sliding = tuple(draw(st.sets(st.integers(0, num_layers - 1))))  # with full layers too: two share a row
    model = ModelConfig(num_layers=num_layers, hidden_size=draw(st.integers(8, 200)),
                        num_heads=heads, num_kv_heads=draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0])),
                        head_dim=draw(st.integers(4, 40)), intermediate_size=draw(st.integers(8, 150)),
                        num_experts=experts, top_k=min(experts, 1),
                        expert_intermediate_size=draw(st.integers(4, 70)) if experts else 0,
                        sliding_layers=sliding, sliding_window=4 if sliding else 0)
    layers = []
    for layer in range(model.num_layers):
        specs = []
        for target in model.targets(layer):
            if draw(st.booleans()):
                continue
            if target == "experts.gate_up" and draw(st.booleans()):
                specs.append(TargetSpec(target, (draw(st.integers(0, 9)), draw(st.integers(1, 9)))))
            else:
                specs.append(TargetSpec(target, (draw(st.integers(1, 17)),)))
        layers.append(tuple(specs))
    return model, layers


@settings(max_examples=200, deadline=None)
@given(models_and_specs())
def test_blocks_are_aligned_disjoint_and_inside_the_layer(case):
    model, layers = case
    layout = build_layout(model, layers)
    assert layout.num_rows == model.pool_rows and layout.rows == model.layer_rows
    row_spans: dict[int, list] = {}
    for index, layer in enumerate(layout.layers):
        spans = row_spans.setdefault(layout.rows[index], [])  # the layers sharing a row share its buffer
        for entry in layer.targets.values():
            d_in, d_out = model.target_dims(entry.target, index)
            assert entry.a.cols == d_in
            assert sum(s.b.cols for s in entry.slices) == d_out
            for block in entry.blocks:
                assert block.offset % 64 == 0 and block.stride == round_up(block.cols) >= block.cols
                spans.append((block.offset, block.offset + block.size))
            for piece in entry.slices:
                assert piece.a_row + piece.rank <= entry.a.rows
            if entry.expert >= 0:
                first = layer.targets[(entry.target, 0)]
                assert entry.a.offset == first.a.offset + entry.expert * layer.expert_stride
        assert all(0 <= start and end <= layer.size <= layout.layer_elems for start, end in spans)
    for spans in row_spans.values():
        spans.sort()
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), "blocks overlap"


def test_layers_sharing_a_pool_row_pack_into_one_buffer_and_read_back():
    """GPT-OSS-like: layer 0 slides, layer 1 does not; both live in pool row 0, one after the other."""
    model = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=96, sliding_layers=(0,), sliding_window=8, dtype="float32")
    layers = [(TargetSpec("q_proj", (4,)), TargetSpec("down_proj", (2,)))] * 2
    layout = build_layout(model, layers)
    assert layout.rows == (0, 0) and layout.num_rows == 1
    assert layout.layers[1].targets[("q_proj", -1)].a.offset == layout.layers[0].size
    weights = random_lora_weights(layout, torch.Generator().manual_seed(0))
    packed = pack_adapter(layout, weights, 256, torch.float32)
    assert packed.shape == (1, layout.num_pages(256), 256)
    pool = torch.randn(1, 40, 256)
    pages = [37, 3, 21, 8, 30, 12, 25, 1, 17][:layout.num_pages(256)]
    assert len(pages) == layout.num_pages(256)
    pool[:, pages] = packed
    back = gather_adapter(pool, pages, layout)
    for key, mats in weights.items():
        assert torch.equal(back[key].a, mats.a) and all(map(torch.equal, back[key].b, mats.b))
