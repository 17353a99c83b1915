"""Dense LoRA shrinks on a side stream beside their projections (`DecoderLM._project_beside`): the same
tokens and logits as with every launch on one stream, eager and under CUDA graphs."""

from __future__ import annotations

import random

import engine_support as es
import pytest
import torch
from unipage.scheduler import SchedulerConfig

from unipage import LLM, SamplingParams
from unipage.config import LoRAConfig, PoolConfig
from unipage.models import decoder

pytestmark = pytest.mark.gpu

SEQS, TOKENS = 12, 24


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss", "llama"])
def family(request, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return es.FAMILIES[request.param](tmp_path_factory.mktemp(request.param))


def _generate(family, monkeypatch, side_tokens: int, graphs: bool):
    monkeypatch.setattr(decoder, "SIDE_SHRINK_TOKENS", side_tokens)
    rng = random.Random(3)
    choices = [*family.adapters, None]
    prompts = [[rng.randrange(1, 128) for _ in range(rng.randrange(3, 30))] for _ in range(SEQS)]
    names = [choices[i % len(choices)] for i in range(SEQS)]
    with LLM(family.model_dir, family.adapters, device="cuda", dtype="bfloat16", kernels="triton",
             pool=PoolConfig(num_pages=1024), lora=LoRAConfig(max_rank=32, max_adapters_per_batch=4),
             scheduler=SchedulerConfig(max_model_len=128, max_num_seqs=16), cuda_graphs=graphs) as llm:
        out = llm.generate(prompts, SamplingParams(temperature=0), adapters=names, max_tokens=TOKENS,
                           return_logits=True)
        used = llm.engine.runner.model._side is not None
    return out, used


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_side_shrink_matches_one_stream(family, monkeypatch, graphs):
    side, used = _generate(family, monkeypatch, 64, graphs)
    plain, unused = _generate(family, monkeypatch, 0, graphs)
    assert used and not unused
    for got, want in zip(side, plain):
        assert got.token_ids == want.token_ids, got.adapter
        diff = (torch.stack(got.logits) - torch.stack(want.logits)).abs().max()
        assert diff <= 1e-3 * torch.stack(want.logits).abs().mean(), f"{got.adapter}: logits differ by {diff:.4g}"
