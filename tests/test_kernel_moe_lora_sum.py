"""The MoE LoRA down delta fused into the top-k sum (`moe_lora_sum`, the config's ``"down": {"sum": true}``).

Same tiny layers and adapter mixes as test_kernel_fused_moe_lora (mixed ranks, both gate/up formats,
slots without expert LoRA in the layer, tokens with no adapter), Triton under the interpreter on CPU.
"""

import pytest
import torch

import test_kernel_fused_moe_lora as base
import test_kernel_fused_moe_lora_gpu as gpu
from unipage.kernels.fused_moe_lora import moe_lora_down, moe_lora_gate_up, plan_moe_lora
from unipage.kernels.moe_lora_sum import moe_lora_down_sum, moe_lora_down_sum_ref, sums_down


def _sum_config(block_n=64, split_k=2, block_m=1):
    config = base._lora_config(block_m, split_k=split_k, block_n=block_n)
    return {**config, "down": {**config["down"], "sum": True}}


def _prepared(c, config):
    """A plan whose gate/up pass has run (so ``down_z`` is filled), with ``act`` and a random ``y``."""
    lora, ids = c["lora"], c["topk_ids"]
    num_pairs = ids.numel()
    g = torch.Generator().manual_seed(4)
    raw = torch.randn(num_pairs, 2 * base.I, generator=g).to(c["x"].dtype)
    act = torch.randn(num_pairs, base.I, generator=g).to(c["x"].dtype)
    plan = plan_moe_lora(lora, ids, config)
    moe_lora_gate_up(plan, c["x"], raw, act)
    y = torch.randn(num_pairs, base.H, generator=g).to(c["x"].dtype)
    return plan, act, y


