"""`LoraTables`: per-slot updates equal a full build, tables sized to capacities, a signature that
only grows (CUDA graphs), rewritten in place while it holds."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from unipage.kernels import dense_lora_meta, moe_lora_meta
from unipage.kernels.moe_lora_plan import lora_pads
from unipage.kernels.lora_meta import next_pow2

from unipage.config import ModelConfig
from unipage.graphs import bucket_sizes
from unipage.lora_layout import TargetSpec, build_layout
from unipage.models import lora_tables
from unipage.models.lora_buffer import TableBuffer
from unipage.models.lora_rows import GROUPS, model_groups
from unipage.models.lora_tables import MIN_PAGES, MIN_SLOTS, LoraTables, largest_layout

MODEL = ModelConfig(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32, num_experts=4,
                    top_k=2, expert_intermediate_size=32, dtype="float32")
FAMILIES = {  # tiny shapes of the three kinds of model the engine serves
    "llama": ModelConfig(num_layers=3, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32,
                         intermediate_size=96, dtype="float32"),
    "qwen3_moe": ModelConfig(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                             intermediate_size=96, num_experts=4, top_k=2, expert_intermediate_size=32,
                             mlp_only_layers=(1,), dtype="float32"),
    "gpt_oss": ModelConfig(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32, num_experts=4,
                           top_k=2, expert_intermediate_size=48, gate_up_interleaved=True, dtype="float32"),
}


def _layout(rank: int, experts: bool = True):
    layer = [TargetSpec("q_proj", (rank,)), TargetSpec("v_proj", (rank,))]
    if experts:
        layer += [TargetSpec("experts.gate_up", (rank,), shared_a=True), TargetSpec("experts.down", (rank,))]
    return build_layout(MODEL, [tuple(layer)] * MODEL.num_layers)


def _tensors(tables: LoraTables) -> list[torch.Tensor]:
    out = [tables.page_table]
    for layer in tables.layers:
        out += [layer.qkv.rank, layer.qkv.a_offset, layer.qkv.b_offset, layer.o.rank, layer.moe.table,
                layer.moe.slot_flags]
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
    assert tables.page_table.shape == (MIN_SLOTS, MIN_PAGES)  # capacities, not the two slots in use
    tables.release(1)
    tables.assign(2, [9, 3], _layout(6))  # another adapter, other pages and ranks, the same rank block and tiles
    tables.refresh()
    assert tables.generation == generation
    assert all(a.data_ptr() == b.data_ptr() and a.shape == b.shape for a, b in zip(_tensors(tables), before))
    assert all(a is b for a, b in zip(_tensors(tables)[:5], before[:5]))  # the same tensor objects, too
    fresh = _fresh({0: ([5, 6], _layout(8)), 2: ([9, 3], _layout(6))})
    for got, want in zip(_tensors(tables), _tensors(fresh)):
        assert torch.equal(got, want)
    assert tables.layers[0].qkv.ranks == fresh.layers[0].qkv.ranks  # host copies are current too
    assert tables.layers[0].qkv.ranks[1] == (0, 0, 0)  # released


@pytest.mark.parametrize("change", ["rank_block", "tile_rank", "slots", "pages"])
def test_growing_needs_make_a_new_signature(change):
    tables = _fresh({0: ([1], _layout(8))})
    generation = tables.generation
    if change == "rank_block":
        tables.assign(0, [1], _layout(32))
    elif change == "tile_rank":  # rank 8 -> 16: the same 16-row pads, taller pair-mode tiles
        pads = lora_pads(tables.layers[0].moe)
        tables.assign(0, [1], _layout(16))
        assert lora_pads(tables.layers[0].moe) == pads and tables.layers[0].qkv.rank_block == 16
    elif change == "slots":
        tables.assign(MIN_SLOTS, [2], _layout(8))
    else:
        tables.assign(1, list(range(10, 20)), _layout(8))
    tables.refresh()
    assert tables.generation == generation + 1
    assert tables.page_table.shape == ((4 * MIN_SLOTS if change == "slots" else MIN_SLOTS),
                                       (16 if change == "pages" else MIN_PAGES))


@pytest.mark.parametrize("change", ["no_experts", "smaller_rank", "empty", "low_slots"])
def test_releases_never_change_the_signature(change):
    """Launch values are high-water marks: an adapter leaving, or a smaller one, keeps every shape."""
    tables = _fresh({0: ([1], _layout(32)), 2 * MIN_SLOTS: (list(range(2, 12)), _layout(8))})
    generation, before = tables.generation, _tensors(tables)
    rank_block = tables.layers[0].qkv.rank_block
    if change == "no_experts":
        tables.assign(0, [1], _layout(8, experts=False))
        tables.release(2 * MIN_SLOTS)
    elif change == "smaller_rank":
        tables.assign(0, [1], _layout(4))
    elif change == "empty":
        tables.release(0)
        tables.release(2 * MIN_SLOTS)
    else:
        tables.release(2 * MIN_SLOTS)
    assert tables.refresh() == (change != "empty")
    assert tables.generation == generation and tables.layers[0].qkv.rank_block == rank_block == 32
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(_tensors(tables), before))
    assert tables.layers[1].moe.any_lora and tables.layers[1].moe.max_down_rank == 32
    if change == "empty":
        assert not tables.page_table.any() and not tables.layers[0].moe.slot_flags.any()


def test_capacities_given_up_front_never_grow():
    largest = largest_layout(MODEL, 32)
    assert largest.layers[0].targets[("experts.gate_up", 0)].a.rows == 64  # gate and up slices: 2r rows
    tables = LoraTables(MODEL, torch.device("cpu"), slots=100, max_rank=32, page_elems=64)
    for slot in range(100):
        layout = largest if slot % 2 else _layout(4 + slot % 29, experts=slot % 3 > 0)
        tables.assign(slot, list(range(layout.num_pages(64))), layout)
        if slot % 7 == 6:
            tables.release(slot // 2)
        assert tables.refresh()
        assert tables.generation == 1 and tables.page_table.shape == (128, next_pow2(largest.num_pages(64)))
        assert tables.layers[1].qkv.rank_block == 32 and lora_pads(tables.layers[1].moe) == (64, 32, 32)


# -- per-slot updates equal a full build ---------------------------------------------------


def _random_layout(model: ModelConfig, rng: random.Random):
    """An adapter with a random subset of targets, ranks and expert format; some layers lack a target."""
    dense = [t for t in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
             if rng.random() < 0.6]
    experts = rng.choice(["none", "fused", "per_expert"]) if model.num_experts else "none"
    if experts == "per_expert" and model.gate_up_interleaved:
        experts = "fused"  # GPT-OSS adapters are fused-format only

    def rank() -> int:
        return rng.choice([1, 2, 4, 8, 12, 16, 24, 40])

    layers = []
    for layer in range(model.num_layers):
        targets = model.targets(layer)
        specs = [TargetSpec(t, (rank(),)) for t in dense if t in targets and rng.random() < 0.9]
        if experts != "none" and model.is_moe_layer(layer):
            gate_up = (rank(),) if experts == "fused" else (rank(), rng.choice([0, rank()]))
            specs += [TargetSpec("experts.gate_up", gate_up), TargetSpec("experts.down", (rank(),))]
        layers.append(tuple(specs))
    return build_layout(model, layers)


def _full_build(model: ModelConfig, resident: dict, slots: int, width: int):
    """The old way: page table and every layer's metadata rebuilt from every slot."""
    layouts, table = [None] * slots, torch.zeros(slots, width, dtype=torch.int32)
    for slot, (pages, layout) in resident.items():
        layouts[slot] = layout
        table[slot, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
    layers = []
    for layer in range(model.num_layers):
        names = ("qkv", "o") if model.is_moe_layer(layer) else ("qkv", "o", "gate_up", "down")
        dense = {name: dense_lora_meta(layouts, layer, dict(GROUPS)[name], "cpu", model) for name in names}
        layers.append((dense, moe_lora_meta(layouts, layer) if model.is_moe_layer(layer) else None))
    return table, layers


def _check_against_full_builds(tables: LoraTables, model, resident: dict, history: list) -> None:
    """Tensors and host copies equal a full build over the resident slots; launch values equal a full
    build over every adapter assigned so far (high-water marks)."""
    slots, width = tables.page_table.shape
    table, want = _full_build(model, resident, slots, width)
    seen = {id(layout): layout for layout in history}.values()  # launch values depend on layouts alone
    _, marks = _full_build(model, {i: ([], layout) for i, layout in enumerate(seen)}, len(seen), width)
    assert torch.equal(tables.page_table, table)
    for got, (dense, moe), (mark_dense, mark_moe) in zip(tables.layers, want, marks):
        for name, meta in dense.items():
            _check_dense(getattr(got, name), meta, mark_dense[name])
        assert (got.gate_up is None) == ("gate_up" not in dense) and (got.moe is None) == (moe is None)
        if moe is not None:
            _check_moe(got.moe, moe, mark_moe)


def _check_dense(got, want, mark) -> None:
    for name in ("rank", "a_offset", "b_offset"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.ranks == want.ranks and got.a_offsets == want.a_offsets and got.b_offsets == want.b_offsets
    for name in ("targets", "d_in", "slice_cols", "slice_starts"):
        assert getattr(got, name) == getattr(want, name), name
    assert (got.max_rank, got.rank_block, got.buffer_elems) == (mark.max_rank, mark.rank_block, mark.buffer_elems)
    assert got.max_rank >= want.max_rank and got.buffer_elems >= want.buffer_elems
    for block_n, tiles in want.col_tiles.items():
        assert torch.equal(got.col_tiles[block_n], tiles)


def _check_moe(got, want, mark) -> None:
    assert torch.equal(got.table, want.table) and torch.equal(got.slot_flags, want.slot_flags)
    fields = ("hidden", "inter", "num_experts", "max_gate_up_rows", "max_gate_up_rank", "max_down_rank", "any_lora")
    assert [getattr(got, f) for f in fields] == [getattr(mark, f) for f in fields]
    assert lora_pads(got) == lora_pads(mark) and got.num_lora_slots >= want.num_lora_slots


@pytest.mark.parametrize("mirror", [False, True], ids=["in_place", "mirrored"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_per_slot_updates_equal_a_full_build(family, mirror, monkeypatch):
    """A random run of loads, reloads and evictions (lowest free slot first, as the adapter manager
    does); after every refresh the tables equal full builds.  ``mirrored``: a separate buffer that
    only `upload` fills, as on CUDA."""
    if mirror:
        monkeypatch.setattr(lora_tables, "TableBuffer", functools.partial(TableBuffer, mirror=True))
    model, rng = FAMILIES[family], random.Random(family)
    tables = LoraTables(model, torch.device("cpu"))
    layouts = [_random_layout(model, rng) for _ in range(12)]
    resident, history, pointers, settled = {}, [], {}, None
    for step in range(120):
        for _ in range(rng.randint(1, 3)):
            free = [s for s in range(len(resident) + 1) if s not in resident]
            if resident and (rng.random() < 0.45 or len(resident) > 20):
                slot = rng.choice(sorted(resident))
                tables.release(slot)
                del resident[slot]
            else:
                layout = rng.choice(layouts)
                pages = rng.sample(range(1000), layout.num_pages(64))
                slot = min(free)
                tables.assign(slot, pages, layout)
                resident[slot] = (pages, layout)
                history.append(layout)
        generation = tables.generation
        assert tables.refresh() == bool(resident)
        _check_against_full_builds(tables, model, resident, history)
        now = [t.data_ptr() for t in _all_tensors(tables)]
        if tables.generation == generation:  # what a captured graph points at is still there
            assert now == pointers.get(generation)
        pointers[tables.generation] = now
        if settled is None and len({id(x) for x in history}) == len(layouts) and tables.num_slots > 2 * MIN_SLOTS:
            settled = tables.generation  # every adapter seen, the slot capacity past what the run needs
        assert settled in (None, tables.generation)  # from then on: no new shape, whatever comes and goes
    assert settled is not None


def _all_tensors(tables: LoraTables) -> list[torch.Tensor]:
    out = [tables.page_table]
    for layer in tables.layers:
        for meta in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if meta is not None:
                out += [meta.rank, meta.a_offset, meta.b_offset, *meta.col_tiles.values()]
        if layer.moe is not None:
            out += [layer.moe.table, layer.moe.slot_flags]
    return out


def test_a_layout_of_another_model_is_refused():
    tables = LoraTables(FAMILIES["llama"], torch.device("cpu"))
    with pytest.raises(ValueError, match="layers"):
        tables.assign(0, [1], _layout(4))


def test_bucket_sizes_cover_every_batch():
    sizes = bucket_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256 and sizes == sorted(set(sizes))
    assert bucket_sizes(1) == [1] and bucket_sizes(5) == [1, 2, 4, 5]
    for count in range(1, 257):
        bucket = next(b for b in sizes if b >= count)
        assert bucket - count <= max(8, count // 4)  # padding stays small




class _DoneEvent:
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def test_uploads_stage_in_one_contiguous_buffer(monkeypatch):
    """A strided staging view would make the device copy go through a temporary, unpinned copy.
    (On CPU: no pinning and no events; the staging logic is the same.)"""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    monkeypatch.setattr(torch.cuda, "Event", _DoneEvent)
    buf = TableBuffer(model_groups(MODEL), 8, 4, torch.device("cpu"), mirror=True)
    first = None
    for n in (5, 700, 3000):  # the last one grows the buffer
        values = torch.randint(0, 1000, (2, n)).numpy()
        staged = buf._staged(values)
        assert staged.is_contiguous() and staged.shape == (2, n)
        assert torch.equal(staged, torch.from_numpy(values)) and staged.data_ptr() == buf._stage.data_ptr()
        first = first or buf._stage.data_ptr()
        assert (buf._stage.data_ptr() == first) == (n < 3000)
