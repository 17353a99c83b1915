"""The decode run-ahead (`ModelRunner.execute`): each decode step launches the next before the host reads its
tokens.  Runs with it give what runs without it give: bitwise while the batch stays the same, and as two
bf16 runs agree while requests finish, stop, are aborted and join mid-decode (steps run ahead then go
unused or thrown away)."""

from __future__ import annotations

import random

import engine_support as es
import pytest
import torch
from unipage.scheduler import SamplingParams, SchedulerConfig

from unipage import LLM
from unipage.config import LoRAConfig, PoolConfig

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0)


family = es.family_fixture(["gpt_oss", "qwen3_moe", "llama"], cuda=True)


def _llm(family, run_ahead: bool) -> LLM:
    return LLM(family.model_dir, family.adapters, device="cuda", dtype="bfloat16", kernels="triton",
               pool=PoolConfig(num_pages=2048), lora=LoRAConfig(max_rank=32, max_adapters_per_batch=4),
               scheduler=SchedulerConfig(max_model_len=256, max_num_seqs=32), run_ahead=run_ahead)


def test_a_steady_batch_is_bitwise_the_same(family):
    """Every request decodes as many tokens: each step run ahead is used, and tokens and logits match."""
    rng = random.Random(0)
    choices = [*family.adapters, None]
    prompts = [[rng.randrange(1, 128) for _ in range(rng.randrange(3, 30))] for _ in range(12)]
    names = [choices[i % len(choices)] for i in range(12)]
    runs = []
    for run_ahead in (True, False):
        llm = _llm(family, run_ahead)
        runs.append(llm.generate(prompts, GREEDY, adapters=names, max_tokens=24, return_logits=True))
        runner = llm.engine.runner
        assert runner.run_ahead == run_ahead and llm.engine.scheduler.config.decode_kv_ahead == int(run_ahead)
        if run_ahead:
            assert runner.ahead_taken >= 20 and runner.ahead_dropped <= 2, (runner.ahead_taken, runner.ahead_dropped)
        llm.close()
    for got, want in zip(*runs):
        assert got.token_ids == want.token_ids
        assert torch.equal(torch.stack(got.logits), torch.stack(want.logits))


def _drive(llm: LLM, seed: int) -> dict:
    """`es.drive_comings_and_goings` (four joining at step 6, r0 aborted at step 12) once every adapter is
    resident (a load in flight would shift the steps that admit requests)."""
    names = _make_resident(llm)
    outs, aborted = es.drive_comings_and_goings(llm.engine, names, es.Comings(seed, 10, 6, 12, (3, 30), (4, 40), 5))
    assert aborted
    return outs


def _make_resident(llm: LLM) -> list[str]:
    """Every registered adapter loaded (one tiny request each), so no load is in flight when a workload
    starts; returns their names."""
    names = llm.engine.memory.adapters.names()
    llm.generate([[1, 2, 3]] * (len(names) + 1), GREEDY, adapters=[*names, None], max_tokens=2)
    return names


def test_requests_coming_and_going_match_a_run_without_it(family):
    results, counts = [], []
    for run_ahead in (True, False):
        llm = _llm(family, run_ahead)
        results.append(_drive(llm, seed=1))
        counts.append((llm.engine.runner.ahead_taken, llm.engine.runner.ahead_dropped))
        llm.engine.memory.check()
        llm.close()
    got, want = results
    assert set(got) == set(want)
    agree = total = 0
    for rid, (tokens, reason) in want.items():
        other, other_reason = got[rid]
        same = next((i for i, (a, b) in enumerate(zip(tokens, other)) if a != b), min(len(tokens), len(other)))
        agree, total = agree + same, total + len(tokens)
        if other == tokens:
            assert other_reason == reason, rid
    assert agree / total >= 0.95, f"identical greedy prefixes cover {agree}/{total} tokens"
    taken, dropped = counts[0]
    assert taken > 10 and dropped > 0 and counts[1] == (0, 0), counts  # thrown away when requests joined


def test_every_step_taken_matches_a_fresh_replay_under_a_small_pool(family):
    """A pool small enough to preempt: each step run ahead that is taken gives the hidden states a replay of
    the same step gives then (bitwise when the rows are the same sequences in order; a subset ran in a
    larger batch, so within bf16 noise), and the run ends with its memory consistent."""
    llm = LLM(family.model_dir, family.adapters, device="cuda", dtype="bfloat16", kernels="triton",
              pool=PoolConfig(num_pages=90), lora=LoRAConfig(max_rank=32, max_adapters_per_batch=4),
              scheduler=SchedulerConfig(max_model_len=256, max_num_seqs=16), run_ahead=True)
    graphs, checked = llm.engine.runner.graphs, []
    take = graphs.take_ahead

    def take_and_check(ahead, seqs):
        hidden = take(ahead, seqs)
        if hidden is not None:
            taken, same = hidden.clone(), [ahead.rows[id(s)] for s in seqs] == list(range(len(seqs)))
            fresh = graphs.run(seqs)  # (the same step again: its KV writes are the same values)
            if same:
                assert torch.equal(taken, fresh)
            else:
                torch.testing.assert_close(taken, fresh, atol=0.05, rtol=0.05)
            checked.append(same)
            hidden = fresh
        return hidden

    # every adapter resident first: while a load is in flight the other requests run alone, and on a GPU
    # (fast steps, many of them per load) that left the pool roomy enough never to preempt
    _make_resident(llm)
    loads0, preempted0 = llm.engine.memory.adapters.stats.loads, llm.engine.scheduler.stats.preemptions
    graphs.take_ahead = take_and_check
    rng, choices = random.Random(2), [*family.adapters, None]
    prompts = [[rng.randrange(1, 128) for _ in range(rng.randrange(20, 90))] for _ in range(16)]
    outs = llm.generate(prompts, GREEDY, adapters=[choices[i % len(choices)] for i in range(16)], max_tokens=48)
    assert all(len(out.token_ids) == 48 for out in outs)
    preempted = llm.engine.scheduler.stats.preemptions - preempted0  # (the same workload on the CPU: 4-9)
    assert preempted > 0 and len(checked) > 20 and any(checked), \
        (preempted, len(checked), llm.engine.memory.adapters.stats.loads - loads0)
    llm.engine.memory.check()
    llm.close()
