"""The engine against transformers + PEFT, on CPU in fp32, for every supported family.

A mixed batch — every sequence with a different adapter, some with none,
different prompt lengths — must give each sequence the logits transformers
gives it with that adapter alone (max abs error <= 1e-4), and greedy decoding
must match token for token; also under chunked prefill, prefix-cache hits and
preemption forced by a tiny pool; and an adapter re-added under the same name
with new weights must give the new results.
"""

from __future__ import annotations

import random

import engine_support as es
import pytest
from unipage.scheduler import SchedulerConfig

from unipage import LLM, SamplingParams
from unipage.config import LoRAConfig, PoolConfig

GREEDY = SamplingParams(temperature=0)
TOL = 1e-4


family = es.family_fixture(sorted(es.FAMILIES))


@pytest.fixture(scope="module")
def oracle(family):
    return es.Oracle(family)


def make_llm(family, pages=512, **scheduler) -> LLM:
    return LLM(family.model_dir, family.adapters, device="cpu", pool=PoolConfig(num_pages=pages),
               lora=LoRAConfig(max_rank=32, max_adapters_per_batch=8),
               scheduler=SchedulerConfig(max_model_len=256, **scheduler))


def mixed_batch(family, seed=0, count=6):
    """Prompts of different lengths, one per adapter plus two without."""
    rng = random.Random(seed)
    names = list(family.adapters) + [None, None]
    rng.shuffle(names)
    prompts = [[rng.randrange(1, 128) for _ in range(rng.randrange(3, 40))] for _ in names[:count]]
    return prompts, names[:count]


def check(oracle, outs, tokens):
    for out in outs:
        assert len(out.token_ids) == tokens and out.finish_reason == "length"
        err = es.generated_logits_error(oracle, out)
        assert err <= TOL, f"{out.adapter}: logits differ by {err}"


def test_mixed_batch_logits_and_greedy_tokens(family, oracle):
    llm = make_llm(family)
    prompts, names = mixed_batch(family)
    outs = llm.generate(prompts, GREEDY, adapters=names, max_tokens=32, return_logits=True)
    check(oracle, outs, 32)
    for out in outs[:3]:
        assert out.token_ids == oracle.greedy(out.adapter, out.prompt_token_ids, 32)


def test_chunked_prefill(family, oracle):
    llm = make_llm(family, max_num_batched_tokens=16, long_prefill_token_threshold=7)
    prompts, names = mixed_batch(family, seed=1)
    check(oracle, llm.generate(prompts, GREEDY, adapters=names, max_tokens=6, return_logits=True), 6)


def test_prefix_cache_hits(family, oracle):
    llm = make_llm(family)
    shared = [random.Random(5).randrange(1, 128) for _ in range(40)]
    names = list(family.adapters)[:2] + [None]
    first = llm.generate([shared + [7]] * 3, GREEDY, adapters=names, max_tokens=4, return_logits=True)
    hits = llm.engine.scheduler.stats.prefix_hit_tokens
    second = llm.generate([shared + [9, 10]] * 3, GREEDY, adapters=names, max_tokens=4, return_logits=True)
    assert llm.engine.scheduler.stats.prefix_hit_tokens - hits >= 3 * 32  # two full blocks each
    check(oracle, first + second, 4)


def test_preemption_under_a_tiny_pool(family, oracle):
    first = next(iter(family.adapters))
    engine = make_llm(family).engine
    adapter_pages = engine.memory.adapters.get(first).num_pages
    # the adapter and 12 KV blocks (the batch needs 24); GPT-OSS returns its sliding layers' pages as
    # the window passes, and 12 of its half-size pages are enough for all six: 10 are not
    kv_pages = 10 if engine.config.model.hybrid_kv else 12
    llm = make_llm(family, pages=adapter_pages + kv_pages)
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 128) for _ in range(rng.randrange(33, 40))] for _ in range(6)]
    names = [first, None, first, None, first, None]
    outs = llm.generate(prompts, GREEDY, adapters=names, max_tokens=24, return_logits=True)
    assert llm.engine.scheduler.stats.preemptions > 0
    check(oracle, outs, 24)


def test_readded_adapter_gives_new_results(family, tmp_path):
    llm = make_llm(family)
    name, other = list(family.adapters)[:2]
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    before = llm.generate(prompt, GREEDY, adapter=name, max_tokens=8, return_logits=True)[0]
    llm.remove_adapter(name)
    llm.add_adapter(name, family.adapters[other])
    after = llm.generate(prompt, GREEDY, adapter=name, max_tokens=8, return_logits=True)[0]
    reference = llm.generate(prompt, GREEDY, adapter=other, max_tokens=8, return_logits=True)[0]
    assert after.token_ids == reference.token_ids
    assert max((a - b).abs().max().item() for a, b in zip(after.logits, reference.logits)) <= TOL
    assert max((a - b).abs().max().item() for a, b in zip(after.logits, before.logits)) > 1e-3
