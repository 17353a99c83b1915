"""The fused decode projection `linear_lora`: Triton (interpreter on CPU) vs its torch reference, over
adapter mixes with tokens without adapter, slots lacking a target, biases, uneven widths, and its fallback."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from test_kernel_lora import MIXES, QKV, build_world, token_mix
from unipage.kernels import lora_linear
from unipage.kernels.lora_linear import fused_linear, linear_lora, linear_lora_ref
from unipage.kernels.lora_meta import dense_lora_meta, plan_lora_batch


@pytest.fixture(autouse=True)
def fused_on(monkeypatch):
    """The kernel is off by default (`lora_linear` says why); these tests turn it on for 16 tokens."""
    monkeypatch.setitem(lora_linear.LINEAR, "max_tokens", 16)


def inputs(world, count, layer=0, targets=QKV, bias=True, mix="uniform", seed=1):
    meta = dense_lora_meta(world.layouts, layer, targets, device=world.pool.device, model=world.model)
    gen = torch.Generator().manual_seed(seed)
    dtype = world.pool.dtype
    x = torch.randn(count, meta.d_in, generator=gen).to(dtype)
    w = (torch.randn(meta.out_cols, meta.d_in, generator=gen) / meta.d_in ** 0.5).to(dtype)
    b = torch.randn(meta.out_cols, generator=gen).to(dtype) if bias else None
    slots = token_mix(mix, count, [0, 1, 3, 4], gen)
    return meta, x, w, b, slots


def run_both(world, meta, x, w, b, slots, layer=0, **kwargs):
    args = (x, w, b, world.pool[layer], world.page_table, slots, meta)
    return linear_lora_ref(*args), linear_lora(*args, **kwargs)


def assert_close(out, ref, base):
    tol = {torch.float32: 1e-5, torch.float16: 2e-3}[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    assert not torch.allclose(ref.float(), base.float(), atol=tol)  # some LoRA delta was added


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("count, bias", [(1, True), (5, False), (16, True)])
def test_fused_kernel_matches_reference(dtype, mix, count, bias):
    world = build_world(dtype=dtype)
    meta, x, w, b, slots = inputs(world, count, bias=bias, mix=mix)
    assert fused_linear(count, meta)
    ref, out = run_both(world, meta, x, w, b, slots)
    base = x @ w.T + (b if bias else 0)
    assert_close(out, ref, base)
    for t in torch.nonzero(slots < 0).flatten().tolist():  # no adapter: the projection alone
        torch.testing.assert_close(out[t].float(), base[t].float(), rtol=1e-5, atol=2e-3)


@pytest.mark.parametrize("block_n, block_k, stacked",
                         [(16, 64, True), (32, 32, False), (64, 64, True), (32, 64, False)])
def test_layer_without_a_target_uneven_d_in_and_tile_widths(block_n, block_k, stacked):
    """Layer 1: slots lack v_proj (rank-0 columns get no delta); d_in 96 is not a multiple of 64 (a
    masked K tail); k and v are 32 wide, so 64-wide tiles are part masked and narrower ones part idle."""
    world = build_world(d_in=96)
    meta, x, w, b, slots = inputs(world, 7, layer=1, mix="distinct")
    config = {"block_n": block_n, "block_k": block_k, "stacked": stacked}
    ref, out = run_both(world, meta, x, w, b, slots, layer=1, config=config)
    assert_close(out, ref, x @ w.T + b)


def nan_padded(shrink):
    """`lora_shrink`, then NaN in every partial the kernel must not read: rows past a slot's rank in each
    slice, and whole rows of tokens without adapter (which the shrink leaves unwritten)."""
    def wrapped(x, pool, page_table, token_slots, meta, **kwargs):
        shrunk = shrink(x, pool, page_table, token_slots, meta, **kwargs)
        rb = meta.rank_block
        for t, slot in enumerate(token_slots.tolist()):
            if slot < 0:
                shrunk.part[:, t] = float("nan")
                continue
            for j, rank in enumerate(meta.ranks[slot]):
                shrunk.part[:, t, j * rb + rank:(j + 1) * rb] = float("nan")
        return shrunk
    return wrapped


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("page", [64, 256])
def test_partials_past_the_rank_and_of_tokens_without_adapter_are_never_read(monkeypatch, stacked, page):
    monkeypatch.setattr(lora_linear, "lora_shrink", nan_padded(lora_linear.lora_shrink))
    world = build_world(page=page, layer1_drop="k_proj")
    for layer in (0, 1):  # layer 1: no slot has k_proj (rank 0 in every row of that slice)
        meta, x, w, b, slots = inputs(world, 11, layer=layer, mix="uniform")
        ref, out = run_both(world, meta, x, w, b, slots, layer=layer, config={"stacked": stacked})
        assert not out.isnan().any()
        assert_close(out, ref, x @ w.T + b)


@pytest.mark.parametrize("head_dim, block_n", [(24, 16), (24, 32), (40, 32)])
def test_slices_narrower_than_or_not_a_multiple_of_the_tile(head_dim, block_n):
    """k and v of 24 or 40 columns, q of 48 or 80: tiles that end inside a slice, and sub-tiles past its end."""
    world = build_world(head_dim=head_dim, page=128)
    meta, x, w, b, slots = inputs(world, 9, mix="distinct")
    assert meta.slice_cols == (2 * head_dim, head_dim, head_dim)
    ref, out = run_both(world, meta, x, w, b, slots, config={"block_n": block_n})
    assert_close(out, ref, x @ w.T + b)


def test_split_k_partials_in_half_precision(monkeypatch):
    """d_in 512 in fp16: the shrink splits K, so the kernel sums several partials per rank row."""
    splits = []
    shrink = lora_linear.lora_shrink
    monkeypatch.setattr(lora_linear, "lora_shrink", lambda *a, **k: (s := shrink(*a, **k), splits.append(
        s.plan.split_k))[0])
    world = build_world(d_in=512, dtype=torch.float16, page=256)
    meta, x, w, b, slots = inputs(world, 6, mix="zipf")
    ref, out = run_both(world, meta, x, w, b, slots)
    assert splits and splits[0] > 1
    assert_close(out, ref, x @ w.T + b)


@pytest.mark.parametrize("stacked", [True, False])
def test_rank_chunks_and_scale(stacked):
    world = build_world(slots=[{"q_proj": 24, "k_proj": 3, "v_proj": 16}, {"q_proj": 2, "k_proj": 2, "v_proj": 2}])
    meta, x, w, b, _ = inputs(world, 9)
    slots = torch.tensor([0, 1, -1, 0, 0, 1, -1, 1, 0], dtype=torch.int32)
    args = (x, w, b, world.pool[0], world.page_table, slots, meta)
    ref = linear_lora_ref(*args, scale=0.5)
    assert_close(linear_lora(*args, scale=0.5, config={"rank_chunk": 8, "stacked": stacked}), ref, x @ w.T + b)


@pytest.mark.parametrize("grouped", [False, True])
def test_either_path_of_the_shrink_feeds_the_fused_kernel(grouped):
    world = build_world()
    meta, x, w, b, slots = inputs(world, 12, mix="skewed")
    batch = plan_lora_batch(slots, meta.num_slots, grouped=grouped, block_m=16 if grouped else None)
    assert batch.grouped == grouped and fused_linear(12, meta)
    ref, out = run_both(world, meta, x, w, b, slots, batch=batch)
    assert_close(out, ref, x @ w.T + b)


def test_larger_batches_and_max_tokens_0_take_the_separate_launches(monkeypatch):
    world = build_world()
    meta, x, w, b, slots = inputs(world, 20)
    assert not fused_linear(20, meta)
    assert not fused_linear(8, meta, {"max_tokens": 0})
    launched = []
    monkeypatch.setattr(lora_linear, "launch", lambda *a, **k: launched.append(a[0]))
    ref, out = run_both(world, meta, x, w, b, slots)
    assert_close(out, ref, x @ w.T + b)
    ref, out = run_both(world, meta, x[:8], w, b, slots[:8], config={"max_tokens": 0})
    assert_close(out, ref, x[:8] @ w.T + b)
    assert launched == []  # neither ran the fused kernel


def test_bias_is_added_before_the_one_rounding_as_f_linear_does():
    """fp16, tokens without adapter: the product 1 + 2^-11 plus the bias 2^-11 is 1 + 2^-10 when rounded once
    (F.linear, the separate path), but 1.0 when the product is rounded first (ties to even) and the bias after."""
    world = build_world(dtype=torch.float16)
    meta, x, w, b, _ = inputs(world, 4)
    x.zero_(), w.zero_()
    x[:, 0], x[:, 1], w[:, :2], b[:] = 1.0, 2.0 ** -11, 1.0, 2.0 ** -11
    slots = torch.full((4,), -1, dtype=torch.int32)
    ref, out = run_both(world, meta, x, w, b, slots)
    assert torch.equal(ref, torch.nn.functional.linear(x, w, b))
    assert torch.equal(out, ref)
    assert out[0, 0].item() == 1.0 + 2.0 ** -10


def test_bad_weights_and_config_are_refused():
    world = build_world()
    meta, x, w, b, slots = inputs(world, 4)
    args = (world.pool[0], world.page_table, slots, meta)
    with pytest.raises(ValueError, match="w must be"):
        linear_lora(x, w[:, :-1], b, *args)
    with pytest.raises(ValueError, match="w must be contiguous"):
        linear_lora(x, w.T.contiguous().T, b, *args)
    with pytest.raises(ValueError, match="bias must be"):
        linear_lora(x, w, b[:-1], *args)
    with pytest.raises(ValueError, match="block_n"):
        linear_lora(x, w, b, *args, config={"block_n": 128})


@pytest.mark.gpu
@pytest.mark.parametrize("count", [1, 16])
@pytest.mark.parametrize("shape", ["gpt-oss-20b qkv", "gpt-oss-20b o", "qwen3-30b-a3b qkv"])
def test_gpu_matches_reference_at_model_shapes(count, shape):
    """bf16 at GPT-OSS-20B's qkv and o (with their biases) and Qwen3-30B-A3B's qkv, 8 adapters in shuffled
    pages, a token without adapter at 16 tokens (the benchmark's setup); PDL where the GPU has it."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import kernels_lora_linear as bench

    s = bench.setup(shape, count, layers=1)
    args = (s["x"], s["w"][0], s["bias"], s["pool"], s["table"], s["slots"], s["meta"])
    assert fused_linear(count, s["meta"])
    ref, out = linear_lora_ref(*args), linear_lora(*args)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    base = s["x"] @ s["w"][0].T + (0 if s["bias"] is None else s["bias"])
    lora = s["slots"] >= 0
    assert not torch.allclose(ref[lora].float(), base[lora].float(), atol=2e-2)  # the deltas count


def test_benchmark_times_the_fused_kernel_against_the_separate_launches(monkeypatch):
    """benchmarks/kernels_lora_linear.py at a toy shape on the CPU: its fused runs launch the kernel though
    the engine's default has it off, its separate runs do not, and its check compares the two."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import kernels_lora_linear as bench

    monkeypatch.setitem(lora_linear.LINEAR, "max_tokens", 0)  # the default
    monkeypatch.setitem(bench.SHAPES, "toy", ((64, 2, 1, 32), QKV, 8, True))
    s = bench.setup("toy", 10, layers=2, device="cpu", dtype=torch.float32)
    launched = []
    real = lora_linear.launch
    monkeypatch.setattr(lora_linear, "launch", lambda kernel, *a, **k: (launched.append(kernel), real(kernel, *a, **k)))
    bench.separate(s)()
    assert launched == []
    bench.fused(s)()
    assert len(launched) == 2  # one per layer
    assert bench.check(s) < 1e-5


def test_benchmark_stacked_path_gives_the_separate_result(monkeypatch):
    """kernels_lora_linear's shrink-stack path on the CPU at a toy shape: one GEMM over W and the A rows, then
    the expand from h, gives the separate launches' result (the bias only on W's columns)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import kernels_lora_linear as bench

    monkeypatch.setitem(bench.SHAPES, "toy", ((64, 2, 1, 32), QKV, 8, True))
    s = bench.setup("toy", 10, layers=2, device="cpu", dtype=torch.float32)
    run = bench.stacked(s)
    run()
    assert bench.check(s, other=run.first) < 1e-5
    s["bias"] += 1  # a check that can fail: the stack's bias was copied before this change
    assert bench.check(s, other=run.first) > 1e-3


