"""Fused MoE of the base model: routing, alignment, the grouped GEMMs, the whole block.

CPU runs the Triton kernels under the interpreter at tiny shapes (fp16/fp32);
`-m gpu` runs real shapes in bf16 against a float32 reference.
"""

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from unipage.kernels.fused_moe import (fused_experts, fused_experts_ref, fused_moe, fused_moe_ref, moe_down,
                                       moe_down_ref, moe_gate_up, moe_gate_up_ref, route_topk, route_topk_ref)
from unipage.kernels.moe_route import _round_to
from unipage.kernels import moe_align as moe_align_module
from unipage.kernels.moe_align import (Alignment, _launch_split, launch_config, max_blocks, moe_align,
                                      moe_align_ref)
from unipage.kernels.moe_ranks import ranks_ref, slot_ranks

H, I, E, K = 64, 32, 8, 2
TOKENS = (1, 7, 40)
# block_k 32 divides H (two K steps); "ragged" takes the masked-K and wrapped-N paths; "tma" loads
# the weights through tensor descriptors (out-of-bounds rows and columns read as zero).
CONFIGS = {
    "even": {"block_m": 16, "gate_up": {"block_n": 16, "block_k": 32, "group_m": 2, "num_warps": 4, "num_stages": 2},
             "down": {"block_n": 32, "block_k": 16, "group_m": 2, "num_warps": 4, "num_stages": 2}},
    "ragged": {"block_m": 16, "gate_up": {"block_n": 64, "block_k": 128, "group_m": 1, "num_warps": 4,
                                          "num_stages": 2},
               "down": {"block_n": 128, "block_k": 64, "group_m": 1, "num_warps": 4, "num_stages": 2}},
    "tma": {"block_m": 16, "gate_up": {"block_n": 64, "block_k": 128, "group_m": 2, "num_warps": 4,
                                       "num_stages": 2, "tma": True},
            "down": {"block_n": 32, "block_k": 16, "group_m": 2, "num_warps": 4, "num_stages": 2, "tma": True}},
}


def _weights(dtype, seed=0, hidden=H, inter=I, experts=E, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w_down = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    return w_gate_up.to(device, dtype), w_down.to(device, dtype)


def _inputs(num_tokens, dtype, seed=0, hidden=H, experts=E, device="cpu"):
    g = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(num_tokens, hidden, generator=g)
    logits = torch.randn(num_tokens, experts, generator=g)
    return x.to(device, dtype), logits.to(device)


def _loop_moe(x, w_gate_up, w_down, topk_weights, topk_ids):
    """One token and one expert at a time, float32."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    inter = w_down.shape[2]
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = w_gate_up[e].float() @ x[t].float()
            out[t] += float(topk_weights[t, j]) * (w_down[e].float() @ (F.silu(h[:inter]) * h[inter:]))
    return out


def _rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# --- routing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_route_topk_matches_reference(num_tokens, renormalize):
    _, logits = _inputs(num_tokens, torch.float32, seed=num_tokens)
    weights, ids = route_topk(logits, K, renormalize)
    ref_weights, ref_ids = route_topk_ref(logits, K, renormalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_route_topk_bias_and_rounding(dtype):
    """GPT-OSS's router bias, added in the logits' dtype, and the weights rounded to the model dtype, all
    in the routing kernel: the same as the reference's separate torch ops, bit for bit."""
    _, logits = _inputs(40, torch.float32, seed=5)
    logits = logits.to(dtype)
    bias = torch.randn(E, generator=torch.Generator().manual_seed(6)).to(dtype)
    for kwargs in ({"bias": bias}, {"weight_dtype": dtype}, {"bias": bias, "weight_dtype": torch.bfloat16}):
        weights, ids = route_topk(logits, K, True, **kwargs)
        ref_weights, ref_ids = route_topk_ref(logits, K, True, **kwargs)
        assert torch.equal(ids, ref_ids), kwargs
        torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-6)
        if "weight_dtype" in kwargs:  # on the grid of that dtype, and float32 as without rounding
            assert weights.dtype == torch.float32
            assert torch.equal(weights, weights.to(kwargs["weight_dtype"]).float())
    plain, _ = route_topk_ref(logits + bias, K, True)
    torch.testing.assert_close(route_topk_ref(logits, K, True, bias=bias)[0], plain)


@triton.jit
def _round_rows(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, _round_to(tl.load(x_ptr + offs), tl.bfloat16))


