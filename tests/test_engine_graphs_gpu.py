"""CUDA graphs of decode steps: the same tokens and logits as eager execution, across adapter mixes."""

from __future__ import annotations

import random

import engine_support as es
import pytest
from unipage.scheduler import SchedulerConfig

from unipage import LLM, SamplingParams
from unipage.config import LoRAConfig, PoolConfig

pytestmark = pytest.mark.gpu

SEQS, TOKENS = 24, 40


family = es.family_fixture(["qwen3_moe", "gpt_oss", "llama"], cuda=True)


def _llm(family, graphs: bool) -> LLM:
    return LLM(family.model_dir, family.adapters, device="cuda", dtype="bfloat16", kernels="triton",
               pool=PoolConfig(num_pages=2048), lora=LoRAConfig(max_rank=32, max_adapters_per_batch=4),
               scheduler=SchedulerConfig(max_model_len=256, max_num_seqs=32), cuda_graphs=graphs)


def _run(llm: LLM, prompts, names):
    return llm.generate(prompts, SamplingParams(temperature=0), adapters=names, max_tokens=TOKENS,
                        return_logits=True)


@pytest.mark.parametrize("piece_layers", [0, 1])
def test_graphs_match_eager(family, piece_layers):
    """piece_layers 1: each decode step replays one graph per layer (`DecodeGraphs.set_piece_layers`)."""
    rng = random.Random(1)
    choices = [*family.adapters, None]
    prompts = [[rng.randrange(1, 128) for _ in range(rng.randrange(3, 40))] for _ in range(SEQS)]
    mixes = [[choices[i % len(choices)] for i in range(SEQS)], [choices[0]] * SEQS, [None] * SEQS,
             [rng.choice(choices) for _ in range(SEQS)]]
    graphed, eager = _llm(family, True), _llm(family, False)
    runner = graphed.engine.runner
    runner.graphs.set_piece_layers(piece_layers)
    assert len(runner.graphs.bounds) == (1 if piece_layers == 0 else len(runner.model.layers))
    assert graphed.engine.capture_graphs() > 0  # no adapter resident yet: the loads below drop these graphs
    agree = total = 0
    for names in mixes:
        for got, want in zip(_run(graphed, prompts, names), _run(eager, prompts, names)):
            agree, total = agree + es.common_prefix(got, want, TOKENS), total + TOKENS
    graphs, mixed = graphed.engine.runner.graphs, graphed.engine.runner.mixed
    assert graphs.replays > 0 and graphs.captures <= 4 * len(graphs.buckets)
    assert mixed.replays > 0 and eager.engine.runner.mixed is None  # the prefill steps replayed pieces
    assert agree / total >= 0.95, f"identical greedy prefixes cover {agree}/{total} tokens"
    assert graphed.engine.capture_graphs() > 0  # every bucket and adapter class, at the current tables
    captured = graphs.captures, mixed.captures
    _run(graphed, prompts, mixes[3])
    assert (graphs.captures, mixed.captures) == captured  # nothing left to capture while the tables keep their shape


def test_decode_only_mode(family):
    with LLM(family.model_dir, device="cuda", dtype="bfloat16", pool=PoolConfig(num_pages=256),
             scheduler=SchedulerConfig(max_model_len=128, max_num_seqs=8), cuda_graphs="decode") as llm:
        assert llm.engine.runner.graphs is not None and llm.engine.runner.mixed is None


def chunked_llm(family, graphs) -> LLM:
    """A 48-token budget: prompt chunks share steps with decodes (buckets 16, 32, 48; both LoRA plan paths)."""
    return LLM(family.model_dir, family.adapters, device="cuda", dtype="bfloat16", kernels="triton",
               pool=PoolConfig(num_pages=1024), lora=LoRAConfig(max_rank=32, max_adapters_per_batch=4),
               scheduler=SchedulerConfig(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=48),
               cuda_graphs=graphs)


def chunked_workload(family) -> tuple[list[list[int]], list[str | None]]:
    """12 prompts of 3-59 tokens, adapters round-robin with the base model among them."""
    rng = random.Random(2)
    choices = [*family.adapters, None]
    prompts = [[rng.randrange(1, 128) for _ in range(rng.randrange(3, 60))] for _ in range(12)]
    return prompts, [choices[i % len(choices)] for i in range(12)]


def test_chunked_mixed_steps_match_eager(family):
    """`chunked_llm`'s steps replayed from piecewise graphs against the same steps run eagerly."""
    prompts, names = chunked_workload(family)
    with chunked_llm(family, True) as graphed, chunked_llm(family, "decode") as eager:
        got, want = _run(graphed, prompts, names), _run(eager, prompts, names)
        mixed = graphed.engine.runner.mixed
        assert mixed.replays > 0 and len({key[0] for key in mixed.sets}) > 1
    agree = sum(es.common_prefix(a, b, TOKENS) for a, b in zip(got, want))
    total = TOKENS * len(got)
    assert agree / total >= 0.95, f"identical greedy prefixes cover {agree}/{total} tokens"
