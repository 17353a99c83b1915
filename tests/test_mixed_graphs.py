"""The piecewise forward pass of mixed steps (`unipage.mixed_graphs`) on CPU, pieces run eagerly.

Every step of these runs goes through the pieces (no decode graphs on CPU):
padded to its token bucket, inputs in the static buffers, attention between
the pieces.  The logits must still be transformers + PEFT's for each
sequence's adapter, under chunked prefill that mixes prompt chunks and decodes.
"""

from __future__ import annotations

import dataclasses

import engine_support as es
import pytest
import torch
from test_engine_parity import GREEDY, TOL, mixed_batch
from unipage.scheduler import SchedulerConfig

from unipage import LLM
from unipage.config import LoRAConfig, PoolConfig
from unipage.mixed_graphs import MixedGraphs, token_buckets


family = es.family_fixture(["llama", "qwen3_moe", "gpt_oss"])


def test_token_buckets():
    assert token_buckets(2048) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert token_buckets(4096)[-5:] == [2048, 2560, 3072, 3584, 4096]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(16) == [16] and token_buckets(5) == [5]


def piecewise_llm(family, budget: int) -> LLM:
    llm = LLM(family.model_dir, family.adapters, device="cpu", pool=PoolConfig(num_pages=512),
              lora=LoRAConfig(max_rank=32, max_adapters_per_batch=8),
              scheduler=SchedulerConfig(max_model_len=256, max_num_batched_tokens=budget))
    runner = llm.engine.runner
    runner.mixed = MixedGraphs(runner.model, runner.pool, runner.lora, runner.block_tokens, budget, 8,
                               torch.device("cpu"), capture=False)
    return llm


@pytest.mark.parametrize("budget", [48, 300])
def test_pieces_match_transformers(family, budget):
    """48: prompts split into chunks that share steps with decodes (buckets 16, 32, 48); 300: whole prompts."""
    llm, oracle = piecewise_llm(family, budget), es.Oracle(family)
    runner, steps = llm.engine.runner, []
    execute = runner.execute

    def counted(out, during=None):
        steps.append(len(out.req_ids))
        return execute(out, during)

    runner.execute = counted
    prompts, names = mixed_batch(family, seed=budget, count=6)
    outs = llm.generate(prompts, GREEDY, adapters=names, max_tokens=6, return_logits=True)
    for out in outs:
        assert len(out.token_ids) == 6
        err = es.generated_logits_error(oracle, out)
        assert err <= TOL, f"{out.adapter}: logits differ by {err}"
    mixed = llm.engine.runner.mixed
    assert mixed.replays == sum(1 for n in steps if n) >= 6  # every step that ran a batch went through the pieces
    keys = set(mixed.sets)
    assert any(lora for _, lora, *_ in keys) and all(bucket in mixed.buckets for bucket, *_ in keys)
    assert len({bucket for bucket, *_ in keys}) > 1  # steps of several token counts, padded to their buckets


def test_adapter_classes_of_the_pieces(family):
    """A step's pieces are those of the smallest adapter class (1, 2, 8 under a limit of 8) that holds its
    distinct adapters, their LoRA grids bounded by it; the logits stay transformers + PEFT's."""
    llm, oracle = piecewise_llm(family, 300), es.Oracle(family)
    mixed, names = llm.engine.runner.mixed, list(family.adapters)
    assert mixed.classes == [1, 2, 8]
    seen, bounds = [], set()
    pick, make = mixed._class, mixed._piece_batch
    mixed._class = lambda bucket, active: seen.append((active, pick(bucket, active))) or seen[-1][1]
    mixed._piece_batch = lambda *a: (batch := make(*a), bounds.add(batch.active_slots))[0]  # the pieces' bound
    prompts, _ = mixed_batch(family, seed=5, count=3)
    for adapters, most in (([names[0]] * 3, 1), ([names[0], names[1], None], 2), (names[:3], 3)):
        seen.clear()
        outs = llm.generate(prompts, GREEDY, adapters=adapters, max_tokens=2, return_logits=True)
        for out in outs:
            err = es.generated_logits_error(oracle, out)
            assert err <= TOL, f"{out.adapter}: logits differ by {err}"
        assert max(active for active, _ in seen) == most, adapters
        assert set(seen) <= {(1, 1), (2, 2), (3, 8)}, seen
    assert bounds == {1, 2, 8} and {key[3] for key in mixed.sets if key[1]} == {1, 2, 8}