def test_round_to_bfloat16_as_torch():
    """The routing kernel's bit arithmetic against torch's ``.to(bfloat16)``: exact ties both ways, both
    signs, subnormals, the top of the range (to inf), infinities and NaNs of several payloads."""
    patterns = [0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x3F807FFF, 0x3F808001, 0x00008000,
                0x00018000, 0x80008000, 0x007FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7FFFFF,
                0x7F800000, 0xFF800000, 0x7FC00000, 0x7FFFFFFF, 0x7F800001, 0xFFFFFFFF, 0, 0x80000000]
    g = torch.Generator().manual_seed(4)
    bits = torch.tensor([p - (1 << 32) if p >= 1 << 31 else p for p in patterns], dtype=torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.randn(106, generator=g) * 10.0 ** torch.randint(-6, 6, (106,),
                                                                                                  generator=g)])
    y = torch.empty_like(x)
    _round_rows[(1,)](x, y, N=128)
    want = x.to(torch.bfloat16).float()
    assert torch.equal(y.isnan(), want.isnan())
    assert torch.equal(y[~want.isnan()], want[~want.isnan()])


def test_route_topk_rejects_bad_bias():
    _, logits = _inputs(4, torch.float32)
    with pytest.raises(ValueError, match="bias must be"):
        route_topk(logits, K, True, bias=torch.zeros(E + 1))
    with pytest.raises(ValueError, match="bias must be"):
        route_topk_ref(logits, K, True, bias=torch.zeros(E, dtype=torch.float16))
    with pytest.raises(ValueError, match="weight_dtype"):
        route_topk(logits, K, True, weight_dtype=torch.int32)


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_reference_matches_transformers_router(renormalize):
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=K, norm_topk_prob=renormalize)
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight, std=0.3)
    x, _ = _inputs(40, torch.float32)
    _, scores, indices = router(x)
    weights, ids = route_topk_ref(F.linear(x, router.weight), K, renormalize)
    assert torch.equal(ids, indices.int())
    torch.testing.assert_close(weights, scores)


# --- alignment ----------------------------------------------------------------------------------


def _groups_of(align: Alignment) -> dict:
    """group -> sorted pair ids, after checking the alignment's own invariants."""
    used = int(align.num_blocks)
    assert 0 <= used <= align.max_blocks
    assert (align.block_group[used:] == -1).all()
    groups = {}
    for b in range(used):
        tile = align.sorted_pairs[b * align.block_m:(b + 1) * align.block_m].tolist()
        groups.setdefault(int(align.block_group[b]), []).extend(tile)
    assert (align.sorted_pairs[used * align.block_m:] == align.num_pairs).all()
    padding = {g: tile.count(align.num_pairs) for g, tile in groups.items()}
    real = {g: sorted(p for p in tile if p != align.num_pairs) for g, tile in groups.items()}
    assert all(padding[g] < align.block_m and len(tile) % align.block_m == 0 for g, tile in groups.items())
    assert list(align.block_group[:used]) == sorted(align.block_group[:used].tolist())
    return real


