"""The shrink stack (`unipage.models.shrink_stack`) in the engine, on CPU in fp32, against transformers + PEFT.

The tiny test models' projections are too small for a stack by the default rule (`MAX_EXTRA`), so these
tests lift it; the engine then folds every decode step's q/k/v and o shrinks into the projections.
"""

from __future__ import annotations

import random

import engine_support as es
import pytest
import torch
from test_engine_parity import GREEDY, check, mixed_batch

from unipage import LLM
from unipage.config import LoRAConfig, PoolConfig
from unipage.models import entry_table, shrink_stack
from unipage.scheduler import SchedulerConfig


family = es.family_fixture(["llama", "gpt_oss", "qwen3_moe"])


@pytest.fixture(scope="module")
def oracle(family):
    return es.Oracle(family)


@pytest.fixture(autouse=True)
def any_size(monkeypatch):
    monkeypatch.setattr(shrink_stack, "MAX_EXTRA", 1e9)


def make_llm(family, entries=8) -> LLM:
    return LLM(family.model_dir, family.adapters, device="cpu", pool=PoolConfig(num_pages=512),
               lora=LoRAConfig(max_rank=32, max_adapters_per_batch=entries),
               scheduler=SchedulerConfig(max_model_len=256))


def test_mixed_batch_through_the_stack(family, oracle):
    llm = make_llm(family)
    stack = llm.engine.runner.stack
    assert stack is not None and llm.engine.model.stack is stack
    layer = llm.engine.model.layers[0]
    assert layer.w_qkv.data_ptr() == layer.qkv_stack.ext.data_ptr()  # W lives in the stack, not twice
    prompts, names = mixed_batch(family)
    outs = llm.generate(prompts, GREEDY, adapters=names, max_tokens=12, return_logits=True)
    check(oracle, outs, 12)
    assert stack.fills == len({n for n in names if n is not None})


def test_entries_taken_over_and_a_readded_adapter(family, oracle):
    """Two entries for four adapters: steps take entries from adapters they do not need (least recently
    used first); an adapter re-added under a name with other weights is copied again."""
    llm = make_llm(family, entries=2)
    stack = llm.engine.runner.stack
    names = list(family.adapters)
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 128) for _ in range(rng.randrange(3, 20))] for _ in names]
    check(oracle, llm.generate(prompts, GREEDY, adapters=names, max_tokens=6, return_logits=True), 6)
    assert stack.fills > 2
    first, other = names[:2]
    llm.generate(prompts[0], GREEDY, adapter=first, max_tokens=2)  # its A rows in the stack now
    llm.remove_adapter(first)
    llm.add_adapter(first, family.adapters[other])
    after = llm.generate(prompts[0], GREEDY, adapter=first, max_tokens=6, return_logits=True)[0]
    want = llm.generate(prompts[0], GREEDY, adapter=other, max_tokens=6, return_logits=True)[0]
    assert after.token_ids == want.token_ids
    assert max((a - b).abs().max().item() for a, b in zip(after.logits, want.logits)) <= 1e-4


def test_no_stack_where_it_would_be_large(monkeypatch, family):
    monkeypatch.setattr(shrink_stack, "MAX_EXTRA", 0.25)
    llm = make_llm(family)
    assert llm.engine.runner.stack is None and llm.engine.model.layers[0].qkv_stack is None


class _Tables:
    """What `ShrinkStack.prepare` reads of the LoRA tables, for the bookkeeping tests."""

    layers, page_table = [], None


def test_entries_go_to_the_least_recently_used_slot_not_needed():
    entries = entry_table.Entries(3, "the shrink stack (max_adapters_per_batch)")
    assert entries.take({0, 1, 2}) == [(0, 0), (1, 1), (2, 2)]
    assert entries.take({2, 0}) == []  # 1 is now the least recently used
    assert entries.take({2, 3}) == [(3, 1)]
    assert entries.take({0, 4}) == [(4, 2)]  # 2 (used before 0 and 3) goes
    entries.forget(0)
    assert entries.take({0}) == [(0, 0)]  # its entry was free
    with pytest.raises(shrink_stack.ShrinkStackError, match="max_adapters_per_batch"):
        entries.take({5, 6, 7, 8})


def small_stack(entries=2):
    layer = type("Layer", (), {})()
    layer.w_qkv, layer.b_qkv, layer.w_o, layer.b_o = torch.randn(96, 8), torch.randn(96), torch.randn(8, 8), None
    stack = shrink_stack.ShrinkStack([layer], entries=entries, max_rank=4, fill=None)
    stack.set_slots(4)
    return layer, stack


