"""`LoraTables`: tables sized to capacities, rewritten in place while their signature holds (CUDA graphs)."""

from __future__ import annotations

import pytest
import torch

from unipage.config import ModelConfig
from unipage.graphs import bucket_sizes
from unipage.lora_layout import TargetSpec, build_layout
from unipage.models.lora_tables import MIN_SLOTS, LoraTables

MODEL = ModelConfig(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32, num_experts=4,
                    top_k=2, expert_intermediate_size=32, dtype="float32")


def _layout(rank: int, experts: bool = True):
    layer = [TargetSpec("q_proj", (rank,)), TargetSpec("v_proj", (rank,))]
    if experts:
        layer += [TargetSpec("experts.gate_up", (rank,), shared_a=True), TargetSpec("experts.down", (rank,))]
    return build_layout(MODEL, [tuple(layer)] * MODEL.num_layers)


def _tensors(tables: LoraTables) -> list[torch.Tensor]:
    out = [tables.page_table]
    for layer in tables.layers:
        out += [layer.qkv.rank, layer.qkv.a_offset, layer.qkv.b_offset, layer.o.rank, layer.moe.table]
    return out


def _fresh(slots: dict) -> LoraTables:
    tables = LoraTables(MODEL, torch.device("cpu"))
    for slot, (pages, layout) in slots.items():
        tables.assign(slot, pages, layout)
    tables.refresh()
    return tables


def test_same_signature_rewrites_the_same_tensors():
    tables = LoraTables(MODEL, torch.device("cpu"))
    tables.assign(0, [5, 6], _layout(8))
    tables.assign(1, [7], _layout(4))
    assert tables.refresh()
    generation, before = tables.generation, _tensors(tables)
    assert tables.page_table.shape[0] == MIN_SLOTS  # a capacity, not the two slots in use
    tables.release(1)
    tables.assign(2, [9, 3], _layout(12))  # another adapter, other pages and ranks, the same rank block
    tables.refresh()
    assert tables.generation == generation
    assert all(a is b for a, b in zip(_tensors(tables), before))  # what a captured graph points at
    fresh = _fresh({0: ([5, 6], _layout(8)), 2: ([9, 3], _layout(12))})
    for got, want in zip(_tensors(tables), _tensors(fresh)):
        assert torch.equal(got, want)
    assert tables.layers[0].qkv.ranks == fresh.layers[0].qkv.ranks  # host copies are current too


@pytest.mark.parametrize("change", ["rank_block", "slots", "pages", "no_experts", "empty"])
def test_a_new_signature_makes_new_tensors(change):
    tables = _fresh({0: ([1], _layout(8))})
    generation = tables.generation
    if change == "rank_block":
        tables.assign(0, [1], _layout(32))
    elif change == "slots":
        tables.assign(MIN_SLOTS, [2], _layout(8))
    elif change == "pages":
        tables.assign(1, list(range(10, 20)), _layout(8))
    elif change == "no_experts":
        tables.assign(0, [1], _layout(8, experts=False))
    else:
        tables.release(0)
    tables.refresh()
    assert tables.generation == generation + 1


def test_bucket_sizes_cover_every_batch():
    sizes = bucket_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256 and sizes == sorted(set(sizes))
    assert bucket_sizes(1) == [1] and bucket_sizes(5) == [1, 2, 4, 5]
    for count in range(1, 257):
        bucket = next(b for b in sizes if b >= count)
        assert bucket - count <= max(8, count // 4)  # padding stays small
