"""Paged fused_moe_lora on the GPU (``-m gpu``), in bf16 at GPT-OSS-20B and Qwen3-30B-A3B layers: the
adapters' pages scattered over a pool of noise, against the float32 reference.  `_gpu_case` and
`_check_gpu` serve the other MoE LoRA test files' GPU tests too."""

import dataclasses
import functools
import math

import pytest
import torch

from unipage.adapter_pack import pack_adapter, random_lora_weights
from unipage.config import ModelConfig
from unipage.kernels.fused_moe import fused_experts, fused_experts_ref, route_topk_ref
from unipage.kernels.fused_moe_lora import lora_config as tuned_config
from unipage.kernels.fused_moe_lora import MoeLora, moe_lora_meta, plan_moe_lora
from unipage.kernels.moe_ranks import slot_ranks
from unipage.lora_layout import TargetSpec, build_layout

GPU_SHAPES = {"gpt-oss-20b": (2880, 2880, 32, 4, 32), "qwen3-30b-a3b": (2048, 768, 128, 8, 16)}


def _gpu_case(shape, num_tokens, adapters=8):
    hidden, inter, experts, top_k, rank = GPU_SHAPES[shape]
    model = ModelConfig(num_layers=1, hidden_size=hidden, num_heads=32, num_kv_heads=8, head_dim=64,
                        num_experts=experts, top_k=top_k, expert_intermediate_size=inter, dtype="bfloat16")
    specs = [[(TargetSpec("experts.gate_up", (rank,)) if a % 2 else TargetSpec("experts.gate_up", (rank, rank)),
               TargetSpec("experts.down", (rank,)))] for a in range(adapters)]
    g = torch.Generator().manual_seed(0)
    layouts = [build_layout(model, s) for s in specs]
    page_elems = 16 * 2 * 8 * 64
    pages = [lay.num_pages(page_elems) for lay in layouts]
    order = torch.randperm(sum(pages) + 16, generator=g).tolist()
    pool = torch.randn(sum(pages) + 16, page_elems, generator=g).to(torch.bfloat16)
    table = torch.zeros(adapters, max(pages), dtype=torch.int32)
    std = 0.5 / math.sqrt(hidden)
    for s, lay in enumerate(layouts):
        ids = [order.pop() for _ in range(pages[s])]
        pool[ids] = pack_adapter(lay, random_lora_weights(lay, g, std=std * 10), page_elems, torch.bfloat16)[0]
        table[s, : pages[s]] = torch.tensor(ids, dtype=torch.int32)
    slots = (torch.arange(num_tokens) % adapters).int()
    lora = MoeLora(pool.cuda(), table.cuda(), slots.cuda(), moe_lora_meta(layouts, 0, "cuda"))
    x = torch.randn(num_tokens, hidden, generator=g).to("cuda", torch.bfloat16)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to("cuda", torch.bfloat16)
    w_down = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to("cuda", torch.bfloat16)
    topk_weights, topk_ids = route_topk_ref(torch.randn(num_tokens, experts, generator=g).cuda(), top_k, True)
    return x, w_gate_up, w_down, topk_weights, topk_ids, lora


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 256, 2048])
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
def test_gpu_fused_moe_lora_bf16(shape, num_tokens):
    _check_gpu(*_gpu_case(shape, num_tokens))


def _check_gpu(x, w_gate_up, w_down, topk_weights, topk_ids, lora, lora_config=None):
    got = fused_experts(x, w_gate_up, w_down, topk_weights, topk_ids, lora, lora_config=lora_config)
    lora32 = MoeLora(lora.pool.float(), lora.page_table, lora.token_slots, lora.meta)
    want = fused_experts_ref(x.float(), w_gate_up.float(), w_down.float(), topk_weights, topk_ids, lora32)
    base = fused_experts_ref(x.float(), w_gate_up.float(), w_down.float(), topk_weights, topk_ids)
    assert ((want - base).norm() / base.norm()).item() > 0.1  # the LoRA delta is not negligible
    assert ((got.float() - want).norm() / want.norm()).item() <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [256, 4096])
