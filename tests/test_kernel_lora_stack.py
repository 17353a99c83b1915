"""The dense LoRA expand from a shrink stack (`kernels.lora_stack`), Triton interpreter at tiny shapes,
against its reference and against the paged shrink-and-expand it replaces."""

from __future__ import annotations

import pytest
import torch
from test_kernel_lora import MIXES, QKV, assert_close, assert_untouched, build_world, plan, tiny_model, token_mix
from unipage.adapter_pack import pack_adapter, random_lora_weights
from unipage.kernels.lora import lora_shrink_expand_ref
from unipage.kernels.lora_meta import dense_lora_meta
from unipage.kernels.lora_stack import fill_entry, fill_entry_ref, lora_expand_stacked, lora_expand_stacked_ref
from unipage.lora_layout import TargetSpec, build_layout
from unipage.models.lora_tables import LoraTables

RANK_BLOCK = 32  # >= every rank of test_kernel_lora.SLOTS, and not the layers' own rank block (16)


def stack_world(dtype, entries=6, layer=0, targets=QKV, seed=1, count=12, mix="uniform"):
    """A world, its meta, an ext weight [n + K*J*RB, D] (W, then the slots' A rows at shuffled
    entries), x, the token slots and entry_of_slot."""
    world = build_world(dtype=dtype)
    meta = dense_lora_meta(world.layouts, layer, targets, device=world.pool.device, model=world.model)
    gen = torch.Generator().manual_seed(seed)
    live = [s for s, layout in enumerate(world.layouts) if layout is not None]
    slots = token_mix(mix, count, live, gen)
    width = meta.num_slices * RANK_BLOCK
    n = meta.out_cols
    ext = torch.randn(n + entries * width, meta.d_in, generator=gen).to(dtype)  # noise in unused entries
    ext[:n] *= 0.1
    entry_of_slot = torch.full((meta.num_slots + 3,), 99, dtype=torch.int32)  # (wrong for slots not used)
    for slot, entry in zip(live, torch.randperm(entries, generator=gen).tolist()):
        entry_of_slot[slot] = entry
        fill_entry(ext[n + entry * width:n + (entry + 1) * width], world.pool[layer], world.page_table, meta, slot)
    x = torch.randn(count, meta.d_in, generator=gen).to(dtype)
    return world, meta, ext, x, slots, entry_of_slot


