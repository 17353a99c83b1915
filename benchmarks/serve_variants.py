"""`serve.py`'s A/B runs in one process: a workload run once per value of a setting, the engine switched
between runs (``--piece-layers``, ``--linear-configs``, ``--run-ahead``), each run after the first on prompts
of its own seed (no prefix-cache hits).  ``ctx`` is `serve.Context` (they read its ``args``)."""

from __future__ import annotations

import dataclasses

import serve_driver as drv

from unipage.engine import Engine
from unipage.kernels import lora_linear


def variants(ctx, engine: Engine, work: drv.Workload):
    """`piece_variants`, or with ``--linear-configs`` `linear_variants`, or with several ``--run-ahead``
    values `run_ahead_variants` (they exclude each other)."""
    if len(ctx.args.run_ahead) > 1:
        return run_ahead_variants(ctx, engine, work)
    return (linear_variants if ctx.args.linear_configs else piece_variants)(ctx, engine, work)


def run_ahead_variants(ctx, engine: Engine, work: drv.Workload):
    """``work`` once per ``--run-ahead`` value, the engine's decode run-ahead (`ModelRunner.run_ahead`) set
    to it before each run: an A/B in one process (the scheduler keeps its KV room ahead throughout).  Runs
    get prompts as in `piece_variants`, names ``-ra<value>-<i>``."""
    if engine.runner.graphs is None:
        raise SystemExit("--run-ahead on needs the decode CUDA graphs (a CUDA device, --cuda-graphs all or decode)")
    for i, value in enumerate(ctx.args.run_ahead):
        engine.runner.run_ahead = value == "on"
        yield _fresh_prompts(ctx, engine, work, f"{work.name}-ra{value}-{i}", i)


def linear_variants(ctx, engine: Engine, work: drv.Workload):
    """``work`` once per ``--linear-configs`` entry, `lora_linear.LINEAR` set to the run's own settings
    (``ctx.args.linear_base``: the defaults under ``--linear-config``) updated by that entry, and the CUDA
    graphs dropped (they hold the launches of the settings they were captured with) before each run: an A/B
    in one process.  Runs get prompts as in `piece_variants`, names ``-l<i>``.  After the last (or an
    abandoned) run `lora_linear.LINEAR` is the run's own settings again, its graphs dropped."""
    try:
        for i, entry in enumerate(ctx.args.linear_configs):
            _set_linear(engine, ctx.args.linear_base | entry)
            yield _fresh_prompts(ctx, engine, work, f"{work.name}-l{i}", i)
    finally:
        _set_linear(engine, ctx.args.linear_base)


def _set_linear(engine: Engine, settings: dict) -> None:
    """`lora_linear.LINEAR` = ``settings``; the engine's CUDA graphs (decode and mixed, where it has them)
    dropped, to be captured with them."""
    lora_linear.LINEAR.clear()
    lora_linear.LINEAR.update(settings)
    for graphs in (engine.runner.graphs, engine.runner.mixed):
        if graphs is not None:
            graphs.drop()


def _fresh_prompts(ctx, engine: Engine, work: drv.Workload, name: str, i: int) -> drv.Workload:
    """``work`` named ``name``; after the first run (``i`` > 0) on prompts of their own seed (no prefix hits)."""
    prompts = drv.make_workload("", len(work.prompts), len(work.prompts[0]), 1, work.adapters, work.concurrency,
                                engine.vocab_size, ctx.args.seed + i).prompts
    return dataclasses.replace(work, name=name, prompts=prompts)


def piece_variants(ctx, engine: Engine, work: drv.Workload):
    """``work`` once per ``--piece-layers`` value (once as it is without), the engine's decode graphs set to
    pieces of that many layers before each run: an A/B in one process.  Runs after the first get prompts of
    their own seed (no prefix-cache hits) and a name ending ``-p<layers>-<i>``."""
    values = ctx.args.piece_layers
    if not values:
        yield work
        return
    if engine.runner.graphs is None:
        raise SystemExit("--piece-layers needs the decode CUDA graphs (a CUDA device, --cuda-graphs all or decode)")
    for i, layers in enumerate(values):
        engine.runner.graphs.set_piece_layers(layers)
        yield _fresh_prompts(ctx, engine, work, f"{work.name}-p{layers}-{i}", i)