def test_stack_holds_w_and_uploads_the_entries(monkeypatch):
    w_qkv = torch.randn(96, 8)
    layer, stack = small_stack()
    layer.w_qkv.copy_(w_qkv)
    assert torch.equal(layer.qkv_stack.ext[:96], w_qkv) and layer.w_qkv.data_ptr() == layer.qkv_stack.ext.data_ptr()
    assert layer.qkv_stack.ext.shape == (96 + 2 * 3 * 16, 8) and not layer.qkv_stack.bias[96:].any()
    filled = []
    monkeypatch.setattr(stack, "_fill", lambda entry, slot, *rest: filled.append((slot, entry)))
    stack.prepare({0, 1}, _Tables(), None, [0])
    stack.prepare({1, 3}, _Tables(), None, [0])
    assert filled == [(0, 0), (1, 1), (3, 0)]
    assert stack.entry_of_slot.tolist() == [-1, 1, -1, 0]
    stack.forget(1)
    stack.prepare({1}, _Tables(), None, [0])  # copied again, into the entry 3 does not need
    assert filled[-1] == (1, 1)
    with pytest.raises(shrink_stack.ShrinkStackError, match="slot 4 beyond"):
        stack.prepare({4}, _Tables(), None, [0])


def test_a_fill_that_raises_leaves_no_entry_behind(monkeypatch):
    layer, stack = small_stack()

    def fill(entry, slot, *rest):
        if slot == 2:
            raise torch.cuda.OutOfMemoryError("no memory")

    monkeypatch.setattr(stack, "_fill", fill)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        stack.prepare({0, 2}, _Tables(), None, [0])
    assert dict(stack.entries.items()) == {0: 0}  # slot 2 without an entry
    monkeypatch.setattr(stack, "_fill", lambda *a: None)
    stack.prepare({0}, _Tables(), None, [0])  # nothing new to fill, but the map still goes up
    assert stack.entry_of_slot.tolist() == [0, -1, -1, -1]
    stack.prepare({0, 2}, _Tables(), None, [0])  # a later step fills slot 2
    assert stack.entry_of_slot.tolist() == [0, -1, 1, -1]
    bare = shrink_stack.ShrinkStack([small_stack()[0]], entries=1, max_rank=4, fill=None)
    with pytest.raises(shrink_stack.ShrinkStackError, match="set_slots"):
        bare.prepare({0}, _Tables(), None, [0])


@pytest.mark.gpu
def test_gpu_graphs_with_the_stack_match_eager_without(monkeypatch, family):
    """bf16 on the GPU: decode graphs (and eager steps) through the stack, against eager steps through the
    paged shrink kernels, over adapter mixes with tokens without adapter."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from test_engine_graphs_gpu import SEQS, TOKENS, _llm, _run

    stacked = _llm(family, True)
    monkeypatch.setattr(shrink_stack, "MAX_EXTRA", 0.0)
    paged = _llm(family, False)
    assert stacked.engine.runner.stack is not None and paged.engine.runner.stack is None
    rng = random.Random(4)
    choices = [*family.adapters, None]
    prompts = [[rng.randrange(1, 128) for _ in range(rng.randrange(3, 40))] for _ in range(SEQS)]
    agree = total = 0
    for names in ([choices[i % len(choices)] for i in range(SEQS)], [rng.choice(choices) for _ in range(SEQS)]):
        for got, want in zip(_run(stacked, prompts, names), _run(paged, prompts, names)):
            agree, total = agree + es.common_prefix(got, want, TOKENS), total + TOKENS
    assert stacked.engine.runner.graphs.replays > 0 and stacked.engine.runner.stack.fills > 0
    assert agree / total >= 0.95, f"identical greedy prefixes cover {agree}/{total} tokens"


@pytest.mark.gpu
def test_gpu_chunked_mixed_steps_through_the_stack(monkeypatch, family):
    """A 48-token budget: prompt chunks share steps with decodes, so mixed steps (<= 256 tokens) replay
    piecewise graphs through the stack; against eager steps through the paged shrink."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from test_engine_graphs_gpu import TOKENS, _run, chunked_llm, chunked_workload

    prompts, names = chunked_workload(family)
    with chunked_llm(family, True) as stacked:
        got = _run(stacked, prompts, names)
        assert stacked.engine.runner.stack is not None and stacked.engine.runner.mixed.replays > 0
    monkeypatch.setattr(shrink_stack, "MAX_EXTRA", 0.0)
    with chunked_llm(family, False) as paged:
        assert paged.engine.runner.stack is None
        want = _run(paged, prompts, names)
    agree = sum(es.common_prefix(a, b, TOKENS) for a, b in zip(got, want))
    assert agree / (TOKENS * len(got)) >= 0.95, f"identical greedy prefixes cover {agree}/{TOKENS * len(got)} tokens"