@pytest.mark.parametrize("launches", ["one", "three", "many", "lanes", "auto"])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("num_tokens", TOKENS + (300,))
def test_align_matches_reference(num_tokens, block_m, lora, launches):
    g = torch.Generator().manual_seed(num_tokens * 7 + block_m)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(num_tokens)]).int()
    extra = {}
    if lora:
        extra = {"token_slots": torch.randint(-1, 3, (num_tokens,), generator=g, dtype=torch.int32),
                 "slot_flags": torch.tensor([1, 0, 1], dtype=torch.int32)}
    split = {"one": {"one_program_max": 1 << 30}, "three": {"chunk": 64, "one_program_max": 0},  # 300 tokens: 10 chunks
             "many": {"chunk": 16, "one_program_max": 0},  # more chunks than the plan loads at once
             "lanes": {"chunk": 256, "one_program_max": 0},  # 300 tokens: 256 of a program's 1024 lanes used
             "auto": {}}[launches]
    got, want = moe_align(ids, E, block_m, **extra, **split), moe_align_ref(ids, E, block_m, **extra)
    groups = _groups_of(want)
    assert _groups_of(got) == groups
    assert torch.equal(got.num_blocks, want.num_blocks) and torch.equal(got.block_group, want.block_group)
    expected = {}
    for p, e in enumerate(ids.reshape(-1).tolist()):
        slot = int(extra["token_slots"][p // K]) if lora else 0
        if not lora or (slot >= 0 and int(extra["slot_flags"][slot])):
            expected.setdefault(slot * E + e if lora else e, []).append(p)
    assert groups == expected


@pytest.mark.parametrize("launches", [{"one_program_max": 1 << 30}, {"chunk": 64, "one_program_max": 0}])
def test_align_groups_by_slot_rank(launches):
    """``active_slots``: tokens of slots 1 and 6 of 8, bound 2, are grouped by their slots' ranks (2·E groups,
    fewer tiles than 8·E would give) and the tiles still name ``slot·E + expert``; bound 1 keeps slot 1's pairs
    alone (slot 6 ranks past it); a bound at S or above changes nothing."""
    g = torch.Generator().manual_seed(21)
    num_tokens = 300
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(num_tokens)]).int()
    slots = {"token_slots": torch.tensor([6, 1, -1], dtype=torch.int32)[torch.arange(num_tokens) % 3],
             "slot_flags": torch.ones(8, dtype=torch.int32)}
    free = _groups_of(moe_align_ref(ids, E, 16, **slots))
    for bound in (2, 8, 0):
        got = moe_align(ids, E, 16, **slots, **launches, active_slots=bound)
        want = moe_align_ref(ids, E, 16, **slots, active_slots=bound)
        assert _groups_of(got) == _groups_of(want) == free and got.max_blocks == want.max_blocks
        assert torch.equal(got.block_group, want.block_group) and torch.equal(got.num_blocks, want.num_blocks)
        assert got.max_blocks == max_blocks(ids.numel(), (2 if bound == 2 else 8) * E, 16)
    for align in (moe_align(ids, E, 16, **slots, **launches, active_slots=1),
                  moe_align_ref(ids, E, 16, **slots, active_slots=1)):
        assert _groups_of(align) == {group: pairs for group, pairs in free.items() if group // E == 1}
    with pytest.raises(ValueError, match="active_slots"):
        moe_align(ids, E, 16, **slots, active_slots=-1)


@pytest.mark.parametrize("experts, slots, block_m", [(6, 5, 16), (5, 7, 4), (3, 3, 16)])
@pytest.mark.parametrize("launches", [{"one_program_max": 1 << 30}, {"chunk": 16, "one_program_max": 0}])
def test_align_by_slot_rank_at_any_shape(experts, slots, block_m, launches):
    """Slot ranks with experts and slots that are no powers of two, every bound from a broken one up to S:
    the kernel agrees with the reference (a broken bound drops the same slots' pairs in both)."""
    g = torch.Generator().manual_seed(experts * 10 + slots)
    num_tokens = 70
    ids = torch.stack([torch.randperm(experts, generator=g)[:K] for _ in range(num_tokens)]).int()
    token_slots = torch.randint(-1, slots, (num_tokens,), generator=g, dtype=torch.int32)
    flags = (torch.arange(slots) != 1).int()  # slot 1 has no expert LoRA: ranked, but no group
    for bound in range(1, slots + 1):
        want = moe_align_ref(ids, experts, block_m, token_slots, flags, active_slots=bound)
        ranks = slot_ranks(token_slots, slots, bound)  # made once, as a step does for its layers
        for given in (None, ranks):
            got = moe_align(ids, experts, block_m, token_slots, flags, **launches, active_slots=bound, ranks=given)
            assert _groups_of(got) == _groups_of(want)
            assert torch.equal(got.block_group, want.block_group) and torch.equal(got.num_blocks, want.num_blocks)


@pytest.mark.parametrize("slots, bound", [(8, 2), (5, 3), (32, 4), (3, 1), (64, 5)])
def test_slot_ranks_of_the_tokens(slots, bound):
    """`slot_ranks` against `ranks_ref` on random slots (with -1 tokens; at 32 and 64 slots the kernel
    walks the 300 tokens in several blocks); none at a bound of 0 or >= S; bad input refused."""
    g = torch.Generator().manual_seed(slots * 7 + bound)
    chosen = torch.randperm(slots, generator=g)[:bound]
    token_slots = torch.cat([chosen, torch.tensor([-1])])[torch.randint(0, bound + 1, (300,), generator=g)].int()
    rank, inverse = slot_ranks(token_slots, slots, bound)
    want_rank, want_inverse = ranks_ref(token_slots, slots, bound)
    present = sorted(set(token_slots.tolist()) - {-1})
    assert rank.dtype == inverse.dtype == torch.int32 and rank.shape == (triton.next_power_of_2(slots),)
    assert torch.equal(rank[:slots].long(), want_rank) and inverse[:len(present)].tolist() == present
    assert torch.equal(inverse[:bound].long(), want_inverse)
    assert slot_ranks(token_slots, slots, 0) is None and slot_ranks(token_slots, slots, slots) is None
    for bad, match in (((token_slots.long(), slots, bound), "token_slots"), ((token_slots[::2], slots, bound),
                       "token_slots"), ((token_slots, 0, bound), "num_slots"), ((token_slots, slots, -1), "active")):
        with pytest.raises(ValueError, match=match):
            slot_ranks(*bad)


def test_align_takes_given_ranks_and_refuses_bad_ones(monkeypatch):
    """Given ranks are used (no rank launch); ranks of another shape, or on CPU of other tokens, are refused
    by the kernel path and the reference alike."""
    ids = torch.zeros(6, K, dtype=torch.int32)
    token_slots, flags = torch.tensor([0, 3, -1, 0, 3, 3], dtype=torch.int32), torch.ones(8, dtype=torch.int32)
    ranks = slot_ranks(token_slots, 8, 2)
    want = moe_align_ref(ids, E, 16, token_slots, flags, active_slots=2)
    foreign = slot_ranks(token_slots[1:2], 8, 2)  # slot 3 alone: slot 0 would share its rank
    for align in (moe_align, moe_align_ref):
        for bad, match in ((slot_ranks(token_slots, 8, 4), "ranks must be"), ((ranks[0].long(), ranks[1]),
                           "ranks must be"), (slot_ranks(token_slots, 16, 2), "ranks must be"),
                           (ranks[:1], "ranks must be"), (foreign, "not slot_ranks of these tokens")):
            with pytest.raises(ValueError, match=match):
                align(ids, E, 16, token_slots, flags, active_slots=2, ranks=bad)
    monkeypatch.setattr(moe_align_module, "slot_ranks", lambda *a: pytest.fail("ranked again"))
    got = moe_align(ids, E, 16, token_slots, flags, active_slots=2, ranks=ranks)
    assert torch.equal(got.block_group, want.block_group) and _groups_of(got) == _groups_of(want)


def test_align_defaults_to_three_launches_for_many_pairs():
    num_tokens = 1300  # 2600 pairs + 8 groups > ONE_PROGRAM_WORK: three launches, 256 pairs per program
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(num_tokens)]).int()
    assert _launch_split(ids.numel(), E, None, None) == (False, 256)
    got, want = moe_align(ids, E, 16), moe_align_ref(ids, E, 16)
    assert torch.equal(got.num_blocks, want.num_blocks) and torch.equal(got.block_group, want.block_group)
    assert _groups_of(got) == _groups_of(want)