@pytest.mark.parametrize("mix", ["uniform", "zipf", "distinct", "none"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("block_m", [1, 16])
def test_down_sum_matches_reference_and_separate_pass(mix, dtype, block_m):
    """Pair mode and group mode (``down_z`` left by group mode's gate/up pass)."""
    c = base._case(19, dtype, mix, seed=21)
    plan, act, y = _prepared(c, _sum_config(block_m=block_m))
    y_before = y.clone()
    got = moe_lora_down_sum(plan, act, y, c["topk_weights"])
    assert torch.equal(y, y_before)  # y is read, never written
    base._close(got, moe_lora_down_sum_ref(plan, act, y, c["topk_weights"]), dtype)
    assert torch.equal(y, y_before)  # nor by the reference
    separate = y.clone()
    moe_lora_down(plan, act, separate, c["topk_weights"])
    base._close(got, separate.view(19, base.K, base.H).float().sum(1), dtype)


@pytest.mark.parametrize("hidden, block_n", [(96, 128), (96, 64), (200, 128)])
def test_down_sum_ragged_tiles(hidden, block_n):
    """Column tiles past H (EVEN_N off), one tile wider than H (H = 96 in one 128-wide tile)."""
    c = base._case(9, torch.float32, "uniform", seed=22, hidden=hidden)
    config = _sum_config(block_n=block_n)
    got = base._run(base.fused_experts, c, config)
    base._close(got, base._loop_moe(c, torch.float32), torch.float32)


@pytest.mark.parametrize("slots", [[("fused", 2), ("split", 4)], [("fused", 1), ("down_only", 1), None]])
@pytest.mark.parametrize("sums", [False, True])
def test_pair_tiles_shorter_than_the_pads(slots, sums):
    """Ranks below 16: pair mode's tiles (`tile_ranks`: 4 / 8 rows, or 2 for rank 1) are shorter than
    the scratch rows' 16-wide stride; both down paths."""
    from unipage.kernels.moe_lora_plan import lora_pads, tile_ranks

    c = base._case(13, torch.float32, "uniform", seed=26, slots=slots)
    meta = c["lora"].meta
    assert max(tile_ranks(meta, 1)) < lora_pads(meta)[2] == 16
    config = _sum_config() if sums else base._lora_config(1, split_k=2)
    base._close(base._run(base.fused_experts, c, config), base._loop_moe(c, torch.float32), torch.float32)


def test_fused_experts_takes_the_sum_path_where_the_config_says(monkeypatch):
    import unipage.kernels.moe_lora_sum as module

    calls = []
    real = module.moe_lora_down_sum

    def spy(*args):
        calls.append(args[0].config["block_m"])
        return real(*args)

    monkeypatch.setattr(module, "moe_lora_down_sum", spy)
    monkeypatch.setattr(base.fused_experts.__globals__["_TRITON"], "lora_down_sum", spy)
    c = base._case(23, torch.float32, "zipf", seed=23)
    group = {**base.GROUP, "down": {**base.GROUP["down"], "sum": True}}
    for config in (_sum_config(), group, base.GROUP):
        base._close(base._run(base.fused_experts, c, config), base._loop_moe(c, torch.float32), torch.float32)
    assert calls == [1, 16]
    assert sums_down(plan_moe_lora(c["lora"], c["topk_ids"], _sum_config()))
    assert sums_down(plan_moe_lora(c["lora"], c["topk_ids"], group))
    assert not sums_down(plan_moe_lora(c["lora"], c["topk_ids"], base.GROUP))


def test_sum_max_tokens_bounds_the_steps_that_sum():
    """``"sum_max_tokens"``: steps of more tokens take the separate down pass (same output)."""
    c = base._case(23, torch.float32, "zipf", seed=27)
    for limit, sums in ((23, True), (22, False)):
        config = _sum_config(block_m=16)
        config["down"]["sum_max_tokens"] = limit
        assert sums_down(plan_moe_lora(c["lora"], c["topk_ids"], config)) == sums
        base._close(base._run(base.fused_experts, c, config), base._loop_moe(c, torch.float32), torch.float32)


def test_sum_must_be_a_bool():
    c = base._case(5, torch.float32, "uniform", seed=28)
    for bad in ("dense", 1, None):
        plan = plan_moe_lora(c["lora"], c["topk_ids"], _sum_config())
        plan.config["down"]["sum"] = bad
        with pytest.raises(ValueError, match="down.sum"):
            sums_down(plan)


def test_reference_engine_path_matches_loop():
    c = base._case(11, torch.float32, "uniform", seed=24)
    base._close(base._run(base.fused_experts_ref, c, _sum_config()), base._loop_moe(c, torch.float32), torch.float32)


def test_bad_y_is_rejected():
    c = base._case(5, torch.float32, "uniform", seed=25)
    plan, act, y = _prepared(c, _sum_config())
    with pytest.raises(ValueError, match="y must be contiguous"):
        moe_lora_down_sum(plan, act, y[:, :-1], c["topk_weights"])
    with pytest.raises(ValueError, match="topk_weights"):
        moe_lora_down_sum(plan, act, y, c["topk_weights"].double())


@pytest.mark.gpu
def test_gpu_tuned_entry_at_four_adapters():
    """The tuned entry as shipped at 256 tokens of 4 adapters (on an H200: Qwen3's decode entry, group mode
    with the whole-K shrink on the side stream and the down delta in the sum, one warp)."""
    from unipage.kernels.fused_moe_lora import lora_config

    case = gpu._gpu_case("qwen3-30b-a3b", 256, adapters=4)
    config = lora_config(case[-1], case[4])
    if torch.cuda.get_device_name() == "NVIDIA H200":
        assert config["block_m"] == 16 and config["down"].get("sum") and config.get("overlap")
    gpu._check_gpu(*case)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 256])
@pytest.mark.parametrize("shape", sorted(gpu.GPU_SHAPES))
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("block_m", [1, 16])
def test_gpu_down_sum_bf16(shape, num_tokens, pdl, block_m):
    from unipage.kernels.fused_moe_lora import MoeLora, lora_config

    x, w_gate_up, w_down, topk_weights, topk_ids, lora = gpu._gpu_case(shape, num_tokens)
    config = dict(lora_config(lora, topk_ids), block_m=block_m, pdl=pdl)
    if block_m > 1:  # (a pair-mode entry's one-warp, wide gate/up tile would spill in group mode)
        config.update(split_k=1, shrink={"group_m": 8, "num_warps": 4, "num_stages": 2},
                      gate_up={"block_n": 64, "group_m": 8, "num_warps": 4, "num_stages": 2})
    config["down"] = {**config["down"], "sum": True, "block_n": 128}
    got = base.fused_experts(x, w_gate_up, w_down, topk_weights, topk_ids, lora, lora_config=config)
    separate = base.fused_experts(x, w_gate_up, w_down, topk_weights, topk_ids, lora,
                                  lora_config={**config, "down": {**config["down"], "sum": False}})
    lora32 = MoeLora(lora.pool.float(), lora.page_table, lora.token_slots, lora.meta)
    want = base.fused_experts_ref(x.float(), w_gate_up.float(), w_down.float(), topk_weights, topk_ids, lora32)
    assert ((got.float() - want).norm() / want.norm()).item() <= 1e-2
    assert ((got.float() - separate.float()).norm() / want.norm()).item() <= 1e-2
