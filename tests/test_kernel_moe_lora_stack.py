"""Expert LoRA from dense stacks (`unipage.kernels.moe_lora_stack`, `fused_experts(..., stack=)`): against the
paged reference (`fused_experts_ref` with the MoeLora alone) and the per-token loop, under the Triton
interpreter at tiny shapes; `-m gpu` in bf16 at real layers."""

import dataclasses
import importlib

import pytest
import test_kernel_fused_moe_lora as lt
import test_kernel_fused_moe_lora_gpu as gpu
import torch
from test_kernel_moe_gptoss import OAI, _biases
from unipage.kernels.fused_moe import fused_experts, fused_experts_ref, moe_gate_up, moe_project
from unipage.kernels.moe_align import moe_align_ref
from unipage.kernels.moe_lora_stack import Ext, build_stack

EVERY = [0, 1, 2, 3, 4, 5]  # lt.SLOTS: slot 2 is empty, slot 3 has no expert LoRA


def _stacked(fn, c, slots=EVERY, **options):
    stack = build_stack(c["lora"], slots)
    return fn(c["x"], c["w_gate_up"], c["w_down"], c["topk_weights"], c["topk_ids"], c["lora"], lt.BASE_CONFIG,
              stack=stack, **options)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("mix", ["uniform", "identical", "distinct", "zipf", "none"])
def test_stacked_matches_the_paged_reference(mix, dtype):
    c = lt._case(40, dtype, mix, seed=3)
    want = lt._run(fused_experts_ref, c, lt.GROUP)
    lt._close(_stacked(fused_experts, c), want, dtype)
    lt._close(_stacked(fused_experts_ref, c), want, dtype)


@pytest.mark.parametrize("num_tokens", [1, 7])
def test_stacked_matches_the_per_token_loop(num_tokens):
    c = lt._case(num_tokens, torch.float32, "uniform", seed=num_tokens)
    lt._close(_stacked(fused_experts, c), lt._loop_moe(c, torch.float32), torch.float32)


def test_wide_blocks_take_several_chunks():
    """Up to 24 gate/up A rows (32 an entry) and down ranks of 32 over five entries: 160-column blocks, three
    dots of 64 (the last half masked), each skipped by tiles none of whose pairs has one of its entries."""
    slots = [("fused", 16), ("split", 8), None, ("down_only", 16), ("fused", 4), ("split", 16)]
    c = lt._case(40, torch.float32, "zipf", seed=8, slots=slots)
    stack = build_stack(c["lora"], [5, 4, 3, 1, 0])
    assert stack.a_gu.shape[1] == stack.b_d.shape[2] == 160
    want = lt._run(fused_experts_ref, c, lt.GROUP)
    lt._close(_stacked(fused_experts, c, slots=[5, 4, 3, 1, 0]), want, torch.float32)


def test_entries_in_any_order_and_slots_without_tokens():
    """Entries follow the given slots, not their ids; a stack may hold slots no token uses (the deltas come
    only from each token's own entry: the entries' columns are summed over nothing else)."""
    c = lt._case(40, torch.float32, "uniform", seed=5)
    c["lora"] = dataclasses.replace(c["lora"], token_slots=torch.where(c["lora"].token_slots == 1, 4,
                                                                      c["lora"].token_slots).int())
    want = lt._run(fused_experts_ref, c, lt.GROUP)
    lt._close(_stacked(fused_experts, c, slots=[5, 4, 1, 0, 3, 2]), want, torch.float32)
    lt._close(_stacked(fused_experts, c, slots=[4, 0, 5, 1]), want, torch.float32)


def test_biases_and_clamped_swiglu():
    c = lt._case(24, torch.float32, "uniform", seed=9)
    b_gu, b_d = _biases(torch.float32, lt.E, lt.I, lt.H)
    options = {"gate_up_bias": b_gu, "down_bias": b_d, "activation": OAI}
    want = fused_experts_ref(c["x"], c["w_gate_up"], c["w_down"], c["topk_weights"], c["topk_ids"], c["lora"],
                             lt.BASE_CONFIG, lt.GROUP, **options)
    lt._close(_stacked(fused_experts, c, **options), want, torch.float32)


def test_tuned_shrink_settings_reach_the_projections(monkeypatch):
    """A base entry's ``"stack"`` settings launch the two shrinks (block_n capped at the block's width)."""
    fused_moe = importlib.import_module("unipage.kernels.fused_moe")
    seen, real = [], fused_moe._launch_gemm

    def spy(a, w, out, align, cfg, **kwargs):
        if not kwargs["gated"] and kwargs.get("weights") is None:
            seen.append((w.shape[1], cfg["block_n"], cfg["num_warps"]))
        return real(a, w, out, align, cfg, **kwargs)

    monkeypatch.setattr(fused_moe, "_launch_gemm", spy)
    c = lt._case(12, torch.float32, "uniform", seed=4)
    stage = {"block_n": 16, "block_k": 32, "group_m": 1, "num_warps": 2, "num_stages": 2}
    config = {**lt.BASE_CONFIG, "stack": {"gate_up": stage, "down": {**stage, "block_n": 128}}}
    stack = build_stack(c["lora"], EVERY)
    got = fused_experts(c["x"], c["w_gate_up"], c["w_down"], c["topk_weights"], c["topk_ids"], c["lora"], config,
                        stack=stack)
    assert seen == [(48, 16, 2), (96, 128, 2)]
    lt._close(got, lt._run(fused_experts_ref, c, lt.GROUP), torch.float32)


