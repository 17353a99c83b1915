"""The MoE LoRA stacks (`unipage.models.moe_stacks`) in the engine, on CPU in fp32, against transformers + PEFT.

The tiny test models route too few pairs per (adapter, expert) group for the stacks by the default rule
(`MIN_LOAD`), so these tests lift it; steps of at most ``moe_stack_entries`` adapters then take the experts'
LoRA from the stacks, larger ones from the pool's pages.
"""

from __future__ import annotations

import random

import engine_support as es
import pytest
import torch
from test_engine_parity import GREEDY, check, mixed_batch

from unipage import LLM
from unipage.config import LoRAConfig, PoolConfig
from unipage.kernels import moe_lora_stack
from unipage.models import entry_table, moe_stacks
from unipage.scheduler import SchedulerConfig

family = es.family_fixture(["qwen3_moe", "gpt_oss"])
oracle = es.oracle_fixture()


@pytest.fixture(autouse=True)
def any_load(monkeypatch):
    monkeypatch.setattr(moe_stacks, "MIN_LOAD", 0.0)


@pytest.fixture
def stacked_steps(monkeypatch):
    """Counts the MoE layers run from the stacks."""
    calls = []
    real = moe_lora_stack.experts

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(moe_lora_stack, "experts", spy)
    return calls


def make_llm(family, entries=2, **lora) -> LLM:
    return LLM(family.model_dir, family.adapters, device="cpu", pool=PoolConfig(num_pages=512),
               lora=LoRAConfig(max_rank=32, max_adapters_per_batch=8, moe_stack_entries=entries, **lora),
               scheduler=SchedulerConfig(max_model_len=256))


def test_mixed_batch_through_the_stacks(family, oracle, stacked_steps):
    """Two entries for a batch of more adapters: its steps of more than two adapters read the pool's pages,
    later ones (the shorter requests gone) the stacks, which take their entries least recently used first."""
    llm = make_llm(family)
    stacks = llm.engine.runner.moe_stacks
    assert stacks is not None and llm.engine.model.moe_stacks is stacks
    prompts, names = mixed_batch(family)
    check(oracle, llm.generate(prompts, GREEDY, adapters=names, max_tokens=12, return_logits=True), 12)
    single = [[random.Random(i).randrange(1, 128) for _ in range(9)] for i in range(3)]
    for name in family.adapters:
        check(oracle, llm.generate(single, GREEDY, adapters=[name, name, None], max_tokens=6,
                                   return_logits=True), 6)
    assert stacks.fills >= len(family.adapters) and stacked_steps
    fills, first = stacks.fills, next(iter(family.adapters))  # evicted from the two entries since: copied again
    check(oracle, llm.generate(single, GREEDY, adapters=[first, None, first], max_tokens=6, return_logits=True), 6)
    assert stacks.fills == fills + 1


def test_a_readded_adapter_is_copied_again(family, stacked_steps):
    llm = make_llm(family)
    first, other = list(family.adapters)[:2]
    prompt = [5, 9, 2, 7, 31, 4]
    llm.generate(prompt, GREEDY, adapter=first, max_tokens=2)  # its expert LoRA in the stacks now
    llm.remove_adapter(first)
    llm.add_adapter(first, family.adapters[other])
    after = llm.generate(prompt, GREEDY, adapter=first, max_tokens=6, return_logits=True)[0]
    want = llm.generate(prompt, GREEDY, adapter=other, max_tokens=6, return_logits=True)[0]
    assert after.token_ids == want.token_ids and stacked_steps
    assert max((a - b).abs().max().item() for a, b in zip(after.logits, want.logits)) <= 1e-4


def test_below_the_load_the_pages_serve(family, monkeypatch, stacked_steps):
    monkeypatch.setattr(moe_stacks, "MIN_LOAD", 1e9)
    llm = make_llm(family)
    names = list(family.adapters)[:2] + [None]
    llm.generate([[3, 8, 1], [9, 4, 4, 2], [7, 7]], GREEDY, adapters=names, max_tokens=3)
    assert not stacked_steps and llm.engine.runner.moe_stacks.fills == 0  # nor are they filled


def test_settings():
    assert LoRAConfig().moe_stack_entries == 0
    with pytest.raises(ValueError, match="moe_stack_entries"):
        LoRAConfig(moe_stack_entries=-1)


def test_covers_counts_pairs_per_group(monkeypatch):
    monkeypatch.setattr(moe_stacks, "MIN_LOAD", 2.0)
    stacks = object.__new__(moe_stacks.MoeStacks)
    stacks.entries, stacks.top_k, stacks.experts = entry_table.Entries(4), 8, 128
    assert stacks.covers(256, 4) and stacks.covers(256, 1)  # 2,048 pairs: 4 and 16 a group
    assert not stacks.covers(256, 5)  # more adapters than entries
    assert not stacks.covers(64, 4) and not stacks.covers(256, None) and not stacks.covers(256, 0)


# --- GPU: bf16, CUDA graphs through the stacks ------------------------------------------------------


@pytest.mark.gpu
def test_gpu_engine_through_the_stacks_matches_transformers_peft(family, stacked_steps):
    """bf16 Triton engine (decode graphs and mixed-step graphs) with eight entries, so every step takes the
    experts' LoRA from the stacks, against transformers + PEFT as the paged engine is checked (its mean logit
    error at most twice transformers' own in bf16, plus 1 %).  (Against the paged engine in bf16 the two part
    more: the stacks add the gate/up delta to the float32 product, the paged pass to its bf16 rounding.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from test_engine_gpu import check_against_transformers

    llm = check_against_transformers(family, moe_stack_entries=8)
    assert llm.engine.runner.moe_stacks.fills == len(family.adapters) and stacked_steps