def test_benchmark_projection_rows_time_three_ways_at_the_shapes_with_a_bias(monkeypatch):
    """kernels_lora_linear --projection on the CPU at toy shapes: one row per shape with a bias and token
    count, its three timings each of calls that give the projection (the timer replaced: it needs CUDA)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import kernels_lora_linear as bench

    shapes = {"toy": ((64, 2, 1, 32), QKV, 8, True), "toy-no-bias": ((64, 2, 1, 32), ("o_proj",), 8, False)}
    monkeypatch.setattr(bench, "SHAPES", shapes)
    real_setup = bench.setup
    monkeypatch.setattr(bench, "setup", lambda name, tokens: real_setup(name, tokens, 2, "cpu", torch.float32))
    results = []

    def timed(run):
        results.append(run())
        return 1.0

    monkeypatch.setattr(bench, "per_layer_us", timed)
    rows = []
    monkeypatch.setattr(bench, "emit", lambda row, out: rows.append(row))
    args = type("Args", (), {"shapes": list(shapes), "tokens": [1, 3]})()
    bench.projection(args, None)
    assert [(r["shape"], r["tokens"]) for r in rows] == [("toy", 1), ("toy", 3)]
    assert all(r["matmul_add_us"] == r["linear_us"] == r["matmul_only_us"] == 1.0 for r in rows)
    add, linear, plain = results[:3]
    for a, b, c in zip(add, linear, plain):  # two layers each
        torch.testing.assert_close(a, b)
        assert not torch.allclose(a, c)  # the bias counts