def test_align_of_no_pairs_and_bad_chunks():
    ids = torch.zeros(0, K, dtype=torch.int32)
    slots = {"token_slots": torch.zeros(0, dtype=torch.int32), "slot_flags": torch.ones(400, dtype=torch.int32)}
    got = moe_align(ids, E, 16, **slots)  # 3200 groups: more than one program's share, but nothing to align
    assert int(got.num_blocks) == 0 and (got.block_group == -1).all()
    with pytest.raises(ValueError, match="power of two"):
        moe_align(torch.zeros(3, K, dtype=torch.int32), E, 16, chunk=300)


def test_align_rejects_bad_arguments():
    ids = torch.zeros(3, K, dtype=torch.int32)
    with pytest.raises(ValueError, match="topk_ids"):
        moe_align(ids.long(), E, 16)
    with pytest.raises(ValueError, match="together"):
        moe_align(ids, E, 16, token_slots=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="token_slots"):
        moe_align(ids, E, 16, torch.zeros(4, dtype=torch.int32), torch.ones(2, dtype=torch.int32))


def test_launch_config_buckets_by_load():
    small, large = launch_config("base", "none", 1, "cpu"), launch_config("base", "none", 1e6, "cpu")
    assert small["block_m"] < large["block_m"]
    assert launch_config("lora", "none", 1, "cpu")["block_m"] == 1  # pair mode for about one pair per group


