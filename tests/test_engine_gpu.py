"""GPU parity: the engine on CUDA in bf16 with the Triton kernels against transformers + PEFT in bf16.

Per family, 16 sequences (each with a different adapter or none) generate 64
greedy tokens.  The oracle runs teacher-forced on each sequence the engine
produced, with that sequence's adapter alone, so every position is compared
on the same context: the engine's token must be the oracle's argmax at >= 95%
of positions, and the logits must agree within bf16 tolerance: the engine's
mean error against an fp32 oracle at most twice that of transformers' own
bf16 run (plus 1% of the logits' scale).
"""

from __future__ import annotations

import random

import pytest
import torch

import engine_support as es
from unipage import LLM, SamplingParams
from unipage.config import LoRAConfig, PoolConfig
from unipage.kernels import skinny
from unipage.scheduler import SchedulerConfig

pytestmark = pytest.mark.gpu

SEQS, TOKENS = 16, 64


family = es.family_fixture(sorted(es.FAMILIES), cuda=True)


def test_bf16_triton_engine_matches_transformers_peft(family):
    check_against_transformers(family)


def test_skinny_projections_match_transformers_peft(family, monkeypatch):
    """The skinny kernel (split K) given an entry for every projection and router shape up to 16 tokens: the
    engine still matches transformers + PEFT, and the kernel ran (on the plain GEMMs: the dense models' LoRA
    decode projections run `lora_linear`'s fused kernel instead)."""
    entry = skinny.SKINNY | {"max_tokens": 16, "block_n": 16, "block_k": 64, "split_k": 2}
    monkeypatch.setattr(skinny, "tuned_config", lambda *shape: entry)
    calls, kernel = [], skinny.skinny_linear
    monkeypatch.setattr(skinny, "skinny_linear", lambda x, *rest: calls.append(x.shape[0]) or kernel(x, *rest))
    check_against_transformers(family)
    assert calls and max(calls) <= 16  # it ran, within its entry's max_tokens


def check_against_transformers(family, **lora) -> LLM:
    """The bf16 Triton engine's greedy runs against transformers + PEFT (``lora``: more `LoRAConfig` settings);
    returns the engine."""
    llm = LLM(family.model_dir, family.adapters, device="cuda", dtype="bfloat16", kernels="triton",
              pool=PoolConfig(num_pages=2048), lora=LoRAConfig(max_rank=32, max_adapters_per_batch=8, **lora),
              scheduler=SchedulerConfig(max_model_len=512))
    rng = random.Random(0)
    names = [([*family.adapters, None])[i % (len(family.adapters) + 1)] for i in range(SEQS)]
    prompts = [[rng.randrange(1, 128) for _ in range(rng.randrange(4, 60))] for _ in range(SEQS)]
    outs = llm.generate(prompts, SamplingParams(temperature=0), adapters=names, max_tokens=TOKENS,
                        return_logits=True)
    oracle = es.Oracle(family, dtype=torch.bfloat16, device="cuda")
    exact = es.Oracle(family, dtype=torch.float32, device="cuda")
    agree = total = 0
    for out in outs:
        assert len(out.token_ids) == TOKENS
        full = out.prompt_token_ids + out.token_ids
        n = len(out.prompt_token_ids)
        want = oracle.logits(out.adapter, full)[n - 1: n - 1 + TOKENS]
        got = torch.stack(out.logits).to(want.device)
        agree += (want.argmax(-1) == torch.tensor(out.token_ids, device=want.device)).sum().item()
        total += TOKENS
        ref = exact.logits(out.adapter, full)[n - 1: n - 1 + TOKENS]
        ours, theirs = (got - ref).abs().mean().item(), (want - ref).abs().mean().item()
        assert ours <= 2 * theirs + 0.01 * ref.abs().mean().item(), \
            f"{out.adapter}: mean logit error {ours:.4g}, transformers bf16 {theirs:.4g}"
    assert agree / total >= 0.95, f"greedy tokens agree at {agree}/{total} positions"
    return llm
