"""GPT-OSS's sliding-window layers keep only the window's KV pages, and the logits stay transformers'.

The tiny GPT-OSS checkpoint alternates a sliding layer (window 8) and a full
one; blocks are 16 tokens.  Long requests, prefilled in chunks, must hold at
most the window's blocks in the sliding layers' table at every step, return
the rest to the pool, and still give transformers + PEFT's logits.
"""

from __future__ import annotations

import random

import engine_support as es
import pytest
from unipage.scheduler import SchedulerConfig

from unipage import LLM, SamplingParams
from unipage.config import LoRAConfig, PoolConfig
from unipage.kv import NO_PAGE
from unipage.pool import PageKind

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return es.gptoss(tmp_path_factory.mktemp("gpt_oss"))


def tables(llm):
    """(blocks, pages in the sliding layers' table) of each running request."""
    return [(len(req.block_table), sum(page != NO_PAGE for page in req.window_table))
            for req in llm.engine.scheduler.running]


def test_long_chunked_requests_hold_the_window_and_match_transformers(family):
    llm = LLM(family.model_dir, family.adapters, device="cpu", pool=PoolConfig(num_pages=512),
              lora=LoRAConfig(max_rank=32), scheduler=SchedulerConfig(max_model_len=256,
                                                                      long_prefill_token_threshold=24))
    engine, seen = llm.engine, []
    step = engine.step

    def watched_step():
        outputs = step()
        seen.extend(tables(llm))
        return outputs

    engine.step = watched_step
    rng = random.Random(3)
    names = [*family.adapters, None]
    prompts = [[rng.randrange(1, 128) for _ in range(rng.randrange(50, 70))] for _ in names]
    outs = llm.generate(prompts, GREEDY, adapters=names, max_tokens=40, return_logits=True)
    # a 24-token chunk after 7 keys of window: at most 31 keys, so 3 blocks of 16 — while the
    # requests grow to 7 blocks in the full layers' table
    assert max(pages for _, pages in seen) <= 3 and max(blocks for blocks, _ in seen) >= 6
    assert engine.memory.pool.count(PageKind.CACHED_KV) > 0  # blocks that left the window, kept for reuse
    oracle = es.Oracle(family)
    for out in outs:
        assert es.generated_logits_error(oracle, out) <= 1e-4, out.adapter
    assert outs[0].token_ids == oracle.greedy(outs[0].adapter, outs[0].prompt_token_ids, 40)
    engine.memory.check()
