"""End-to-end throughput sanity check of the engine on one GPU (JSON lines).

    python benchmarks/engine.py [--layers 2] [--requests 64] [--out FILE]

Builds a random checkpoint with the Qwen3-30B-A3B layer shape (hidden 2048,
32 query / 4 KV heads of 128, 128 experts of width 768, top-8) but only
``--layers`` layers and a 32k vocabulary, saves it with transformers, writes
8 random PEFT adapters (rank 16 on attention and every expert, per-expert
format), and times ``LLM.generate`` on ``--requests`` requests (prompt 256,
128 greedy output tokens, round-robin over the adapters), then the same
requests on the base model alone, each timed on its third pass (the first
ones compile the kernels' variants for the batch sizes met and load the
adapters).  One record per run: wall time, output
tokens/s and total tokens/s.  Not a tuned serving figure (that is the
GPU-performance issue's benchmark): a check that the whole path runs at a
plausible speed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import emit
from unipage.scheduler import SchedulerConfig

from unipage import LLM, SamplingParams
from unipage.config import LoRAConfig, ModelConfig
from unipage.peft_write import write_random_adapter

PROMPT, OUTPUT, ADAPTERS, RANK = 256, 128, 8, 16


def build_checkpoint(root: str, layers: int) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=32000, hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32,
                            num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                            num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    path = os.path.join(root, "model")
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def run(llm: LLM, requests: int, adapters: list[str | None]) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 32000) for _ in range(PROMPT)] for _ in range(requests)]
    names = [adapters[i % len(adapters)] for i in range(requests)]
    for _ in range(3):  # early passes compile the kernels' variants and load the adapters; time the last
        steps = llm.engine.scheduler.stats.steps
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0), adapters=names, max_tokens=OUTPUT)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    return {"wall_s": round(wall, 3), "output_tokens": generated,
            "output_tokens_per_s": round(generated / wall, 1),
            "total_tokens_per_s": round((generated + PROMPT * requests) / wall, 1),
            "steps": llm.engine.scheduler.stats.steps - steps}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--out", default=None)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs for decode steps")
    args = parser.parse_args(argv)
    sink = open(args.out, "a") if args.out else contextlib.nullcontext(sys.stdout)  # noqa: SIM115
    with sink as out, tempfile.TemporaryDirectory(prefix="unipage-bench-") as root:
        model_dir = build_checkpoint(root, args.layers)
        llm = LLM(model_dir, device="cuda", lora=LoRAConfig(max_rank=RANK, max_adapters_per_batch=ADAPTERS),
                  scheduler=SchedulerConfig(max_model_len=1024, max_num_batched_tokens=4096),
                  cuda_graphs=not args.eager)
        model = llm.engine.config.model
        for i in range(ADAPTERS):
            path = write_random_adapter(os.path.join(root, f"a{i}"), model, rank=RANK, alpha=2 * RANK, seed=i,
                                        dtype=torch.bfloat16)
            llm.add_adapter(f"a{i}", path)
        base = {"bench": "engine", "model": describe(model), "requests": args.requests,
                "prompt_tokens": PROMPT, "max_tokens": OUTPUT, "rank": RANK,
                "pool_pages": llm.engine.config.num_pages, "cuda_graphs": not args.eager}
        for label, adapters in (("lora", [f"a{i}" for i in range(ADAPTERS)]), ("base", [None])):
            emit({**base, "row": label, "adapters": len([a for a in adapters if a]), **run(llm, args.requests,
                                                                                         adapters)}, out)


def describe(model: ModelConfig) -> str:
    return (f"qwen3-moe-shape L{model.num_layers} H{model.hidden_size} E{model.num_experts} "
            f"I{model.expert_intermediate_size} top{model.top_k}")


if __name__ == "__main__":
    main()
