"""The gate/up LoRA expand fused with silu(gate) * up: Triton (interpreter on CPU) against the torch
reference and against the two kernels it replaces (`lora_expand` then `silu_mul`)."""

from __future__ import annotations

import pytest
import torch
from test_kernel_lora import MIXES, build_world, token_mix
from unipage.kernels import (dense_lora_meta, lora_expand, lora_shrink, lora_shrink_ref, lora_silu_mul,
                             lora_silu_mul_ref, plan_lora_batch, silu_mul)

GU = ("gate_proj", "up_proj")
# slot -> ranks (None: empty slot); slot 3 lacks gate_proj, slot 4 lacks up_proj
SLOTS = [{"gate_proj": 8, "up_proj": 8}, {"gate_proj": 4, "up_proj": 16}, None, {"up_proj": 8},
         {"gate_proj": 16}]
USED = [0, 1, 3, 4]
SILU_KEYS = ("block_n", "chunk", "warps", "fused")  # lora_silu_mul's config keys (the rest: the shrink's)


def run(world, slots, grouped, seed=1, scale=1.0, config=None):
    """(gate_up before, kernel output, reference output, the two unfused kernels' output)."""
    meta = dense_lora_meta(world.layouts, 0, GU, model=world.model)
    gen = torch.Generator().manual_seed(seed)
    dtype = world.pool.dtype
    x = torch.randn(len(slots), meta.d_in, generator=gen).to(dtype)
    gate_up = torch.randn(len(slots), meta.out_cols, generator=gen).to(dtype)
    args = (world.pool[0], world.page_table, slots, meta)
    batch = plan_lora_batch(slots, len(world.layouts), grouped=grouped)
    before = gate_up.clone()
    shrink_config = {k: v for k, v in (config or {}).items() if k not in SILU_KEYS}
    shrunk = lora_shrink(x, *args, batch=batch, config=shrink_config)
    out = lora_silu_mul(gate_up, shrunk, scale=scale, config=config)
    if (config or {}).get("fused", True) and meta.rank_block <= 64:
        assert torch.equal(gate_up, before)  # the fused kernel does not write it back
    ref = lora_silu_mul_ref(before.clone(), lora_shrink_ref(x, *args), scale=scale)
    unfused = silu_mul(lora_expand(before.clone(), shrunk, scale=scale))
    return before, out, ref, unfused