def test_gpu_slot_ranks_of_a_step(num_tokens):
    """Setup (b)'s mix: 4 adapters a step out of 16 resident slots, bound 4 (the alignment by slot rank, in
    group mode, the side stream as tuned) against the unbounded reference."""
    x, w_gate_up, w_down, topk_weights, topk_ids, lora = _gpu_case("qwen3-30b-a3b", num_tokens, adapters=16)
    lora = dataclasses.replace(lora, token_slots=(lora.token_slots % 4) * 4 + 1, active_slots=4)
    _check_gpu(x, w_gate_up, w_down, topk_weights, topk_ids, lora)
    ranks = slot_ranks(lora.token_slots, lora.meta.slot_flags.shape[0], 4)  # once for a step's layers
    _check_gpu(x, w_gate_up, w_down, topk_weights, topk_ids, dataclasses.replace(lora, ranks=ranks))
    config = tuned_config(lora, topk_ids)  # the bound's (group mode); unbounded, 16 slots would pick pair mode
    assert plan_moe_lora(lora, topk_ids).align.max_blocks < plan_moe_lora(
        dataclasses.replace(lora, active_slots=None), topk_ids, config).align.max_blocks


def _compiled(kernel) -> int:
    return len(kernel.device_caches[torch.cuda.current_device()][0])


@pytest.mark.gpu
@pytest.mark.parametrize("load", [1, 1e9])  # pair mode, group mode
def test_gpu_lora_compiles_once_across_token_counts(load):
    from unipage.kernels import fused_moe_lora as fl
    from unipage.kernels.moe_align import launch_config

    kernels = (fl._moe_shrink_kernel, fl._expand_gate_up_kernel, fl._expand_down_kernel)
    config = launch_config("lora", "none", load, "cpu")
    x, w_gate_up, w_down, topk_weights, topk_ids, lora = _gpu_case("qwen3-30b-a3b", 64)
    counts = []
    for num_tokens in (1, 2, 3, 5, 17, 64):
        part = MoeLora(lora.pool, lora.page_table, lora.token_slots[:num_tokens].contiguous(), lora.meta)
        fused_experts(x[:num_tokens], w_gate_up, w_down, topk_weights[:num_tokens].contiguous(),
                      topk_ids[:num_tokens].contiguous(), part, lora_config=config)
        counts.append([_compiled(k) for k in kernels])
    assert counts[-1] == counts[0]


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [4, 8])
def test_gpu_small_tiles_bf16(block_m):
    """Small tiles (broadcast-reduce math over a few pairs of one group) at Qwen3-30B-A3B's shape, 4 adapters:
    the compiled kernels, not only the interpreter (which takes a dot of any height)."""
    from unipage.kernels.fused_moe_lora import lora_config

    case = _gpu_case("qwen3-30b-a3b", 256, adapters=4)
    tuned = lora_config(case[-1], case[4])
    _check_gpu(*case, {**tuned, "block_m": block_m, "shrink": {**tuned["shrink"], "whole_k": False},
                       "gate_up": {**tuned["gate_up"], "block_n": 128, "num_warps": 1, "maxnreg": 0},
                       "down": {**tuned["down"], "block_n": 256, "num_warps": 4}})


@pytest.mark.gpu
@pytest.mark.parametrize("adapters, num_tokens", [(8, 2048), (4, 256), (4, 1024), (4, 4096)])  # group mode entries
def test_gpu_overlap_on_a_side_stream(adapters, num_tokens, monkeypatch):
    """Config "overlap": the plan and the gate/up shrink on a side stream beside the base GEMM give the
    same output as on one stream, eagerly and replayed in a CUDA graph (the fork and join captured).  The
    shrink first sleeps ~1 ms on the device, so a missing or misplaced join would let the expand read
    its partials before they are written."""
    from unipage.kernels import fused_moe_lora as fl
    from unipage.kernels import moe_lora_side

    case = _gpu_case("qwen3-30b-a3b", num_tokens, adapters=adapters)
    x, w_gate_up, w_down, topk_weights, topk_ids, lora = case
    tuned = {**fl.lora_config(lora, topk_ids), "overlap": False}
    assert tuned["block_m"] > 1
    forks, real_fork, real_shrink = [], moe_lora_side.fork, fl.moe_lora_shrink

    def slow_shrink(plan, x):
        torch.cuda._sleep(2_000_000)
        real_shrink(plan, x)

    monkeypatch.setattr(moe_lora_side, "fork", lambda device: forks.append(device) or real_fork(device))
    monkeypatch.setattr(fl, "moe_lora_shrink", slow_shrink)
    _check_gpu(*case, {**tuned, "overlap": True})
    assert forks  # the side stream was used
    one = fused_experts(*case, lora_config=tuned)
    run = functools.partial(fused_experts, *case, lora_config={**tuned, "overlap": True})
    run()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    x.copy_(torch.randn_like(x))  # new inputs in place: the replay must read them, not the captured values
    graph.replay()
    torch.cuda.synchronize()
    want = fused_experts(*case, lora_config=tuned)
    assert not torch.equal(want, one)
    assert ((out.float() - want.float()).norm() / want.float().norm()).item() <= 1e-3