def project(ext, x, n):
    """``(y, h)``: the projection and the stack's h, views of one GEMM's output as the engine runs it."""
    out = (x.float() @ ext.float().T).to(x.dtype)
    return out[:, :n], out[:, n:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # (bf16: the interpreter fails the paged path too)
@pytest.mark.parametrize("mix", MIXES)
def test_stacked_expand_matches_reference_and_the_paged_path(dtype, mix):
    world, meta, ext, x, slots, entry_of_slot = stack_world(dtype, mix=mix)
    n = meta.out_cols
    y0, h = project(ext, x, n)
    y0 = y0.clone()
    args = (entry_of_slot, world.pool[0], world.page_table, slots, meta)
    got = lora_expand_stacked(project(ext, x, n)[0], h, *args, rank_block=RANK_BLOCK, scale=0.5)
    want = lora_expand_stacked_ref(y0.clone(), h, *args, rank_block=RANK_BLOCK, scale=0.5)
    assert_close(got, want, y0)
    assert_untouched(got, y0, slots, meta)
    paged = lora_shrink_expand_ref(y0.clone(), x, world.pool[0], world.page_table, slots, meta, scale=0.5)
    assert_close(got, paged, y0)  # the same delta as the paged shrink (h rounded once either way)


@pytest.mark.parametrize("grouped", [False, True])
def test_both_expand_paths_and_a_layer_without_a_target(grouped):
    world, meta, ext, x, slots, entry_of_slot = stack_world(torch.float32, layer=1, count=20, mix="skewed")
    n = meta.out_cols
    y, h = project(ext, x, n)
    y0 = y.clone()
    args = (entry_of_slot, world.pool[1], world.page_table, slots, meta)
    batch = plan(slots, world, grouped)
    got = lora_expand_stacked(y, h, *args, rank_block=RANK_BLOCK, batch=batch)
    assert got.data_ptr() == y.data_ptr()  # in place, in the GEMM's output
    assert_close(got, lora_expand_stacked_ref(y0.clone(), h, *args, rank_block=RANK_BLOCK), y0)
    assert_untouched(got, y0, slots, meta)


def test_stacked_expand_takes_its_own_column_tile(monkeypatch):
    """Config ``"stacked_block_n"``: the stacked expand's column tile (its grid, ``BN`` and ``EVEN_N``), apart
    from ``block_n``, which the separate path's expand keeps; the result is the reference's either way."""
    from unipage.kernels import lora as lora_module
    from unipage.kernels import lora_plan

    lookup, seen, real = lora_plan.launch_config, [], lora_module.launch

    def spy(kernel, grid, *args, **kwargs):
        if kernel is lora_module._expand_kernel:
            seen.append((grid, kwargs["BN"], kwargs["EVEN_N"], kwargs.get("ENTRY", False)))
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(lora_module, "launch", spy)
    monkeypatch.setattr(lora_plan, "launch_config", lambda *a: lookup(*a) | {"block_n": 64, "stacked_block_n": 128})
    world, meta, ext, x, slots, entry_of_slot = stack_world(torch.float32, seed=4)
    n = meta.out_cols
    y0, h = project(ext, x, n)
    args = (entry_of_slot, world.pool[0], world.page_table, slots, meta)
    got = lora_expand_stacked(y0.clone(), h, *args, rank_block=RANK_BLOCK)
    assert_close(got, lora_expand_stacked_ref(y0.clone(), h, *args, rank_block=RANK_BLOCK), y0)
    paged = lora_module.lora_shrink_expand(y0.clone(), x, world.pool[0], world.page_table, slots, meta)
    assert_close(paged, got, y0)
    (grid, bn, even, entry), (paged_grid, paged_bn, _, paged_entry) = seen
    assert (bn, entry, paged_bn, paged_entry) == (128, True, 64, False)
    assert (grid[1], paged_grid[1]) == (meta.col_tile_table(128).shape[0], meta.col_tile_table(64).shape[0])
    assert even == all(c % 128 == 0 for c in meta.slice_cols)


def test_a_slot_without_an_entry_gets_no_delta():
    world, meta, ext, x, slots, entry_of_slot = stack_world(torch.float32, mix="distinct")
    y, h = project(ext, x, meta.out_cols)
    y0 = y.clone()
    entry_of_slot[1] = -1
    args = (entry_of_slot, world.pool[0], world.page_table, slots, meta)
    got = lora_expand_stacked(y, h, *args, rank_block=RANK_BLOCK)
    assert_close(got, lora_expand_stacked_ref(y0.clone(), h, *args, rank_block=RANK_BLOCK), y0)
    assert torch.equal(got[slots == 1], y0[slots == 1]) and (slots == 1).any()


@pytest.mark.parametrize("targets", [QKV, ("v_proj",)])
@pytest.mark.parametrize("d_in", [64, 96, 320])
def test_fill_kernel_matches_its_reference_on_every_slot_and_layer(d_in, targets):
    """Pages of 64 elements (an A row spans several), rows 128-aligned at d_in 96, a slot without k,
    layer 1 without v, an empty slot, one slice or three; the entry's rows start as noise."""
    world = build_world(d_in=d_in, dtype=torch.float16)
    for layer in (0, 1):
        meta = dense_lora_meta(world.layouts, layer, targets, device=world.pool.device, model=world.model)
        for slot, layout in enumerate(world.layouts):
            if layout is None:
                continue
            got, want = (torch.randn(meta.num_slices * RANK_BLOCK, d_in).half() for _ in range(2))
            fill_entry(got, world.pool[layer], world.page_table, meta, slot)
            fill_entry_ref(want, world.pool[layer], world.page_table, meta, slot)
            assert torch.equal(got, want), (layer, slot)


def test_fill_entry_zeroes_past_each_rank():
    world, meta, ext, x, slots, entry_of_slot = stack_world(torch.float32)
    rows = torch.randn(meta.num_slices * RANK_BLOCK, meta.d_in)
    fill_entry(rows, world.pool[0], world.page_table, meta, 1)  # ranks 4, 16, 4
    for j, rank in enumerate(meta.ranks[1]):
        block = rows[j * RANK_BLOCK:(j + 1) * RANK_BLOCK]
        assert block[:rank].abs().sum() > 0 and not block[rank:].any()


def test_bad_arguments_raise_value_errors():
    world, meta, ext, x, slots, entry_of_slot = stack_world(torch.float32)
    y, h = project(ext, x, meta.out_cols)
    args = (world.pool[0], world.page_table, slots, meta)
    with pytest.raises(ValueError, match="h"):
        lora_expand_stacked(y, h[:, 1:], entry_of_slot, *args, rank_block=RANK_BLOCK)
    with pytest.raises(ValueError, match="rank_block"):
        lora_expand_stacked(y, h, entry_of_slot, *args, rank_block=8)
    with pytest.raises(ValueError, match="entry_of_slot"):
        lora_expand_stacked(y, h, entry_of_slot.long(), *args, rank_block=RANK_BLOCK)
    with pytest.raises(ValueError, match="entry_of_slot"):
        lora_expand_stacked_ref(y, h, torch.full_like(entry_of_slot, 40), *args, rank_block=RANK_BLOCK)
    with pytest.raises(ValueError, match="rank block"):
        fill_entry(torch.zeros(meta.num_slices * 8, meta.d_in), world.pool[0], world.page_table, meta, 1)
    rows = torch.zeros(meta.num_slices * RANK_BLOCK, meta.d_in)
    with pytest.raises(ValueError, match="power-of-two page_elems"):
        fill_entry(rows, world.pool[0][:, :48].contiguous(), world.page_table, meta, 1)
    with pytest.raises(ValueError, match="slot"):
        fill_entry(rows, world.pool[0], world.page_table, meta, len(world.layouts))


def test_fill_kernel_through_the_engines_tables():
    """`LoraTables` (what the engine's stack reads): q/k/v and o of two layers, three adapters at shuffled
    pages, the kernel against its reference on each slot."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(5)
    page, targets = 64, ("q_proj", "k_proj", "v_proj", "o_proj")
    layouts = [build_layout(model, [tuple(TargetSpec(t, (r,)) for t in targets)] * 2) for r in (4, 8, 16)]
    sizes = [layout.num_pages(page) for layout in layouts]
    pool = torch.randn(2, sum(sizes) + 7, page, generator=gen).half()
    order = torch.randperm(pool.shape[1], generator=gen).tolist()
    tables = LoraTables(model, "cpu")
    for slot, (layout, size) in enumerate(zip(layouts, sizes)):
        pages, order = order[:size], order[size:]
        pool[:, pages] = pack_adapter(layout, random_lora_weights(layout, gen), page, torch.float16)
        tables.assign(slot, pages, layout)
    tables.refresh()
    for i, lora in enumerate(tables.layers):
        for meta in (lora.qkv, lora.o):
            for slot in range(3):
                got, want = (torch.randn(meta.num_slices * RANK_BLOCK, meta.d_in).half() for _ in range(2))
                fill_entry(got, pool[i], tables.page_table, meta, slot)
                fill_entry_ref(want, pool[i], tables.page_table, meta, slot)
                assert torch.equal(got, want) and got.any(), (i, meta.targets, slot)
