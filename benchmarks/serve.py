"""Serving performance of the engine on random-weight models at real shapes (issue 8), JSON lines.

    python benchmarks/serve.py --setup a [--requests 48] [--layers N] [--out FILE] [--log-dir DIR]
                                         [--piece-layers 0 4 0 4]   # an A/B of the decode graphs' pieces
                                         [--linear-configs '{"max_tokens": 0}' '{"max_tokens": 16}']
                                         [--run-ahead on off on]    # an A/B of the decode run-ahead
    python benchmarks/serve.py --setup b [--models llama3-8b qwen3-30b-a3b] [--requests 1024]
    python benchmarks/serve.py --setup c [--counts 5 50 500 5000] [--repeats 3] [--workdir DIR]
    python benchmarks/serve.py --setup d [--requests 128]
    python benchmarks/serve.py --setup calibrate --logs DIR/*.json [--profile-dir sim/profiles]
    python benchmarks/serve.py --setup calibrate --logs DIR/*.json --profile P --policy affinity  # a what-if

Setups (models are ``config.json`` + ``load_format="dummy"``: no downloads;
every request is greedy with an exact output length, no stop tokens):

- ``a``: GPT-OSS-20B shape, 8 adapters of rank 32 on attention and every
  expert (PEFT ``target_parameters``), 1,600 in / 600 out, a closed loop of
  16 requests in flight.  Output tokens/s (all and per request), TTFT p50/p99,
  and the median decode step of the full batch against its HBM floor (bytes
  of the weights, LoRA weights and KV it touches, over the read bandwidth
  measured in the same run; `serve_models.DecodeFloor`).  Rows without
  ``"bandwidth": "read"`` used the copy bandwidth (bytes read and written),
  which is well below what reads reach (H200: 2.7 against 4.4 TB/s), so
  their ``step_over_floor`` flatters the engine.  The floor counts the experts
  a step reads as under uniform routing; a row ``a-experts`` follows, from an
  eager probe of the same batch after the run (`serve_experts`; requests of
  ``--expert-probe-tokens`` output tokens): the experts each MoE layer's
  full-batch decode step really touched, and the step over the floor with that
  count for the base experts (``step_over_measured_floor``).
- ``b``: Llama-3.1-8B and Qwen3-30B-A3B shapes, N requests submitted at once,
  1K in / 1K out, up to 256 running; first with no adapter, then 16 adapters
  round-robin on every linear layer: the throughput ratio.
- ``c``: adapter scaling on a Llama-3.2-1B shape: 5 -> 50 -> 500 -> 5,000
  registered adapters (rank 4 on q/k/v/o: 1.7 MB each, 8.5 GB for 5,000, written
  once under ``--workdir``), Zipf popularity, a closed loop, a pool of
  ``--pool-pages`` pages that cannot hold them all; a fresh engine per run;
  the scheduler's ``prefill_coalesce_steps`` 3 (admission waits up to three
  decode steps for adapter loads in flight; at 5,000 adapters the simulator
  predicts +1.5 % throughput, TTFT p50 unchanged; an earlier, looser rule gave
  +2.8 % on the H100, within run-to-run noise; it never acts at 5).
  Every count runs ``--repeats`` times, interleaved (the order reversed
  every other repeat), and ``c-scaling`` compares the counts' median runs
  (one run of about 6 s swings by 10-15 %).
- ``d``: transformers + PEFT ``generate`` (one PeftModel, ``load_adapter``
  for each adapter, ``set_adapter`` per group of same-adapter requests) against
  the engine, Llama-3.2-1B shape, the same requests: the speed-up.
- ``calibrate``: reads the run logs that ``--log-dir`` made the setups write,
  fits one cost profile per model (`serve_calib`), writes it as
  ``<profile-dir>/<model>-<gpu>.json`` and replays every run in unipage-sim:
  simulated against measured throughput and p50 TTFT.  ``--profile FILE``
  replays with a given profile instead (an out-of-sample check); with
  ``--policy`` / ``--affinity-wait`` too, a what-if: each run replayed under its
  own scheduler settings and under those (rows ``what-if``: throughput, TTFT and
  distinct adapters a step, both ways).

``--policy`` / ``--affinity-wait`` (a-d) set the scheduler's queue order
(`SchedulerConfig.policy`, ``affinity_max_wait_s``) for every run; each run's
row (and b's ratio row) and run log say which.  Setup b submits every request
at once, so the affinity policy groups requests by adapter only with a wait
longer than the run (the default 1 s makes it FCFS after the first second).

``--piece-layers N [N ...]`` (a, b): the workload runs once per value in the
same engine, its decode CUDA graphs cut into pieces of N layers before each
run (0: one graph a step), later runs on prompts of their own seed: an A/B
free of the process-to-process spread (b's ratio row needs a single value).
``--linear-configs JSON [JSON ...]`` (a, b) likewise, once per launch setting of the
projections' LoRA (`lora_linear.LINEAR`, the run's ``--linear-config`` under each;
the decode and mixed-step graphs captured anew for each run, whose row says ``linear``).

Progress goes to stderr.  ``--tiny`` runs every setup at toy width on the CPU
(the test does); ``--layers`` cuts a model's depth to fit a smaller GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np
import serve_calib
import serve_driver as drv
import serve_experts
import serve_models as sm
import serve_variants
import torch
from timing import commit, emit
from unipage.scheduler import SchedulerConfig
from unipage.scheduler.policies import POLICIES
from unipage.sim import CostProfile

from unipage.config import LoRAConfig, ModelConfig, PoolConfig
from unipage.engine import Engine
from unipage.kernels import lora_linear
from unipage.models.weights import read_config

GRAPHS = {"all": True, "decode": "decode", "off": False}  # --cuda-graphs -> Engine(cuda_graphs=...)
SERVE_POLICIES = sorted(set(POLICIES) - {"slo"})  # --policy: the queue orders that serve every request
DEFAULTS = {  # per setup: flags left unset take these
    "a": {"requests": 48, "concurrency": 16, "prompt": 1600, "output": 600, "adapters": 8, "rank": 32, "max_running": 16,
              "max_adapters_per_batch": 8},
    "b": {"requests": 1024, "prompt": 1024, "output": 1024, "adapters": 16, "rank": 16, "max_running": 256,
              "max_adapters_per_batch": 16},
    "c": {"requests": 512, "concurrency": 64, "prompt": 512, "output": 128, "rank": 4, "max_running": 64,
              "max_adapters_per_batch": 64, "pool_pages": 8192,  # any 64 running may have 64 adapters
              "repeats": 3, "prefill_coalesce_steps": 3},
    "d": {"requests": 128, "prompt": 256, "output": 128, "adapters": 8, "rank": 8, "max_running": 256,
              "max_adapters_per_batch": 8},
}


@dataclasses.dataclass
class Context:
    args: argparse.Namespace
    root: str  # model directories and adapters
    out: object  # the JSON-lines sink
    device: torch.device
    bandwidth: float  # device memory bytes/s of a read-only stream (`drv.memory_bandwidth`)
    h2d: float  # host-to-device bytes/s
    commit: str


# -- engine runs ---------------------------------------------------------------------
def make_engine(ctx: Context, model_dir: str, rank: int, pool_pages: int | None = None) -> Engine:
    a = ctx.args
    sched = SchedulerConfig(max_model_len=a.prompt + a.output + 1, max_num_batched_tokens=a.max_batched_tokens,
                            max_num_seqs=a.max_running, prefill_coalesce_steps=a.prefill_coalesce_steps,
                            **scheduler_settings(a))
    ring = {} if a.staging_ring_mib is None else {"staging_ring_bytes": a.staging_ring_mib << 20}
    lora = LoRAConfig(max_rank=max(rank, 1), max_adapters_per_batch=a.max_adapters_per_batch,
                      host_cache_bytes=int(a.host_cache_gib * (1 << 30)), moe_stack_entries=a.moe_stack_entries,
                      **ring)
    pool = PoolConfig(num_pages=pool_pages) if pool_pages else None
    drv.log(f"loading {os.path.basename(model_dir)} (dummy weights) on {ctx.device}")
    graphs = GRAPHS[a.cuda_graphs] if ctx.device.type == "cuda" else None
    return Engine(model_dir, device=ctx.device, dtype=a.dtype, pool=pool, lora=lora, scheduler=sched,
                  load_format="dummy", cuda_graphs=graphs, run_ahead=("on" in a.run_ahead) if graphs else None)


def scheduler_settings(args: argparse.Namespace) -> dict:
    """``--policy`` and ``--affinity-wait`` as `SchedulerConfig` fields (those given only)."""
    settings = {"policy": args.policy, "affinity_max_wait_s": args.affinity_wait}
    return {k: v for k, v in settings.items() if v is not None}


def graphs_label(ctx: Context) -> str:
    """The CUDA graphs a run used: --cuda-graphs on CUDA, none elsewhere."""
    return ctx.args.cuda_graphs if ctx.device.type == "cuda" else "off"


def decode_graph_pieces(engine: Engine) -> int | None:
    """How many graphs a decode step replays (`unipage.graphs.piece_bounds`); None without decode graphs."""
    graphs = engine.runner.graphs
    return None if graphs is None else len(graphs.bounds)


def free(engine: Engine | None) -> None:
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(ctx: Context, engine: Engine, work: drv.Workload, *, setup: str, key: str, targets: str,
            rank: int, names: list[str]) -> dict:
    """Warm up, run ``work`` with step and disk logs, emit its record (and write its run log)."""
    a = ctx.args
    ranks = dict.fromkeys(names, rank)
    floor = sm.DecodeFloor(engine.hf_config, engine.config.model, targets, rank)
    with drv.DiskLog(engine) as disk:
        count = min(a.warmup_requests, work.concurrency, len(work.prompts))
        warm = drv.warm_up(engine, dataclasses.replace(work, concurrency=count), a.warmup_tokens)
        ahead = engine.runner.ahead_taken, engine.runner.ahead_dropped
        with drv.StepLog(engine, ranks, floor) as steps:
            drv.log(f"{work.name}: {len(work.prompts)} requests, {work.concurrency} in flight")
            timeline = drv.drive(engine, work, steps)
    rows = np.asarray(steps.rows, dtype=np.float64).reshape(-1, len(drv.COLUMNS))
    prompt = np.asarray([len(p) for p in work.prompts])
    metrics = drv.serving_metrics(timeline, prompt)
    batch = min(work.concurrency, a.max_running, len(work.prompts))
    record = {"bench": "serve", "row": setup, "label": work.name, "model": key, "dtype": engine.config.model.dtype,
              "adapters": len(names), "rank": rank if names else 0, "lora_targets": targets if names else None,
              "prompt_tokens": a.prompt, "max_tokens": a.output, "concurrency": work.concurrency,
              "max_running": a.max_running, "pool_pages": engine.config.num_pages, **metrics,
              **drv.decode_summary(rows, batch, ctx.bandwidth), "memory_bytes_per_s": round(ctx.bandwidth),
              "bandwidth": drv.bandwidth_kind(ctx.device),
              "steps": len(rows), "prefill_steps": int((rows[:, drv.COLUMNS.index("prefill")] > 0).sum()),
              "prefill_coalesce_steps": engine.scheduler.config.prefill_coalesce_steps,
              "policy": engine.scheduler.config.policy,
              "affinity_max_wait_s": engine.scheduler.config.affinity_max_wait_s,
              "staging_ring_bytes": engine.config.lora.staging_ring_bytes,  # None: grown as needed
              "staging_ring_end_bytes": engine.storage.ring_bytes,
              "moe_stack_entries": engine.config.lora.moe_stack_entries,
              "moe_stack_fills": engine.runner.moe_stacks.fills if engine.runner.moe_stacks else 0,
              "cuda_graphs": graphs_label(ctx), "decode_graph_pieces": decode_graph_pieces(engine),
              "run_ahead": engine.runner.run_ahead, **ahead_counts(engine, ahead),
              "linear": dict(lora_linear.LINEAR),
              "commit": ctx.commit}
    emit(record, ctx.out)
    if a.log_dir:
        write_run_log(ctx, engine, work, timeline, rows, disk, record, warm, names, targets, rank, steps)
    return record


def write_run_log(ctx: Context, engine: Engine, work, timeline, rows, disk, record, warm, names, targets,
                  rank, steps: drv.StepLog) -> None:
    """Everything `serve_calib` needs to fit and replay this run, as one JSON file."""
    index = {n: i for i, n in enumerate(names)}
    cfg = engine.config
    model = dataclasses.asdict(cfg.model)
    model["mlp_only_layers"] = list(model["mlp_only_layers"])
    log = {"setup": record["row"], "label": work.name, "model_key": record["model"], "device": emit_device(),
           "device_type": ctx.device.type, "commit": ctx.commit, "model": model,
           "pool": {"num_pages": cfg.num_pages, "block_tokens": cfg.pool.block_tokens,
                    "prefix_caching": cfg.pool.prefix_caching},
           "lora": {k: getattr(cfg.lora, k) for k in ("max_rank", "max_adapters_per_batch", "host_cache_bytes",
                                                      "eviction_policy", "moe_stack_entries")},
           "scheduler": dataclasses.asdict(engine.scheduler.config), "targets": targets, "rank": max(rank, 1),
           "adapter_names": names, "warm_adapters": warm, "concurrency": work.concurrency,
           "requests": {"adapter": [index[x] if x is not None else -1 for x in work.adapters],
                        "input": [len(p) for p in work.prompts], "output": list(work.outputs),
                        "submit": timeline.submit.tolist(), "first": timeline.first.tolist(),
                        "finish": timeline.finish.tolist(), "tokens": timeline.tokens.tolist()},
           "loads": {**steps.loads, "adapter": [index.get(x, -1) for x in steps.loads["adapter"]]},
           "read_workers": engine.storage.read_workers,
           "columns": list(drv.COLUMNS), "steps": rows.tolist(), "h2d_bytes_per_s": ctx.h2d,
           "memory_bytes_per_s": ctx.bandwidth, "bandwidth": drv.bandwidth_kind(ctx.device),
           "disk_bytes": disk.bytes, "disk_seconds": disk.seconds, "measured": record}
    os.makedirs(ctx.args.log_dir, exist_ok=True)
    with open(os.path.join(ctx.args.log_dir, f"{work.name}.json"), "w") as f:
        json.dump(log, f)


def emit_device() -> str:
    from timing import device_name

    return device_name()


def register(engine: Engine, paths: list[str]) -> list[str]:
    names = [f"a{i}" for i in range(len(paths))]
    for name, path in zip(names, paths):
        engine.add_adapter(name, path)
    return names


def adapters_for(ctx: Context, model, count: int, rank: int, targets: str, tag: str) -> list[str]:
    root = os.path.join(ctx.root, f"adapters-{tag}-r{rank}-{targets}")
    drv.log(f"writing {count} adapters of rank {rank} on {targets} under {root}")
    return sm.write_adapters(root, model, count, rank, targets, drv.log)


# -- setups --------------------------------------------------------------------------
def setup_a(ctx: Context) -> None:
    a = ctx.args
    key, engine, _, names, work = round_robin_run(ctx, "gpt-oss-20b", "all", "a", "", a.concurrency)
    for variant in serve_variants.variants(ctx, engine, work):
        record = measure(ctx, engine, variant, setup="a", key=key, targets="all", rank=a.rank, names=names)
    if a.expert_probe_tokens and "decode_batch" in record:  # the experts decode steps really touch
        tokens = min(a.expert_probe_tokens, a.output)  # (the engine's max_model_len fits the workload's lengths)
        counts = serve_experts.probe(engine, work, record["decode_batch"], tokens, a.seed + 1000)
        floor = sm.DecodeFloor(engine.hf_config, engine.config.model, "all", a.rank)
        emit(serve_experts.row(record, counts, floor, ctx.bandwidth), ctx.out)


def ahead_counts(engine: Engine, before: tuple[int, int]) -> dict:
    """Decode steps run ahead during a run: used, and thrown away (`ModelRunner.ahead_taken` / ``_dropped``)."""
    runner = engine.runner
    return {"ahead_taken": runner.ahead_taken - before[0], "ahead_dropped": runner.ahead_dropped - before[1]}


def round_robin_run(ctx: Context, shape: str, targets: str, setup: str, suffix: str, concurrency: int):
    """``(key, engine, adapter paths, their names, workload)``: a fresh engine of ``shape`` with ``--adapters`` adapters
    on ``targets`` and ``--requests`` requests round-robin over them."""
    a = ctx.args
    key = sm.model_key(shape, a.tiny, a.layers)
    engine = make_engine(ctx, sm.write_model_dir(ctx.root, shape, a.tiny, a.layers), a.rank, a.pool_pages)
    paths = adapters_for(ctx, engine.config.model, a.adapters, a.rank, targets, key)
    names = register(engine, paths)
    work = drv.make_workload(f"{setup}-{key}{suffix}", a.requests, a.prompt, a.output,
                             [names[i % len(names)] for i in range(a.requests)], concurrency,
                             engine.vocab_size, a.seed)
    return key, engine, paths, names, work


def setup_b(ctx: Context) -> None:
    a = ctx.args
    for shape in a.models:
        key = sm.model_key(shape, a.tiny, a.layers)
        engine = make_engine(ctx, sm.write_model_dir(ctx.root, shape, a.tiny, a.layers), a.rank, a.pool_pages)
        paths = adapters_for(ctx, engine.config.model, a.adapters, a.rank, "all", key)
        names = register(engine, paths)
        results = {}
        for label, per_request in (("base", [None] * a.requests),
                                   ("lora", [names[i % len(names)] for i in range(a.requests)])):
            if label not in a.b_runs:
                continue
            work = drv.make_workload(f"b-{key}-{label}", a.requests, a.prompt, a.output, per_request, a.requests,
                                     engine.vocab_size, a.seed)
            for variant in serve_variants.variants(ctx, engine, work):
                results[label] = measure(ctx, engine, variant, setup="b", key=key, targets="all", rank=a.rank,
                                         names=names if label == "lora" else [])
        if len(results) == 2 and len(a.piece_layers or a.linear_configs or [0]) == 1:  # (--b-runs: one of them)
            emit_b_ratio(ctx, key, results)
        free(engine)
        engine = None


def emit_b_ratio(ctx: Context, key: str, results: dict) -> None:
    a, lora, base = ctx.args, results["lora"]["output_tokens_per_s"], results["base"]["output_tokens_per_s"]
    emit({"bench": "serve", "row": "b-ratio", "model": key, "adapters": a.adapters, "rank": a.rank,
          "requests": a.requests, "policy": results["lora"]["policy"],
          "affinity_max_wait_s": results["lora"]["affinity_max_wait_s"], "lora_output_tokens_per_s": lora,
          "base_output_tokens_per_s": base, "lora_over_base": round(lora / base, 4), "target": 0.90,
          "commit": ctx.commit}, ctx.out)


def zipf_choice(count: int, n: int, s: float, seed: int) -> list[int]:
    """``n`` adapter indices with P(i) proportional to 1/(i+1)^s (the simulator's zipf)."""
    cdf = np.cumsum(1.0 / np.arange(1, count + 1) ** s)
    rng = np.random.default_rng(seed)
    return np.minimum(np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right"), count - 1).tolist()


def setup_c(ctx: Context) -> None:
    """Every count ``--repeats`` times, interleaved, ascending then descending (5, 5000, 5000, 5, ...: no
    count always runs first): one ~6 s run per count swings by 10-15 % on the H100 machine, so the scaling
    row compares the counts' median runs (throughput and p99 TTFT of the run of median throughput)."""
    a, shape = ctx.args, "llama-1b"
    key = sm.model_key(shape, a.tiny, a.layers)
    model_dir = sm.write_model_dir(ctx.root, shape, a.tiny, a.layers)
    model = ModelConfig.from_hf(read_config(model_dir), a.dtype)
    paths = adapters_for(ctx, model, max(a.counts), a.rank, "attention", key)  # once, for the largest count
    counts = sorted(set(a.counts))
    runs: dict[int, list[dict]] = {count: [] for count in counts}
    for repeat in range(a.repeats):
        for count in counts if repeat % 2 == 0 else counts[::-1]:
            runs[count].append(run_count(ctx, model_dir, paths, key, count, repeat))
    medians = [median_run(runs[count]) for count in counts]
    ratio = medians[-1]["output_tokens_per_s"] / medians[0]["output_tokens_per_s"]
    emit({"bench": "serve", "row": "c-scaling", "model": key, "counts": counts, "repeats": a.repeats,
          "output_tokens_per_s": [r["output_tokens_per_s"] for r in medians],
          "ttft_p99_s": [r["ttft_p99_s"] for r in medians],
          "runs_output_tokens_per_s": [[r["output_tokens_per_s"] for r in runs[count]] for count in counts],
          "largest_over_smallest": round(ratio, 4), "target": 0.95,
          "prefill_coalesce_steps": a.prefill_coalesce_steps, "cuda_graphs": graphs_label(ctx),
          "commit": ctx.commit}, ctx.out)


def run_count(ctx: Context, model_dir, paths: list, key: str, count: int, repeat: int) -> dict:
    """One run of setup c with ``count`` registered adapters: emits its ``c`` and ``c-count`` rows."""
    a = ctx.args
    engine = make_engine(ctx, model_dir, a.rank, a.pool_pages)
    names = register(engine, paths[:count])
    pages = engine.memory.adapters.get(names[0]).num_pages
    chosen = zipf_choice(count, a.requests, a.zipf, a.seed)
    label = f"c-{key}-{count}" + (f"-r{repeat}" if repeat else "")  # (a run log per run: named by its label)
    work = drv.make_workload(label, a.requests, a.prompt, a.output, [names[i] for i in chosen],
                             a.concurrency, engine.vocab_size, a.seed)
    record = measure(ctx, engine, work, setup="c", key=key, targets="attention", rank=a.rank, names=names)
    emit({"bench": "serve", "row": "c-count", "model": key, "adapters": count, "rank": a.rank, "repeat": repeat,
          "adapter_pages": pages, "adapter_file_bytes": engine.memory.adapters.get(names[0]).info.file_bytes,
          "pool_pages": engine.config.num_pages, "pool_holds_adapters": engine.config.num_pages // pages,
          "distinct_adapters_used": len(set(chosen)), "output_tokens_per_s": record["output_tokens_per_s"],
          "ttft_p99_s": record["ttft_p99_s"], "prefill_coalesce_steps": a.prefill_coalesce_steps,
          "cuda_graphs": graphs_label(ctx),
          "commit": ctx.commit}, ctx.out)
    free(engine)
    return record


def median_run(records: list[dict]) -> dict:
    """The run of median throughput (the lower middle one of an even number)."""
    ordered = sorted(records, key=lambda r: r["output_tokens_per_s"])
    return ordered[(len(ordered) - 1) // 2]


def setup_d(ctx: Context) -> None:
    import serve_hf

    a = ctx.args
    key, engine, paths, names, work = round_robin_run(ctx, "llama-1b", "attention", "d", "-unipage", a.requests)
    ours = measure(ctx, engine, work, setup="d", key=key, targets="attention", rank=a.rank, names=names)
    dtype = engine.config.model.dtype
    free(engine)
    engine = None
    config = sm.hf_config("llama-1b", a.tiny, a.layers)
    theirs = serve_hf.run_peft(config, dict(zip(names, paths)), work, ctx.device, getattr(torch, dtype),
                               a.hf_batch, a.warmup_tokens)
    emit({"bench": "serve", "row": "d-baseline", "model": key, "baseline": "transformers+peft generate",
          "hf_batch": a.hf_batch, **theirs}, ctx.out)
    emit({"bench": "serve", "row": "d-speedup", "model": key, "requests": a.requests,
          "unipage_output_tokens_per_s": ours["output_tokens_per_s"],
          "peft_output_tokens_per_s": theirs["output_tokens_per_s"],
          "speedup": round(ours["output_tokens_per_s"] / theirs["output_tokens_per_s"], 3), "target": 30,
          "commit": ctx.commit}, ctx.out)


def calibrate(ctx: Context) -> None:
    a = ctx.args
    if not a.logs:
        raise SystemExit("--setup calibrate needs --logs: the run logs the other setups wrote with --log-dir")
    logs = []
    for path in a.logs:
        logs.append(serve_calib.read_log(path))
        if "read_workers" not in logs[-1]:  # a log from before the field
            if a.read_workers is None:
                raise SystemExit(f"{path}: the run log does not say how many adapter reader processes the "
                                 f"engine had; pass --read-workers N (the engine's storage.READ_WORKERS there)")
            logs[-1]["read_workers"] = a.read_workers
    overrides = scheduler_settings(a)  # replay under these scheduler settings instead of calibrating
    groups: dict[tuple, list[dict]] = {}
    for lg in logs:
        groups.setdefault((lg["model_key"], lg["device"]), []).append(lg)
    for group in groups.values():
        if a.profile:
            profile, path, fitted = CostProfile.from_json(a.profile), a.profile, set()
        else:
            profile, quality = serve_calib.fit_profile(group, ctx.commit)
            path, fitted = serve_calib.write_profile(profile, a.profile_dir), {lg["label"] for lg in group}
            emit({"bench": "serve", "row": "profile", "profile": profile.name, "path": str(path), **quality,
                  **profile.to_dict(), "commit": ctx.commit}, ctx.out)
        for lg in group:
            drv.log(f"replaying {lg['label']} in unipage-sim with {profile.name}")
            if overrides:
                emit({**serve_calib.what_if(lg, profile, path, overrides), "commit": ctx.commit}, ctx.out)
            else:
                emit({**serve_calib.compare(lg, profile, path, lg["label"] in fitted), "commit": ctx.commit}, ctx.out)


SETUPS = {"a": setup_a, "b": setup_b, "c": setup_c, "d": setup_d, "calibrate": calibrate}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", required=True, choices=sorted(SETUPS))
    p.add_argument("--requests", type=int, help="requests per run")
    p.add_argument("--concurrency", type=int, help="a, c: requests kept in flight (closed loop)")
    p.add_argument("--prompt", type=int, help="prompt tokens per request")
    p.add_argument("--output", type=int, help="generated tokens per request (exact)")
    p.add_argument("--adapters", type=int, help="a, b, d: adapters, round-robin over the requests")
    p.add_argument("--rank", type=int, help="LoRA rank of every adapter")
    p.add_argument("--max-running", type=int, help="the scheduler's max_num_seqs")
    p.add_argument("--max-adapters-per-batch", type=int, help="LoRAConfig.max_adapters_per_batch")
    p.add_argument("--moe-stack-entries", type=int, default=0,
                   help="LoRAConfig.moe_stack_entries: adapters whose expert LoRA MoE models hold densely beside the "
                        "pool, for steps of that many adapters or fewer (setup b's decode steps hold 4)")
    p.add_argument("--max-batched-tokens", type=int, default=4096, help="token budget of one step")
    p.add_argument("--pool-pages", type=int, help="pool size (default: the engine's; c: 8192)")
    p.add_argument("--prefill-coalesce-steps", type=int,
                   help="SchedulerConfig.prefill_coalesce_steps: decode steps admission may wait for adapter loads "
                        "(default: c 3, others 0)")
    p.add_argument("--policy", choices=SERVE_POLICIES, default=None,
                   help="SchedulerConfig.policy (default: fcfs; not slo, which drops requests the runs must serve); "
                        "calibrate: replay each log under it instead (with --profile)")
    p.add_argument("--affinity-wait", type=float, default=None, metavar="S",
                   help="SchedulerConfig.affinity_max_wait_s (default 1.0), with --policy affinity: a request "
                        "waiting this long goes first in FCFS order")
    p.add_argument("--cuda-graphs", choices=sorted(GRAPHS), default="all",
                   help="CUDA graphs of decode and mixed steps (all), of decode steps only, or none (CUDA only)")
    p.add_argument("--run-ahead", nargs="+", choices=["on", "off"], default=["on"],
                   help="decode steps launch the next one before the host reads their tokens (Engine(run_ahead=...), "
                        "CUDA graphs only); several values: a, b run each workload once per value, in one process")
    p.add_argument("--host-cache-gib", type=float, default=8.0, help="host tier (CPU memory) for adapters")
    p.add_argument("--staging-ring-mib", type=int, default=None,
                   help="LoRAConfig.staging_ring_bytes in MiB, fixed: the pinned ring adapter loads pass through (an "
                        "adapter larger than it is staged on the step loop's thread); default: 256, replaced by one "
                        "that holds two of an adapter too large for it")
    p.add_argument("--models", nargs="+", default=["llama3-8b", "qwen3-30b-a3b"], choices=sorted(sm.SHAPES),
                   help="b: model shapes")
    p.add_argument("--b-runs", nargs="+", default=["base", "lora"], choices=["base", "lora"],
                   help="b: which of the pair to run (the ratio row needs both)")
    p.add_argument("--counts", nargs="+", type=int, default=[5, 50, 500, 5000], help="c: registered adapters")
    p.add_argument("--zipf", type=float, default=1.0, help="c: popularity exponent")
    p.add_argument("--repeats", type=int, help="c: runs of every count, interleaved; the medians are compared")
    p.add_argument("--hf-batch", type=int, default=8, help="d: requests per transformers generate call")
    p.add_argument("--warmup-requests", type=int, default=16, help="requests of the warm-up pass before a run")
    p.add_argument("--warmup-tokens", type=int, default=4, help="output tokens of each warm-up request")
    p.add_argument("--layers", type=int, help="cut the model to this many layers (to fit a smaller GPU)")
    p.add_argument("--tiny", action="store_true", help="toy widths (CPU test)")
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--piece-layers", nargs="+", type=int, default=None, metavar="N",
                   help="a, b: run each workload once per value, the decode graphs in pieces of N layers (0: one "
                        "graph a step; unipage.graphs.PIECE_LAYERS), in one process")
    p.add_argument("--expert-probe-tokens", type=int, default=32,
                   help="a: output tokens of each request of the eager probe counting the experts touched (the "
                        "first come out of prefill steps; 0: no probe)")
    p.add_argument("--linear-config", default=None, metavar="JSON",
                   help="launch settings merged into lora_linear.LINEAR (the fused decode projection)")
    p.add_argument("--linear-configs", nargs="+", type=json_object, default=None, metavar="JSON",
                   help="a, b: run each workload once per entry, each merged into lora_linear.LINEAR (after "
                        "--linear-config), in one process")
    p.add_argument("--workdir", default=None, help="model configs and adapters (kept; default: a temp dir)")
    p.add_argument("--out", default=None, help="append JSON lines here (default: stdout)")
    p.add_argument("--log-dir", default=None, help="write one run log per run here (for --setup calibrate)")
    p.add_argument("--logs", nargs="*", default=[], help="calibrate: run logs to fit and replay")
    p.add_argument("--profile-dir", default="sim/profiles", help="calibrate: where the fitted profiles go")
    p.add_argument("--profile", default=None, help="calibrate: replay with this profile instead of fitting")
    p.add_argument("--read-workers", type=int, default=None,
                   help="calibrate: adapter reader processes of the engine, for run logs that do not say")
    args = p.parse_args(argv)
    for name, value in DEFAULTS.get(args.setup, {}).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.prefill_coalesce_steps is None:
        args.prefill_coalesce_steps = 0
    _check_values(p, args)
    _linear_settings(p, args)
    return args


def _check_values(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A parser error for a flag's value out of range or a flag given where it does not apply."""
    if args.prefill_coalesce_steps < 0:
        p.error(f"--prefill-coalesce-steps must be >= 0, got {args.prefill_coalesce_steps}")
    if args.affinity_wait is not None and (args.affinity_wait < 0 or args.policy != "affinity"):
        p.error(f"--affinity-wait needs --policy affinity and a value >= 0, got {args.affinity_wait} "
                f"with --policy {args.policy}")
    if args.setup == "calibrate" and args.policy and not args.profile:
        p.error("--policy with --setup calibrate replays the logs under it: it needs --profile (the profile to "
                "replay with)")
    if args.expert_probe_tokens < 0:
        p.error(f"--expert-probe-tokens must be >= 0, got {args.expert_probe_tokens}")
    for name in ("requests", "concurrency", "prompt", "output", "adapters", "rank", "max_running", "repeats",
                 "staging_ring_mib"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.piece_layers and min(args.piece_layers) < 0:
        p.error(f"--piece-layers must be >= 0, got {args.piece_layers}")
    if args.piece_layers and args.setup not in ("a", "b"):
        p.error(f"--piece-layers is for setups a and b, not {args.setup}")
    if args.setup == "c" and min(args.counts) < 1:
        p.error(f"--counts must be >= 1, got {args.counts}")


def _linear_settings(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``args.linear_base``: `lora_linear.LINEAR` under ``--linear-config``; each ``--linear-configs`` entry
    checked over it (known settings, a valid launch setting) — a parser error otherwise."""
    if args.linear_configs and (args.setup not in ("a", "b") or args.piece_layers):
        p.error("--linear-configs is for setups a and b, without --piece-layers")
    try:
        args.linear_base = {**lora_linear.LINEAR, **json_object(args.linear_config or "{}")}
    except ValueError as exc:
        p.error(f"--linear-config: {exc}")
    for entry in args.linear_configs or []:
        unknown = set(entry) - set(lora_linear.LINEAR)
        if unknown:
            p.error(f"--linear-configs: unknown settings {sorted(unknown)}; lora_linear.LINEAR has "
                    f"{sorted(lora_linear.LINEAR)}")
        try:
            lora_linear.check_config(args.linear_base | entry)
        except ValueError as exc:
            p.error(f"--linear-configs: {exc}")


def json_object(text: str) -> dict:
    """A JSON object from the command line (argparse reports the ValueError as a bad value)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object: {text}")
    return value


def main(argv=None) -> None:
    args = parse(argv)
    lora_linear.LINEAR.update(args.linear_base)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    sink = open(args.out, "a") if args.out else contextlib.nullcontext(sys.stdout)  # noqa: SIM115
    workdir = contextlib.nullcontext(args.workdir) if args.workdir else tempfile.TemporaryDirectory(
        prefix="unipage-serve-")
    with sink as out, workdir as root:
        calibrating = args.setup == "calibrate"
        ctx = Context(args, root, out, device, 0.0 if calibrating else drv.memory_bandwidth(device),
                      0.0 if calibrating else drv.h2d_bandwidth(device), commit())
        start = time.perf_counter()
        SETUPS[args.setup](ctx)
        drv.log(f"setup {args.setup} done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
