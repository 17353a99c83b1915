"""The residual add and RMSNorm with a stacked o projection's LoRA expand folded in (`kernels.norm_lora`),
Triton interpreter at tiny shapes, against its reference and against the two launches it replaces."""

from __future__ import annotations

import pytest
import torch
from test_kernel_lora import MIXES, build_world, token_mix

from unipage.kernels import norm_lora
from unipage.kernels.elementwise import add_rms_norm_ref
from unipage.kernels.lora_meta import dense_lora_meta
from unipage.kernels.lora_stack import lora_expand_stacked
from unipage.kernels.norm_lora import add_rms_norm_stacked, add_rms_norm_stacked_ref

RANK_BLOCK = 16
# slot -> ranks (None: empty); slot 3 has no o_proj (rank 0), slot 1 the largest rank
SLOTS = [{"o_proj": 8}, {"o_proj": 16}, None, {"q_proj": 8}, {"o_proj": 4}]
EPS = 1e-6


def world_and_inputs(dtype, hidden=64, count=12, mix="uniform", layer=0, seed=1, entries=6, device="cpu"):
    """A world of o_proj adapters (layer 1 drops o_proj), its meta, and random inputs: the residual stream, the
    projection y, the stack's h (noise in unused entries), the norm's weight, the token slots, entry_of_slot."""
    world = build_world(SLOTS, d_in=hidden, dtype=dtype, layer1_drop="o_proj")
    world.pool, world.page_table = world.pool.to(device), world.page_table.to(device)
    meta = dense_lora_meta(world.layouts, layer, ("o_proj",), device=world.pool.device, model=world.model)
    gen = torch.Generator().manual_seed(seed)
    live = [s for s, layout in enumerate(world.layouts) if layout is not None]
    slots = token_mix(mix, count, live, gen)
    h = torch.randn(count, entries * RANK_BLOCK, generator=gen).to(dtype)
    entry_of_slot = torch.full((meta.num_slots + 2,), 77, dtype=torch.int32)
    for slot, entry in zip(live, torch.randperm(entries, generator=gen).tolist()):
        entry_of_slot[slot] = entry
    res = torch.randn(count, hidden, generator=gen).to(dtype)
    y = torch.randn(count, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    tensors = (res, y, h, weight, slots, entry_of_slot)
    return (world, meta, *(t.to(device) for t in tensors))


def _tol(dtype):
    return {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_matches_the_reference_and_the_two_launches(dtype, mix, hidden):
    world, meta, res, y, h, weight, slots, entries = world_and_inputs(dtype, hidden, mix=mix)
    args = (entries, world.pool[0], world.page_table, slots, meta)
    y0 = y.clone()
    total, out = add_rms_norm_stacked(res, y, h, weight, EPS, *args, rank_block=RANK_BLOCK, scale=0.5)
    want_total, want = add_rms_norm_stacked_ref(res, y, h, weight, EPS, *args, rank_block=RANK_BLOCK, scale=0.5)
    assert torch.equal(y, y0)  # y is read, not written
    tol = _tol(dtype)
    torch.testing.assert_close(total.float(), want_total.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)
    two = add_rms_norm_ref(res, lora_expand_stacked(y.clone(), h, *args, rank_block=RANK_BLOCK, scale=0.5), weight, EPS)
    torch.testing.assert_close(total.float(), two[0].float(), rtol=tol, atol=tol)
    plain_total, plain = add_rms_norm_ref(res, y, weight, EPS)
    no_delta = [t for t, s in enumerate(slots.tolist()) if s < 0 or meta.ranks[s][0] == 0]
    assert torch.equal(total[no_delta], plain_total[no_delta])  # tokens without a delta: exactly the plain add
    with_delta = [t for t in range(len(slots)) if t not in no_delta]
    assert with_delta and not torch.allclose(total[with_delta], plain_total[with_delta])  # some LoRA was added
    torch.testing.assert_close(out[no_delta].float(), plain[no_delta].float(), rtol=tol, atol=tol)


def test_a_layer_without_the_target_and_a_slot_without_an_entry():
    world, meta, res, y, h, weight, slots, entries = world_and_inputs(torch.float32, layer=1, mix="distinct")
    assert meta.max_rank == 0
    args = (entries, world.pool[1], world.page_table, slots, meta)
    total, _ = add_rms_norm_stacked(res, y, h, weight, EPS, *args, rank_block=RANK_BLOCK)
    assert torch.equal(total, add_rms_norm_ref(res, y, weight, EPS)[0])
    world, meta, res, y, h, weight, slots, entries = world_and_inputs(torch.float32, mix="identical")
    entries[int(slots[0])] = -1  # the slot every LoRA token has: no entry, no delta (as the stacked expand)
    total, _ = add_rms_norm_stacked(res, y, h, weight, EPS, entries, world.pool[0], world.page_table, slots, meta,
                                    rank_block=RANK_BLOCK)
    assert torch.equal(total, add_rms_norm_ref(res, y, weight, EPS)[0])


@pytest.mark.parametrize("hidden", [64, 96])
def test_flat_reads_match(monkeypatch, hidden):
    """``LAUNCH["flat"]``: B read rank row by rank row in the row's layout; the same result."""
    world, meta, res, y, h, weight, slots, entries = world_and_inputs(torch.float32, hidden, mix="skewed", seed=5)
    args = (res, y, h, weight, EPS, entries, world.pool[0], world.page_table, slots, meta)
    tiled = add_rms_norm_stacked(*args, rank_block=RANK_BLOCK)
    monkeypatch.setitem(norm_lora.LAUNCH, "flat", True)
    for got, want in zip(add_rms_norm_stacked(*args, rank_block=RANK_BLOCK), tiled):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_rank_chunks_in_a_loop(monkeypatch):
    """Past `ROW_ELEMS` B elements a program takes the rank in chunks; the result does not change."""
    world, meta, res, y, h, weight, slots, entries = world_and_inputs(torch.float32, 96, mix="zipf", seed=3)
    args = (res, y, h, weight, EPS, entries, world.pool[0], world.page_table, slots, meta)
    whole = add_rms_norm_stacked(*args, rank_block=RANK_BLOCK)
    monkeypatch.setattr(norm_lora, "ROW_ELEMS", 128)  # 128 columns: one rank row a chunk
    chunked = add_rms_norm_stacked(*args, rank_block=RANK_BLOCK)
    for got, want in zip(chunked, whole):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_bad_inputs_raise():
    world, meta, res, y, h, weight, slots, entries = world_and_inputs(torch.float32)
    tail = (entries, world.pool[0], world.page_table, slots, meta)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm_stacked(res, y, h, weight[:-1], EPS, *tail, rank_block=RANK_BLOCK)
    with pytest.raises(ValueError, match="res"):
        add_rms_norm_stacked(res[:-1], y, h, weight, EPS, *tail, rank_block=RANK_BLOCK)
    with pytest.raises(ValueError, match="rank_block"):
        add_rms_norm_stacked(res, y, h, weight, EPS, *tail, rank_block=8)
    with pytest.raises(ValueError, match="h"):
        add_rms_norm_stacked(res, y, h[:, :-1], weight, EPS, *tail, rank_block=RANK_BLOCK)
    qkv = dense_lora_meta(world.layouts, 0, ("q_proj", "k_proj", "v_proj"), device=world.pool.device,
                          model=world.model)
    wide = torch.zeros(len(slots), qkv.out_cols)
    with pytest.raises(ValueError, match="one slice"):
        add_rms_norm_stacked(wide, wide, h, torch.ones(qkv.out_cols), EPS, entries, world.pool[0], world.page_table,
                             slots, qkv, rank_block=RANK_BLOCK)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [2048, 2880])  # Qwen3-30B-A3B's and GPT-OSS-20B's
def test_gpu_at_decode_shapes(hidden):
    """bf16 on the GPU, a decode batch over five slots and tokens without one, against the reference."""
    world, meta, res, y, h, weight, slots, entries = world_and_inputs(torch.bfloat16, hidden, count=256, mix="zipf",
                                                                      entries=16, device="cuda")
    args = (res, y, h, weight, EPS, entries, world.pool[0], world.page_table, slots, meta)
    got = add_rms_norm_stacked(*args, rank_block=RANK_BLOCK)
    want = add_rms_norm_stacked_ref(*args, rank_block=RANK_BLOCK)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=_tol(torch.bfloat16), atol=_tol(torch.bfloat16))
    assert not torch.equal(got[0], add_rms_norm_ref(res, y, weight, EPS)[0])