def test_launch_config_falls_back_to_a_sibling_gpu(monkeypatch):
    """Given device keys in order (`config_devices`), the first whose file has the shape serves it."""
    files = {"moe_gpu_b.json": {"S": {"base": [{"block_m": 32, "max_load": 1e12}]}},
             "moe_gpu_c.json": {"S": {"base": [{"block_m": 128, "max_load": 1e12}]}}}
    real = moe_align_module._config_file
    monkeypatch.setattr(moe_align_module, "_config_file", lambda name: files.get(name) or real(name))
    assert launch_config("base", "S", 1, ("gpu_a", "gpu_b", "gpu_c"))["block_m"] == 32
    assert launch_config("base", "S", 1, ("gpu_c", "gpu_b"))["block_m"] == 128
    assert launch_config("base", "S", 1, "gpu_a") == launch_config("base", "none", 1, "cpu")  # the default


# --- references -----------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", TOKENS)
def test_reference_matches_per_token_loop(num_tokens):
    w_gate_up, w_down = _weights(torch.float32)
    x, logits = _inputs(num_tokens, torch.float32)
    weights, ids = route_topk_ref(logits, K, True)
    want = _loop_moe(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(fused_experts_ref(x, w_gate_up, w_down, weights, ids), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_reference_matches_transformers_block(norm_topk_prob):
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                            norm_topk_prob=norm_topk_prob, hidden_act="silu")
    block = Qwen3MoeSparseMoeBlock(config)
    w_gate_up, w_down = _weights(torch.float32, seed=3)
    with torch.no_grad():
        block.experts.gate_up_proj.copy_(w_gate_up)
        block.experts.down_proj.copy_(w_down)
        torch.nn.init.normal_(block.gate.weight, std=0.3)
        x, _ = _inputs(40, torch.float32, seed=3)
        want = block(x[None])[0]
        got = fused_moe_ref(x, F.linear(x, block.gate.weight), w_gate_up, w_down, K, norm_topk_prob)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --- Triton vs reference --------------------------------------------------------------------------


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_fused_moe_matches_reference(num_tokens, dtype, config):
    w_gate_up, w_down = _weights(dtype, seed=num_tokens)
    x, logits = _inputs(num_tokens, dtype, seed=num_tokens)
    got = fused_moe(x, logits, w_gate_up, w_down, K, True, config=CONFIGS[config])
    want = fused_moe_ref(x, logits, w_gate_up, w_down, K, True, config=CONFIGS[config])
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def _stage_inputs(num_tokens, dtype, config):
    w_gate_up, w_down = _weights(dtype, seed=5)
    x, logits = _inputs(num_tokens, dtype, seed=5)
    weights, ids = route_topk_ref(logits, K, False)
    return x, w_gate_up, w_down, weights, ids, moe_align(ids, E, config["block_m"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_stages_write_every_pair(dtype):
    """Outputs start as NaN: every routed pair must be written, and match the reference."""
    config = CONFIGS["even"]
    x, w_gate_up, w_down, weights, ids, align = _stage_inputs(40, dtype, config)
    act, act_ref = (torch.full((ids.numel(), I), float("nan"), dtype=dtype) for _ in range(2))
    moe_gate_up(x, w_gate_up, ids, align, act, config=config)
    moe_gate_up_ref(x, w_gate_up, ids, align, act_ref, config=config)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(act, act_ref, rtol=tol, atol=tol)
    y, y_ref = (torch.full((ids.numel(), H), float("nan"), dtype=dtype) for _ in range(2))
    moe_down(act, w_down, ids, weights, align, y, config)
    moe_down_ref(act, w_down, ids, weights, align, y_ref, config)
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)


def test_gate_up_leaves_lora_pairs_raw():
    """Pairs whose slot has expert LoRA go to ``raw`` un-activated; the rest to ``act``."""
    config = CONFIGS["even"]
    x, w_gate_up, _, _, ids, align = _stage_inputs(40, torch.float32, config)
    slots = torch.tensor([-1, 0, 1, 2] * 10, dtype=torch.int32)
    flags = torch.tensor([1, 0, 1], dtype=torch.int32)
    outs = []
    for fn in (moe_gate_up, moe_gate_up_ref):
        act = torch.full((ids.numel(), I), float("nan"))
        raw = torch.full((ids.numel(), 2 * I), float("nan"))
        fn(x, w_gate_up, ids, align, act, raw, slots, flags, config)
        outs.append((act, raw))
    lora = torch.tensor([s in (0, 2) for s in slots.tolist()]).repeat_interleave(K)
    for act, raw in outs:
        assert act[lora].isnan().all() and not act[~lora].isnan().any()
        assert raw[~lora].isnan().all() and not raw[lora].isnan().any()
    torch.testing.assert_close(outs[0][0], outs[1][0], equal_nan=True, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], equal_nan=True, rtol=1e-5, atol=1e-5)
    h = torch.stack([w_gate_up[e] @ x[p // K] for p, e in enumerate(ids.reshape(-1).tolist())])
    torch.testing.assert_close(outs[0][1][lora], h[lora], rtol=1e-5, atol=1e-5)


def test_fused_experts_rejects_bad_arguments():
    w_gate_up, w_down = _weights(torch.float32)
    x, logits = _inputs(4, torch.float32)
    weights, ids = route_topk_ref(logits, K, True)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_experts(x, w_gate_up, w_down, weights, ids.long())
    with pytest.raises(ValueError, match="topk_weights"):
        fused_experts(x, w_gate_up, w_down, weights.half(), ids)
    with pytest.raises(ValueError, match="w_down"):
        fused_experts(x, w_gate_up, w_down.half(), weights, ids)
    with pytest.raises(ValueError, match="w_gate_up"):
        fused_experts(x, w_gate_up[:, :-1], w_down, weights, ids)
    with pytest.raises(ValueError, match="unit stride"):
        fused_experts(x, w_gate_up.transpose(1, 2).contiguous().transpose(1, 2), w_down, weights, ids)
    with pytest.raises(ValueError, match="top_k"):
        route_topk(logits, E + 1, True)


# --- GPU: real shapes in bf16 -------------------------------------------------------------------

GPU_SHAPES = {"gpt-oss-20b": (2880, 2880, 32, 4), "qwen3-30b-a3b": (2048, 768, 128, 8)}


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 1024])
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
def test_gpu_fused_moe_bf16(shape, num_tokens):
    hidden, inter, experts, top_k = GPU_SHAPES[shape]
    w_gate_up, w_down = _weights(torch.bfloat16, hidden=hidden, inter=inter, experts=experts, device="cuda")
    x, logits = _inputs(num_tokens, torch.bfloat16, hidden=hidden, experts=experts, device="cuda")
    got = fused_moe(x, logits, w_gate_up, w_down, top_k, True)
    want = fused_moe_ref(x.float(), logits, w_gate_up.float(), w_down.float(), top_k, True)
    assert _rel_err(got, want) <= 1e-2


@pytest.mark.gpu
def test_gpu_compiles_once_across_token_counts():
    from unipage.kernels.fused_moe import _moe_gemm_kernel

    hidden, inter, experts, top_k = GPU_SHAPES["gpt-oss-20b"]
    w_gate_up, w_down = _weights(torch.bfloat16, hidden=hidden, inter=inter, experts=experts, device="cuda")
    config = launch_config("base", "none", 1, "cpu")
    sizes = []
    for num_tokens in (1, 2, 3, 5, 16, 17):
        x, logits = _inputs(num_tokens, torch.bfloat16, hidden=hidden, experts=experts, device="cuda")
        fused_moe(x, logits, w_gate_up, w_down, top_k, True, config=config)
        sizes.append(len(_moe_gemm_kernel.device_caches[torch.cuda.current_device()][0]))
    assert sizes[-1] == sizes[0]  # the first call compiled gate/up and down; no length recompiles


@pytest.mark.gpu
def test_gpu_align_compiles_once_across_chunk_sizes():
    from unipage.kernels.moe_align import _align_count_kernel, _align_scatter_kernel

    def cached():
        return [len(k.device_caches[torch.cuda.current_device()][0]) for k in (_align_count_kernel, _align_scatter_kernel)]

    sizes = []
    for num_tokens in (350, 600, 1000, 3000, 4096):  # top-8: 2800-32768 pairs, three launches of 256-1024
        g = torch.Generator().manual_seed(num_tokens)
        ids = torch.stack([torch.randperm(128, generator=g)[:8] for _ in range(num_tokens)]).int().cuda()
        got, want = moe_align(ids, 128, 64), moe_align_ref(ids, 128, 64)
        assert torch.equal(got.num_blocks, want.num_blocks) and torch.equal(got.block_group, want.block_group)
        assert _groups_of(got) == _groups_of(want)
        sizes.append(cached())
    assert sizes[-1] == sizes[0]  # the pairs per program are a runtime value: no new compile per size
