"""Where the host time of a decode step goes, phase by phase, and how much of it the GPU waits for (JSON lines).

    python benchmarks/host_steps.py [--shape gpt-oss-20b] [--running 16] [--prompt 1600] [--adapters 8]
                                    [--rank 32] [--layers N] [--steps 30] [--after-profiler] [--out FILE]

Builds the engine as `lora_breakdown` does (random weights at ``--shape``, ``--adapters`` random adapters of
``--rank`` on every linear layer), brings ``--running`` requests to steady decode, base model and then the
adapters round-robin, and runs ``--steps`` decode steps back to back as a server does (no extra syncs), but
without the decode run-ahead (`lora_breakdown.build`), so that each step's host work is what the GPU waits
for; ``serve.py`` times steps with it.
The engine's phases are wrapped with host timers; per run one row of medians in microseconds:

- ``exposed_us``: from the previous step's sampled tokens reaching the host to this step's decode graph run
  call returning (the replay, then the event it records; the GPU idles until the replay is launched: about
  the host time a decode step adds to its GPU time);
- ``pre_launch_us``: from the step's start to that launch; ``post_sample_us``: from the tokens to the step's
  end (the output, the scheduler's update);
- ``phases_us``: per wrapped call (``schedule``, ``update``, ``drop``, ``admit``, ``refresh`` (the LoRA
  tables), ``accepts``, ``fill_rows`` (`DecodeInputs.fill`), ``graph_run`` (fill and replay),
  ``logits``, ``sample`` (it waits for the GPU), ``mark_step``, ``poll``, ``watch``), 0 when not called.

``--after-profiler`` times the LoRA run again after two profiled steps (row ``lora-after-profiler``): once
the profiler has run, CUPTI stays attached and every CUDA call on the host is slower.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lora_breakdown as lb
import serve_models as sm
from timing import emit

import unipage.runner as runner_module

PHASES = ("schedule", "update", "drop", "admit", "refresh", "accepts", "fill_rows", "graph_run", "logits", "sample",
          "mark_step", "poll", "watch")


class HostClock:
    """Host timers around the engine's phases: seconds per phase for the step in progress, and when the
    step's graph launch and its sampled tokens came back."""

    def __init__(self, engine) -> None:
        runner, graphs = engine.runner, engine.runner.graphs
        if graphs is None:
            raise SystemExit("host_steps.py needs the decode graphs (a CUDA engine)")
        self.spent: dict[str, float] = {}
        self.marks: dict[str, float] = {}
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.scheduler, "update", "update")
        self._wrap(runner, "drop", "drop")
        self._wrap(runner, "admit", "admit")
        self._wrap(runner.lora, "refresh", "refresh")
        self._wrap(graphs, "accepts", "accepts")
        self._wrap(graphs.inputs, "fill", "fill_rows")
        self._wrap(graphs, "run", "graph_run", mark="launched")
        self._wrap(runner.model, "logits", "logits")
        self._wrap(runner_module, "sample_tokens", "sample", mark="sampled", sync=True)
        self._wrap(engine.storage, "mark_step", "mark_step")
        self._wrap(engine, "_poll_loads", "poll")
        self._wrap(engine, "_watch_progress", "watch")

    def _wrap(self, owner, name: str, phase: str, mark: str | None = None, sync: bool = False) -> None:
        """``sync``: the call ends once the device has caught up (sampling launches; the runner reads its
        tokens just after)."""
        real = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = real(*args, **kwargs)
            if sync and out.is_cuda:
                torch.cuda.current_stream(out.device).synchronize()
            end = time.perf_counter()
            self.spent[phase] = self.spent.get(phase, 0.0) + end - start
            if mark:
                self.marks[mark] = end
            return out

        setattr(owner, name, timed)


def measure(engine, clock: HostClock, steps: int) -> dict:
    """Medians over ``steps`` decode steps but the first (its ``exposed`` has no previous step: left out)."""
    rows, last_tokens = [], None
    for _ in range(steps):
        clock.spent.clear()
        clock.marks.clear()
        start = time.perf_counter()
        engine.step()
        end = time.perf_counter()
        launched, sampled = clock.marks["launched"], clock.marks["sampled"]
        row = {"step": end - start, "pre_launch": launched - start, "post_sample": end - sampled,
               **{phase: clock.spent.get(phase, 0.0) for phase in PHASES}}
        if last_tokens is not None:
            row["exposed"] = launched - last_tokens
            rows.append(row)
        last_tokens = sampled
    us = lambda key: round(statistics.median(r[key] for r in rows) * 1e6, 1)  # noqa: E731
    return {"steps": len(rows), "step_us": us("step"), "exposed_us": us("exposed"), "pre_launch_us": us("pre_launch"),
            "post_sample_us": us("post_sample"), "phases_us": {phase: us(phase) for phase in PHASES}}


def run(engine, clock: HostClock, args, adapters: list, kind: str, out) -> None:
    with lb.decoding(engine, args, adapters, kind, 3 * args.steps + 20):
        measure_runs(engine, clock, args, adapters, kind, out)


def measure_runs(engine, clock: HostClock, args, adapters: list, kind: str, out) -> None:
    """The run's row, and with ``--after-profiler`` (LoRA) the row after two profiled steps."""
    base = {"bench": "host_steps", "model": sm.model_key(args.shape, False, args.layers), "running": args.running,
            "prompt": args.prompt, "adapters": args.adapters if any(adapters) else 0, "rank": args.rank}
    emit(base | {"run": kind} | measure(engine, clock, args.steps), out)
    if args.after_profiler and any(adapters):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            for _ in range(2):
                engine.step()
            torch.cuda.synchronize()
        emit(base | {"run": f"{kind}-after-profiler"} | measure(engine, clock, args.steps), out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="gpt-oss-20b", choices=sorted(sm.SHAPES))
    p.add_argument("--layers", type=int, default=None, help="cut the model to this many layers")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--running", type=int, default=16, help="requests decoding")
    p.add_argument("--prompt", type=int, default=1600, help="prompt tokens of each request")
    p.add_argument("--steps", type=int, default=30, help="decode steps timed per run")
    p.add_argument("--after-profiler", action="store_true", help="time the LoRA run again after profiling")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps must be >= 2, got {args.steps}")
    if not torch.cuda.is_available():
        raise SystemExit("host_steps.py needs a CUDA device")
    # what `lora_breakdown.build` and `decoding` read
    args.timed_steps, args.prefill, args.budget, args.warmup_steps = args.steps, [1, 8], 4096, 5
    sink = open(args.out, "a") if args.out else contextlib.nullcontext(sys.stdout)  # noqa: SIM115
    with sink as out, tempfile.TemporaryDirectory(prefix="unipage-host-steps-") as root:
        engine, names = lb.build(args, root)
        clock = HostClock(engine)
        for kind, adapters in (("base", [None]), ("lora", names)):
            run(engine, clock, args, adapters, kind, out)


if __name__ == "__main__":
    main()