def test_stack_layout():
    """Entry m's rows of a_gu are its slot's A; b_gu holds each slice's B at the slice's columns, zero
    elsewhere; empty slots and slots without expert LoRA here stack zeros."""
    c = lt._case(4, torch.float32, seed=1)
    stack = build_stack(c["lora"], [1, 2, 3])
    assert stack.entry_of_slot.tolist() == [-1, 0, 1, 2, -1, -1]
    assert (stack.gate_up_rows, stack.down_rows) == (8, 16) and stack.a_gu.shape[1] == stack.b_gu.shape[2] == 32
    weights = c["weights"][1]
    for e in (0, lt.E - 1):
        m = weights[(lt.LAYER, "experts.gate_up", e)]
        torch.testing.assert_close(stack.a_gu[e, :6], m.a)  # split (4, 2): six A rows
        torch.testing.assert_close(stack.b_gu[e, : lt.I, :4], m.b[0].T)
        torch.testing.assert_close(stack.b_gu[e, lt.I:, 4:6], m.b[1].T)
        assert not stack.b_gu[e, : lt.I, 4:].any() and not stack.b_gu[e, lt.I:, :4].any()
        down = weights[(lt.LAYER, "experts.down", e)]
        torch.testing.assert_close(stack.a_d[e, :8], down.a)
        torch.testing.assert_close(stack.b_d[e, :, :8], down.b[0].T)
    assert not stack.a_gu[:, 8:].any() and not stack.a_d[:, 16:].any()


def test_bad_input_is_refused():
    c = lt._case(8, torch.float32, "uniform", seed=2)
    for slots in ([0, 0], [6], [-1]):
        with pytest.raises(ValueError, match="distinct ids"):
            build_stack(c["lora"], slots)
    with pytest.raises(ValueError, match=r"slots \[1\] have expert LoRA but no entry"):
        _stacked(fused_experts, c, slots=[0, 4, 5])
    stack = build_stack(c["lora"], EVERY)
    args = (c["x"], c["w_gate_up"], c["w_down"], c["topk_weights"], c["topk_ids"])
    with pytest.raises(ValueError, match="needs the layer's MoeLora"):
        fused_experts(*args, None, lt.BASE_CONFIG, stack=stack)
    half = dataclasses.replace(stack, b_d=stack.b_d.half())
    with pytest.raises(ValueError, match="stack.b_d must be"):
        fused_experts(*args, c["lora"], lt.BASE_CONFIG, stack=half)
    align = moe_align_ref(c["topk_ids"], lt.E, 16)
    act = torch.empty(c["topk_ids"].numel(), lt.I)
    z = torch.zeros(c["topk_ids"].numel(), 48)
    ext = Ext(z, stack.b_gu, stack.entry_of_slot, c["lora"].token_slots, 8, lt.K)
    with pytest.raises(ValueError, match="exclude each other"):
        moe_gate_up(c["x"], c["w_gate_up"], c["topk_ids"], align, act, raw=torch.empty(act.shape[0], 2 * lt.I),
                    ext=ext)
    with pytest.raises(ValueError, match="ext.top_k must be the routing's"):
        moe_gate_up(c["x"], c["w_gate_up"], c["topk_ids"], align, act, ext=dataclasses.replace(ext, top_k=1))
    with pytest.raises(ValueError, match="ext.token_slots must be"):
        moe_gate_up(c["x"], c["w_gate_up"], c["topk_ids"], align, act,
                    ext=dataclasses.replace(ext, token_slots=ext.token_slots[:-1]))
    with pytest.raises(ValueError, match="moe_project needs"):
        moe_project(c["x"][:, :32], stack.a_gu, c["topk_ids"], align, z, lt.BASE_CONFIG["gate_up"], a_div=lt.K)
    short = dataclasses.replace(stack, entry_of_slot=stack.entry_of_slot[:2])
    with pytest.raises(ValueError, match="has no row in the stack's entry_of_slot"):
        fused_experts(*args, c["lora"], lt.BASE_CONFIG, stack=short)
    with pytest.raises(ValueError, match="a multiple of 16"):
        moe_gate_up(c["x"], c["w_gate_up"], c["topk_ids"], align, act,
                    ext=dataclasses.replace(ext, a=z[:, :40], w=stack.b_gu[:, :, :40].contiguous()))


# --- GPU: real layers in bf16 ---------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 256, 4096])
@pytest.mark.parametrize("shape", sorted(gpu.GPU_SHAPES))
def test_gpu_stacked_bf16(shape, num_tokens):
    """Five of eight adapters stacked (entries out of slot order), their tokens in a mixed step's order and
    tokens without an adapter, against the float32 paged reference."""
    from unipage.kernels.fused_moe_lora import MoeLora

    x, w_gate_up, w_down, topk_weights, topk_ids, lora = gpu._gpu_case(shape, num_tokens)
    index = torch.arange(num_tokens, device="cuda")
    slots = torch.tensor([6, 1, 4, 7, 2, -1], device="cuda")
    token_slots = torch.where(index < max(num_tokens // 16, 1), slots[index % 6], 2).int()
    case = dataclasses.replace(lora, token_slots=token_slots)
    lora32 = MoeLora(lora.pool.float(), lora.page_table, token_slots, lora.meta)
    want = fused_experts_ref(x.float(), w_gate_up.float(), w_down.float(), topk_weights, topk_ids, lora32)
    got = fused_experts(x, w_gate_up, w_down, topk_weights, topk_ids, case, stack=build_stack(case, [7, 2, 6, 1, 4]))
    assert ((got.float() - want).norm() / want.norm()).item() <= 1e-2