@pytest.mark.parametrize("pieces", [True, False])
def test_moe_lora_slot_ranks_once_a_step(family, pieces, monkeypatch):
    """With the Triton MoE kernels (under the interpreter; the rest torch), a step's MoE layers align by slot
    rank with the ranks its context made once (pieces or an eager step), and the logits stay transformers
    + PEFT's."""
    from unipage import kernels as K
    from unipage.kernels import moe_align
    from unipage.models import decoder
    from unipage.models.ops import TORCH

    llm, oracle = piecewise_llm(family, 300), es.Oracle(family)
    runner = llm.engine.runner
    if not runner.model.model.num_experts:
        pytest.skip("a dense model: no MoE LoRA")
    runner.model.ops = dataclasses.replace(TORCH, experts=K.fused_experts, plans_lora=True)
    if pieces:
        runner.mixed.classes = [1, 2, 4]  # a class of 4 below the tables' 8 rows: the pieces rank too
    else:
        runner.mixed = None
    made, given, contexts = [], [], []
    make, take, context = decoder.slot_ranks, moe_align._ranks, runner.model.context
    monkeypatch.setattr(decoder, "slot_ranks", lambda *a: made.append(a[1:]) or make(*a))
    monkeypatch.setattr(moe_align, "_ranks",
                        lambda *a: (moe_align._ranked(*a[:3]) and given.append(a[3] is not None)) or take(*a))
    monkeypatch.setattr(runner.model, "context", lambda *a: contexts.append(a[0].active_slots) or context(*a))
    prompts, _ = mixed_batch(family, seed=5, count=3)
    outs = llm.generate(prompts, GREEDY, adapters=list(family.adapters)[:3], max_tokens=2, return_logits=True)
    for out in outs:
        err = es.generated_logits_error(oracle, out)
        assert err <= TOL, f"{out.adapter}: logits differ by {err}"
    slots = runner.lora.page_table.shape[0]
    assert made == [(slots, active) for active in contexts]  # once a step (eager: 3 adapters; pieces: class 4)
    assert all(given) and len(given) >= len(made)  # every ranked alignment took the context's ranks


def test_a_step_with_more_adapters_than_the_grid_runs_eagerly(family):
    """The pieces' LoRA grid covers their largest adapter class (`max_adapters_per_batch`); a step with more
    runs eagerly."""
    llm = piecewise_llm(family, 300)
    mixed = llm.engine.runner.mixed
    mixed.classes = [1]
    prompts, names = mixed_batch(family, seed=3, count=6)
    outs = llm.generate(prompts, GREEDY, adapters=names, max_tokens=2)
    assert all(len(out.token_ids) == 2 for out in outs)
    assert not any(lora for _, lora, *_ in mixed.sets)  # the steps with adapters never reached the pieces


@pytest.mark.parametrize("value", ["prefill", 1, 0, "True"])
def test_cuda_graphs_values_are_checked(family, value):
    with pytest.raises(ValueError, match="cuda_graphs must be None, True, False or 'decode'"):
        LLM(family.model_dir, device="cpu", pool=PoolConfig(num_pages=64), cuda_graphs=value)
    with pytest.raises(ValueError, match="needs the Triton kernels"):
        LLM(family.model_dir, device="cpu", pool=PoolConfig(num_pages=64), cuda_graphs="decode")


@pytest.mark.parametrize("value, message", [("on", "run_ahead must be None, True or False"),
                                            (True, "run_ahead needs the decode CUDA graphs")])
def test_run_ahead_values_are_checked(family, value, message):
    with pytest.raises(ValueError, match=message):
        LLM(family.model_dir, device="cpu", pool=PoolConfig(num_pages=64), run_ahead=value)
