"""No Triton recompilation across lengths: after warm-up, new prompt lengths, batch sizes, chunk
splits and adapter mixes run on the kernels already compiled (eager path: prefill and decode).

Triton compiles one binary per distinct set of constexprs and specialised integer arguments;
the per-step sizes (token counts, context lengths, pairs, tiles) are `do_not_specialize`, so
once each launch configuration has been seen, nothing should compile again.  The test counts
compilations through Triton's post-compile hook.
"""

from __future__ import annotations

import random

import engine_support as es
import pytest
import torch
from unipage.scheduler import SchedulerConfig

from unipage import LLM, SamplingParams
from unipage.config import LoRAConfig, PoolConfig

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss", "llama"])
def family(request, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return es.FAMILIES[request.param](tmp_path_factory.mktemp(request.param))


def _round(llm: LLM, family, seed: int) -> None:
    """A batch of random size, prompt lengths (2-300 tokens) and adapters (some without); 1-24 new tokens."""
    rng = random.Random(seed)
    choices = [*family.adapters, None]
    count = rng.randrange(6, 20)
    prompts = [[rng.randrange(1, 128) for _ in range(rng.randrange(2, 300))] for _ in range(count)]
    names = [rng.choice(choices) for _ in range(count)]
    llm.generate(prompts, SamplingParams(temperature=0), adapters=names, max_tokens=rng.randrange(1, 25))


def _probe() -> None:
    """Launch a kernel not compiled before in this process (a fresh constexpr)."""
    import triton
    import triton.language as tl

    @triton.jit
    def fill(out_ptr, VALUE: tl.constexpr):
        tl.store(out_ptr, VALUE)

    out = torch.zeros(1, device="cuda")
    fill[(1,)](out, VALUE=random.randrange(1 << 30))


def test_new_lengths_compile_nothing(family):
    import triton

    llm = LLM(family.model_dir, family.adapters, device="cuda", dtype="bfloat16", kernels="triton",
              pool=PoolConfig(num_pages=4096), lora=LoRAConfig(max_rank=32, max_adapters_per_batch=4),
              scheduler=SchedulerConfig(max_model_len=512, max_num_seqs=32, long_prefill_token_threshold=96),
              cuda_graphs=False)
    compiled: list[str] = []

    def record(*, repr, **_):
        compiled.append(repr)

    runtime = triton.knobs.runtime
    previous, runtime.jit_post_compile_hook = runtime.jit_post_compile_hook, record
    try:
        _probe()
        assert len(compiled) == 1, "the hook did not see a compilation"
        for seed in range(4):  # warm-up: every launch configuration the workload reaches
            _round(llm, family, seed)
        warm = len(compiled)
        for seed in range(100, 104):
            _round(llm, family, seed)
    finally:
        runtime.jit_post_compile_hook = previous
    assert compiled[warm:] == [], f"{len(compiled) - warm} recompilation(s) after warm-up: {compiled[warm:]}"