def check(slots, before, out, ref, unfused):
    tol = {torch.float32: 1e-5, torch.float16: 2e-3}[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(out.float(), unfused.float(), rtol=tol, atol=tol)
    plain = silu_mul(before)
    none = slots < 0
    assert torch.equal(out[none], plain[none])  # tokens without adapter: the plain activation, bit for bit
    assert not torch.equal(out[~none], plain[~none])  # the LoRA did change the others


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("count", [1, 5, 33])
def test_fused_matches_reference_on_both_paths(dtype, mix, count):
    world = build_world(slots=SLOTS, dtype=dtype, seed=count)
    slots = token_mix(mix, count, USED, torch.Generator().manual_seed(7))
    for grouped in (False, True):
        check(slots, *run(world, slots, grouped, scale=0.5))


@pytest.mark.parametrize("grouped", [False, True])
def test_uneven_width_split_k_and_no_adapter_tiles(grouped):
    """I = 200 (column tiles past the end, B runs cut short), d_in 160 over three K splits, and more
    tokens without adapter than one tile holds (the grouped path's extra row tiles)."""
    world = build_world(slots=SLOTS, d_in=160, inter=200, seed=3)
    slots = token_mix("uniform", 40, USED, torch.Generator().manual_seed(2), none_frac=0.6)
    config = {"block_k": 64, "split_k": 3, "rows": 16}
    check(slots, *run(world, slots, grouped, config=config))


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("block_n,chunk", [(128, 64), (256, 64), (192, 64)])
def test_columns_in_steps_match_the_reference(grouped, block_n, chunk):
    """Programs of several column steps (h summed once, B and gate/up streamed): I = 200, so the last
    program's steps run past the end, and a 192-column program ends mid-way through I."""
    world = build_world(slots=SLOTS, d_in=160, inter=200, seed=6)
    slots = token_mix("skewed", 37, USED, torch.Generator().manual_seed(8), none_frac=0.3)
    config = {"block_k": 64, "split_k": 2, "block_n": block_n, "chunk": chunk, "fused": True}
    check(slots, *run(world, slots, grouped, scale=0.5, config=config))


def test_bad_column_steps_are_refused():
    world = build_world(slots=SLOTS, seed=2)
    slots = token_mix("uniform", 9, USED, torch.Generator().manual_seed(1))
    for config in ({"block_n": 128, "chunk": 96}, {"block_n": 192, "chunk": 128}, {"block_n": 128, "chunk": 32}):
        with pytest.raises(ValueError, match="chunk a power of two"):
            run(world, slots, True, config={**config, "fused": True})


@pytest.mark.parametrize("fused", [False, True, None])
def test_tall_tiles_fused_by_default_or_the_two_kernels_if_asked(fused):
    """Tiles of 64 tokens: the fused kernel by default (column steps), or the two kernels with ``fused``
    False (gate_up then holds the delta)."""
    world = build_world(slots=SLOTS, seed=5)
    slots = token_mix("skewed", 90, USED, torch.Generator().manual_seed(4))
    meta = dense_lora_meta(world.layouts, 0, GU, model=world.model)
    x, gate_up = torch.randn(90, meta.d_in), torch.randn(90, meta.out_cols)
    args = (world.pool[0], world.page_table, slots, meta)
    batch = plan_lora_batch(slots, len(SLOTS), grouped=True, block_m=64)
    before = gate_up.clone()
    out = lora_silu_mul(gate_up, lora_shrink(x, *args, batch=batch), config={} if fused is None else {"fused": fused})
    assert torch.equal(gate_up, before) == (fused is not False)
    ref = lora_silu_mul_ref(before, lora_shrink_ref(x, *args))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    none = slots < 0
    assert torch.equal(out[none], silu_mul(before)[none])


def test_rank_above_64_takes_the_two_kernels():
    world = build_world(slots=[{"gate_proj": 80, "up_proj": 8}, None], seed=4)
    slots = torch.tensor([0, -1, 0, 0, -1], dtype=torch.int32)
    for grouped in (False, True):
        check(slots, *run(world, slots, grouped))


def test_bad_arguments_raise_value_errors_with_the_cause():
    world = build_world(slots=SLOTS)
    meta = dense_lora_meta(world.layouts, 0, GU, model=world.model)
    slots = torch.tensor([0, 1, -1], dtype=torch.int32)
    x, gate_up = torch.randn(3, meta.d_in), torch.randn(3, meta.out_cols)
    shrunk = lora_shrink(x, world.pool[0], world.page_table, slots, meta)
    with pytest.raises(ValueError, match="gate_up must be of shape"):
        lora_silu_mul(gate_up[:2], shrunk)
    with pytest.raises(ValueError, match="what lora_shrink returned"):
        lora_silu_mul(gate_up, lora_shrink_ref(x, world.pool[0], world.page_table, slots, meta))
    q_only = build_world(slots=[{"q_proj": 8}])
    q_meta = dense_lora_meta(q_only.layouts, 0, ("q_proj",), model=q_only.model)
    q_shrunk = lora_shrink(torch.randn(3, q_meta.d_in), q_only.pool[0], q_only.page_table,
                           torch.tensor([0, 0, -1], dtype=torch.int32), q_meta)
    for fn in (lora_silu_mul, lora_silu_mul_ref):
        with pytest.raises(ValueError, match="gate/up pair"):
            fn(torch.randn(3, q_meta.out_cols), q_shrunk if fn is lora_silu_mul else
               lora_shrink_ref(torch.randn(3, q_meta.d_in), q_only.pool[0], q_only.page_table,
                               torch.tensor([0, 0, -1], dtype=torch.int32), q_meta))


@pytest.mark.gpu
@pytest.mark.parametrize("count", [1, 16, 256, 4096])
def test_gpu_llama8b_gate_up_bf16(count):
    """Llama-3.1-8B gate/up (4096 -> 2 x 14336, r16, 16 adapters, pages shuffled), compiled: the fused
    kernel against the two kernels it replaces, and the LoRA delta against an fp32 reference."""
    from unipage.adapter_pack import pack_adapter, random_lora_weights
    from unipage.config import ModelConfig
    from unipage.lora_layout import TargetSpec, build_layout

    model = ModelConfig(num_layers=1, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                        intermediate_size=14336)
    gen = torch.Generator().manual_seed(0)
    page = 16 * 2 * 8 * 128
    layout = build_layout(model, [tuple(TargetSpec(t, (16,)) for t in GU)])
    n = layout.num_pages(page)
    pool = torch.randn(16 * n + 64, page, generator=gen).bfloat16()
    ids = torch.randperm(pool.shape[0], generator=gen)[: 16 * n].view(16, n)
    for slot in range(16):
        pool[ids[slot]] = pack_adapter(layout, random_lora_weights(layout, gen, std=0.02), page, torch.bfloat16)[0]
    pool, table = pool.cuda(), ids.to(torch.int32).cuda()
    meta = dense_lora_meta([layout] * 16, 0, GU, device="cuda", model=model)
    slots = (torch.arange(count, dtype=torch.int32) % 16).cuda()
    slots[3::7] = -1
    x = torch.randn(count, 4096, device="cuda").bfloat16()
    gate_up = torch.randn(count, 2 * 14336, device="cuda").bfloat16()
    want = silu_mul(gate_up.float() + lora_expand_delta_fp32(x, pool, table, slots, meta))
    for grouped in (False, True):
        batch = plan_lora_batch(slots, 16, group_tokens=-(-count // 16), max_groups=16, grouped=grouped)
        shrunk = lora_shrink(x, pool, table, slots, meta, batch=batch)
        got = lora_silu_mul(gate_up.clone(), shrunk)
        unfused = silu_mul(lora_expand(gate_up.clone(), lora_shrink(x, pool, table, slots, meta, batch=batch)))
        torch.testing.assert_close(got.float(), unfused.float(), rtol=1e-2, atol=1e-2)
        err = (got.float() - want).norm() / want.norm()
        assert err <= 1e-2, (grouped, err.item())
        assert torch.equal(got[3::7], silu_mul(gate_up)[3::7])


def lora_expand_delta_fp32(x, pool, table, slots, meta):
    """The LoRA delta of gate_up in fp32 (the reference over an fp32 copy of the pool)."""
    from unipage.kernels import lora_shrink_expand_ref

    zero = torch.zeros(x.shape[0], meta.out_cols, device=x.device)
    return lora_shrink_expand_ref(zero, x.float(), pool.float(), table, slots, meta)
