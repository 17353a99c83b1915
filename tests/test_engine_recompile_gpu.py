"""No Triton recompilation across lengths: prompt lengths, batch sizes, chunk splits and adapter
mixes never compile a kernel twice for the same launch configuration (eager path: prefill and decode).

Triton compiles one binary per distinct set of constexprs (tile shapes, flags — chosen from a
finite table) and of specialised integer arguments (a value of 1, divisibility by 16).  The
per-step sizes (token counts, context lengths, pairs, tiles) are `do_not_specialize`, so a
kernel compiles once per launch configuration, whatever the lengths.  The test records every
compilation through Triton's post-compile hook and fails on a second one with the same
kernel, constexprs, warps and stages — a recompilation caused by a runtime value.
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


family = es.family_fixture(["qwen3_moe", "gpt_oss", "llama"], cuda=True)


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


def test_lengths_never_recompile_a_launch_configuration(family):
    import triton

    llm = LLM(family.model_dir, family.adapters, device="cuda", dtype="bfloat16", kernels="triton",
              pool=PoolConfig(num_pages=4096), lora=LoRAConfig(max_rank=32, max_adapters_per_batch=4),
              scheduler=SchedulerConfig(max_model_len=512, max_num_seqs=32, long_prefill_token_threshold=96),
              cuda_graphs=False)
    compiled: list[tuple] = []

    def record(*, fn, compile, **_):
        constants = tuple(sorted(compile["constants"].items()))
        compiled.append((fn.name, constants, compile["num_warps"], compile["num_stages"]))

    runtime = triton.knobs.runtime
    previous, runtime.jit_post_compile_hook = runtime.jit_post_compile_hook, record
    try:
        _probe()
        assert len(compiled) == 1, "the hook did not see a compilation"
        for seed in range(8):
            _round(llm, family, seed)
    finally:
        runtime.jit_post_compile_hook = previous
    again = [key for i, key in enumerate(compiled) if key in compiled[:i]]
    assert again == [], f"recompiled for the same launch configuration: {again}"
