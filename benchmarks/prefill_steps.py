"""One prefill step's time by token count: piecewise CUDA graphs of mixed steps vs eager (JSON lines).

    python benchmarks/prefill_steps.py [--shape llama-1b] [--tokens 64 256 1024 2000 2600 4096] [--out FILE]

Builds the engine on a model of ``--shape`` (random weights at its real
shape) with ``--adapters`` random rank-``--rank`` attention adapters, loads
them, captures every graph (`Engine.capture_graphs`, timed), then times single
steps that prefill ``tokens`` tokens split over one prompt (one adapter) or
eight (seven adapters and one base-model prompt), each ``--repeats`` times
with the mixed-step graphs and without them (the same engine, the runner's
graphs set aside), alternating which goes first.  A step's time is wall time
from before `Engine.step` to after a device sync.  One record per
(tokens, prompts, mode): the median, and the eager / graph ratio on the
graph rows.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_models as sm
from timing import emit
from unipage.scheduler import Request, SamplingParams, SchedulerConfig

from unipage.config import LoRAConfig, ModelConfig, PoolConfig
from unipage.engine import Engine
from unipage.models.weights import read_config

GREEDY = SamplingParams(temperature=0)


def build(args, root: str) -> tuple[Engine, list[str]]:
    model_dir = sm.write_model_dir(root, args.shape)
    model = ModelConfig.from_hf(read_config(model_dir), "bfloat16")
    paths = sm.write_adapters(os.path.join(root, "adapters"), model, args.adapters, args.rank, "attention")
    engine = Engine(model_dir, device="cuda", dtype="bfloat16", pool=PoolConfig(num_pages=args.pool_pages),
                    lora=LoRAConfig(max_rank=args.rank, max_adapters_per_batch=64),
                    scheduler=SchedulerConfig(max_model_len=max(args.tokens) + 2, max_num_seqs=64,
                                              max_num_batched_tokens=max(args.tokens)), load_format="dummy")
    names = [f"a{i}" for i in range(len(paths))]
    for name, path in zip(names, paths):
        engine.add_adapter(name, path)
    return engine, names


class Stepper:
    def __init__(self, engine: Engine, seed: int) -> None:
        self.engine, self.rng, self.count = engine, random.Random(seed), 0

    def step(self, tokens: int, adapters: list[str | None]) -> float:
        """Seconds of one step prefilling ``tokens`` tokens over ``len(adapters)`` prompts (then finished)."""
        per = tokens // len(adapters)
        for k, name in enumerate(adapters):
            n = tokens - per * (len(adapters) - 1) if k == 0 else per
            self.count += 1
            prompt = [self.rng.randrange(1, 30000) for _ in range(n)]
            self.engine.add_request(Request(f"r{self.count}", prompt, name, GREEDY, max_tokens=1))
        torch.cuda.synchronize()
        start = time.perf_counter()
        self.engine.step()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        while self.engine.has_unfinished():
            self.engine.step()
        return seconds


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-1b", choices=sorted(sm.SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[64, 256, 1024, 2000, 2600, 4096])
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--pool-pages", type=int, default=8192)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("prefill_steps.py needs a CUDA device")
    sink = open(args.out, "a") if args.out else contextlib.nullcontext(sys.stdout)  # noqa: SIM115
    with sink as out, tempfile.TemporaryDirectory(prefix="unipage-prefill-") as root:
        engine, names = build(args, root)
        stepper = Stepper(engine, seed=0)
        for name in names:  # load every adapter; compile the kernels of a mixed step
            stepper.step(64, [name])
        stepper.step(1000, [names[0], names[1], None])
        start = time.perf_counter()
        captured = engine.capture_graphs()
        base = {"bench": "prefill_steps", "model": args.shape, "rank": args.rank}
        emit({**base, "row": "capture", "graphs_and_sets": captured, "seconds": round(time.perf_counter() - start, 3),
              "mixed_buckets": engine.runner.mixed.buckets}, out)
        mixes = {1: [names[0]], 8: [*names[:7], None]}
        for tokens in args.tokens:
            for prompts, mix in mixes.items():
                times = measure(engine, stepper, tokens, mix, args.repeats)
                medians = {mode: statistics.median(v) for mode, v in times.items()}
                for mode, seconds in medians.items():
                    row = {**base, "row": "step", "tokens": tokens, "prompts": prompts, "mode": mode,
                           "median_ms": round(seconds * 1e3, 3), "repeats": args.repeats}
                    if mode == "graphs":
                        row["eager_over_graphs"] = round(medians["eager"] / seconds, 3)
                    emit(row, out)


def measure(engine: Engine, stepper: Stepper, tokens: int, mix: list, repeats: int) -> dict[str, list[float]]:
    runner, times = engine.runner, {"graphs": [], "eager": []}
    mixed = runner.mixed
    stepper.step(tokens, mix)  # untimed: a set this step needs and `capture_graphs` did not make is made here
    for rep in range(repeats):
        for mode in ("graphs", "eager") if rep % 2 == 0 else ("eager", "graphs"):
            runner.mixed = mixed if mode == "graphs" else None
            try:
                times[mode].append(stepper.step(tokens, mix))
            finally:
                runner.mixed = mixed
    return times


if __name__ == "__main__":
    main()
