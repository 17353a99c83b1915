"""The experts a MoE decode step really touches, against the uniform routing of the decode floor.

`serve_models.DecodeFloor` counts the experts a step reads as the expected number under uniform top-k
routing (`serve_models.experts_touched`).  A random model's router need not route uniformly: tokens of
one adapter, or a greedy run that repeats itself, may share experts.  `probe` runs a short workload of
the measured batch eagerly (no CUDA graphs, so the routing op can be watched) and counts the distinct
experts of every MoE layer call that routes exactly the batch's tokens (at setup a's shapes only the
full-batch decode steps do: prefill steps carry hundreds of prompt tokens); `row` turns that into the
floor with the measured count and the run's step time over it.  Only the base experts' term changes:
the LoRA floor keeps the uniform count.  The probe sees the first decode positions after fresh prompts;
the measured run's median step comes from positions up to its output length, where a greedy random
model may route differently.
"""

from __future__ import annotations

import dataclasses

import serve_driver as drv
import serve_models as sm
import torch


def probe(engine, work: drv.Workload, batch: int, tokens: int, seed: int) -> list[int]:
    """Distinct experts of each MoE layer call routing exactly ``batch`` tokens, over a workload of ``batch``
    requests like ``work``'s (fresh prompts of ``seed``, its first adapters) that each generate ``tokens``
    tokens (the first come out of the prefill steps).  The engine must be idle; its graphs and ops are
    restored after."""
    prompts = drv.make_workload("", batch, len(work.prompts[0]), 1, work.adapters[:batch], batch,
                                engine.vocab_size, seed).prompts
    runner = engine.runner
    model, ops, graphs = runner.model, runner.model.ops, (runner.graphs, runner.mixed)
    counts: list[int] = []

    def route(logits, top_k, renormalize, **options):
        weights, ids = ops.route(logits, top_k, renormalize, **options)
        if ids.shape[0] == batch:
            counts.append(int(torch.unique(ids).numel()))
        return weights, ids

    runner.graphs = runner.mixed = None
    model.ops = dataclasses.replace(ops, route=route)
    try:
        drv.drive(engine, drv.Workload(f"{work.name}-experts", prompts, work.adapters[:batch], [tokens] * batch,
                                       batch), progress_s=float("inf"))
    finally:
        runner.graphs, runner.mixed = graphs
        model.ops = ops
    return counts


def row(record: dict, counts: list[int], floor: sm.DecodeFloor, bandwidth: float) -> dict:
    """The run ``record``'s decode step over the floor with the measured experts (``record`` from setup a);
    without calls counted (a probe too short to reach a full-batch decode step) no measured figures."""
    batch, model = record["decode_batch"], floor.model
    uniform = sm.experts_touched(model, batch)
    expert_bytes = floor.experts(1) * floor.bytes_per  # one expert in every MoE layer
    out = {"bench": "serve", "row": f"{record['row']}-experts", "label": record["label"], "model": record["model"],
           "decode_batch": batch, "layer_calls": len(counts), "experts": model.num_experts, "top_k": model.top_k,
           "experts_touched_uniform": round(uniform, 2), "expert_bytes": round(expert_bytes),
           "floor_bytes": record["floor_bytes"], "step_over_floor": record["step_over_floor"],
           "commit": record["commit"]}
    if counts:
        measured = sum(counts) / len(counts)
        floor_bytes = record["floor_bytes"] + (measured - uniform) * expert_bytes
        out |= {"experts_touched": round(measured, 3), "floor_bytes_measured": round(floor_bytes),
                "step_over_measured_floor": round(record["decode_step_s"] * bandwidth / floor_bytes, 3)}
    return out
