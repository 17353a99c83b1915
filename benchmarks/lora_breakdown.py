"""Where a LoRA step's extra time goes: device time per kernel, base model against LoRA (JSON lines).

    python benchmarks/lora_breakdown.py [--shape llama3-8b] [--adapters 16] [--max-adapters N] [--resident N]
                                        [--running 252]
                                        [--prompt 64] [--prefill 4 960]
                                        [--no-early] [--no-moe-pdl] [--piece-layers N] [--linear-ab]
                                        [--stack-ab] [--moe-ab JSON] [--dense-ab JSON] [--skinny-ab]
                                        [--linear-config JSON] [--moe-stack-entries N]
                                        [--trace DIR] [--out FILE]

Builds the engine on ``--shape`` (random weights at its real shape) with
``--adapters`` random rank-``--rank`` adapters on every linear layer (``--max-adapters``:
`max_adapters_per_batch`, by default ``--adapters``; the CUDA graphs' adapter classes follow it;
``--resident N``: N adapters made and loaded first, all at once, so that the LoRA tables' slot capacity is
what serving N adapters makes it, and the runs use ``--adapters`` of them spread over the slots;
``--moe-stack-entries N``: `LoRAConfig.moe_stack_entries`, the MoE LoRA stacks), then for
the base model and for the adapters round-robin: ``--running`` requests with
``--prompt``-token prompts reach steady decode and ``--timed-steps`` decode steps
are timed without the profiler (median wall time per step, synchronised; the
rest of this paragraph up to ``--trace`` is timed too, all before any profile:
the profiler slows every later CUDA call on the host); then, once both runs are
timed, ``--steps`` decode steps of new requests are profiled (CUDA graphs, as served).  The timed steps
also give the host time before each step's decode graph run call and of that call (``*_pre_graph_ms``, ``*_graph_call_ms``:
is a step bound by the host?  ``*_graph_fill_ms``: the call's input fill, the rest being the replay's launch),
and as many steps more are timed queued behind a sleep kernel that keeps
the GPU busy while the host prepares them (``*_hidden_host_ms``: the step time less the host time the
GPU waits for; ``*_unhidden_steps``: those whose host work outlasted the sleep); ``--piece-layers N``
times both again with the decode graphs in pieces of N layers, then with one graph again (``*_pieces``:
``pieces`` and ``after``, an A-B-A within the process); ``--linear-ab`` times the LoRA run's steps with
the projections' LoRA the other way, the fused decode projection (`lora_linear`) against separate launches
(the projection with its bias, shrink, expand), then as before (``lora_linear_ab``: ``max_tokens`` of the other way,
``other`` and ``after``; ``--linear-config JSON`` sets `lora_linear.LINEAR` first); ``--stack-ab`` times
them without the shrink stack (`shrink_stack`: the paged shrink kernels), then with it again
(``lora_stack_ab``: ``off`` and ``after``; ``shrink_stack`` says whether the engine built one); ``--moe-ab JSON``
with those settings on every MoE LoRA launch config (paths as `kernels_moe.with_path`), then as tuned
(``lora_moe_ab``: ``overrides``, ``other`` and ``after``); ``--dense-ab JSON`` likewise with settings over the
dense LoRA launch configs, tuned entries too (``lora_dense_ab``); ``--skinny-ab`` times both runs' steps
with every projection on ``F.linear`` (`skinny.ENABLED` off), then with the skinny kernel again
(``*_skinny_ab``: ``off`` and ``after``); then ``--prefill``
prompts (count, tokens) join and the step that prefills them beside the
decodes is profiled (twice: the first makes its graphs).  Per window (decode,
mixed) one record: wall and device time per step, and the device time per
step of every kernel name, with the LoRA run's excess over the base run per
layer (``lora_extra_us_per_layer``), largest first.  Kernel times come from
``torch.profiler`` (CUPTI), graph replays included.  ``--no-early`` launches
the dense LoRA shrinks plainly (the default config's ``"early": false``),
``--no-moe-pdl`` the MoE LoRA expands (``"pdl": false``), each for an A/B run in
a second process.  ``--trace DIR`` also writes a Chrome trace (host and device,
gzipped) of three more decode steps per run, ``DIR/<base|lora>-decode.json.gz``.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_models as sm
from kernels_moe import overrides_arg, with_path
from timing import emit
from unipage.scheduler import Request, SamplingParams, SchedulerConfig

from unipage.config import LoRAConfig, ModelConfig
from unipage.kernels import lora_linear, lora_meta, lora_plan, moe_lora_plan, skinny
from unipage.engine import Engine
from unipage.models.weights import read_config

GREEDY = SamplingParams(temperature=0)
FUSED_TOKENS = 16  # --linear-ab: the fused decode projection for up to this many tokens
NAME_CHARS = 60  # kernel names are cut to this many characters (templated names run to pages)


def build(args, root: str) -> tuple[Engine, list[str]]:
    model_dir = sm.write_model_dir(root, args.shape, False, args.layers)
    model = ModelConfig.from_hf(read_config(model_dir), "bfloat16")
    paths = sm.write_adapters(os.path.join(root, "adapters"), model, args.resident, args.rank, "all")
    max_len = max(args.prompt + decode_tokens(args) + 2, args.prefill[1] + 8)
    engine = Engine(model_dir, device="cuda", dtype="bfloat16",
                    lora=LoRAConfig(max_rank=args.rank, max_adapters_per_batch=args.max_adapters,
                                    moe_stack_entries=args.moe_stack_entries),
                    scheduler=SchedulerConfig(max_model_len=max_len, max_num_seqs=args.running + args.prefill[0],
                                              max_num_batched_tokens=args.budget), load_format="dummy",
                    run_ahead=False)  # (steps timed one by one: none launched ahead of its own)
    names = [f"a{i}" for i in range(len(paths))]
    for name, path in zip(names, paths):
        engine.add_adapter(name, path)
    if args.resident > args.adapters:
        load_all(engine, names)
    return engine, spread(names, args.adapters)


def spread(names: list[str], count: int) -> list[str]:
    """``count`` of ``names`` evenly spaced (loaded in order, their slots too)."""
    return [names[i * len(names) // count] for i in range(count)]


def load_all(engine: Engine, names: list[str]) -> None:
    """One one-token request per adapter, all at once, run to the end: every adapter loaded into its own
    slot (`max_adapters_per_batch` permitting: else in turns, each still in its own slot while the pool
    has room)."""
    for name in names:
        engine.add_request(Request(f"load-{name}", [1, 2, 3, 4], name, GREEDY, max_tokens=1))
    while engine.has_unfinished():
        engine.step()


def decode_tokens(args) -> int:
    """Tokens a decoding request may make: those of the steps that prefill the others beside it, its
    warm-up, `decode_times`' steps (2 x ``--timed-steps``), and as many again with a warm-up for each run of
    every A-B-A asked for, with room to spare (a request that finished mid-way would leave a run timing a
    smaller batch)."""
    abs_ = sum(map(bool, (args.piece_layers, args.linear_ab, args.stack_ab, args.moe_ab, args.dense_ab,
                          args.skinny_ab)))
    per_run = args.warmup_steps + 2 * args.timed_steps
    prefill = -(-args.running * args.prompt // args.budget)
    return prefill + per_run * (1 + 2 * abs_) + args.steps + 100


def kernel_times(prof) -> dict[str, float]:
    """Device microseconds by (cut) kernel name over the profiled region."""
    times: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None)
        if device_us is None:
            device_us = event.cuda_time_total
        if device_us > 0 and event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.key[:NAME_CHARS]] += device_us
    return times


def profiled(engine: Engine, steps: int) -> tuple[float, dict[str, float], set[str]]:
    """Wall seconds per step, device us per step by kernel, and the requests that finished, over ``steps``
    engine steps under the profiler."""
    torch.cuda.synchronize()
    finished: set[str] = set()
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            finished.update(out[0] for out in engine.step() if out[2] is not None)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    return wall, {k: v / steps for k, v in kernel_times(prof).items()}, finished


@contextlib.contextmanager
def graph_calls(engine: Engine, hook):
    """Meanwhile the engine's decode graph run calls go through ``hook(real_run, seqs)`` (nothing to wrap
    without decode graphs)."""
    graphs = engine.runner.graphs
    if graphs is None:
        yield
        return
    real = graphs.run
    graphs.run = lambda seqs: hook(real, seqs)
    try:
        yield
    finally:
        del graphs.run  # the bound method again


def timed(engine: Engine, steps: int) -> tuple[float, float | None, float | None, float | None]:
    """Medians over ``steps`` engine steps, each synchronised (no profiler): the wall seconds of a step;
    the host seconds from its start to its decode graph's run call, and of that call (filling the graph's
    inputs and launching its replay; no sync inside): a step whose call takes longer than its GPU work,
    or starts late, is bound by the host; and of the call's input fill.  None for the three without decode
    graphs."""
    marks = {}

    def run(real, seqs):
        marks["call"] = time.perf_counter()
        hidden = real(seqs)
        marks["back"] = time.perf_counter()
        return hidden

    times, pre, calls, fills = [], [], [], []
    with graph_calls(engine, run), _timed_fill(engine, fills):
        for _ in range(steps):
            torch.cuda.synchronize()
            marks.clear()
            start = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            if marks:
                pre.append(marks["call"] - start)
                calls.append(marks["back"] - marks["call"])
    median = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return statistics.median(times), median(pre), median(calls), median(fills)


@contextlib.contextmanager
def _timed_fill(engine: Engine, fills: list[float]):
    """Meanwhile the host seconds of each decode graph input fill (`DecodeGraphs._fill`: the wait for the last
    replay's copies, then the pinned rows; from c6e6cb4 on the graph holds the copies, before it the fill
    issued them; the rest of a run call is the replay and its event) go to ``fills``."""
    graphs = engine.runner.graphs
    if graphs is None:
        yield
        return
    real = graphs._fill

    def fill(seqs, bucket):
        start = time.perf_counter()
        real(seqs, bucket)
        fills.append(time.perf_counter() - start)

    graphs._fill = fill
    try:
        yield
    finally:
        del graphs._fill


def busy_wait(engine: Engine, steps: int, hold_ms: float = 6.0) -> tuple[float, int]:
    """The median wall seconds of ``steps`` engine steps each queued behind a sleep kernel that holds the
    GPU about ``hold_ms``, less that kernel's time: the step as if its host work before the forward pass
    (scheduling, inputs, the graph launch) were hidden.  A plain step's wall time less this is the host
    time the GPU waits for.  Also how many of those steps reached their decode graph's run call after the
    sleep had ended (their host work was not wholly hidden: the median then understates the wait)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    late = []

    def run(real, seqs):
        late.append(end.query())  # True: the GPU went idle before the host got here
        return real(seqs)

    cycles = 1 << 20
    for _ in range(2):  # cycles per ms of this GPU, then the cycles for hold_ms
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        cycles = max(1, int(cycles * hold_ms / start.elapsed_time(end)))
    times = []
    with graph_calls(engine, run):
        for _ in range(steps):
            torch.cuda.synchronize()
            begin = time.perf_counter()
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            engine.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - begin - start.elapsed_time(end) / 1e3)
    return statistics.median(times), sum(late)


def decode_times(engine: Engine, steps: int) -> dict:
    """`timed` and `busy_wait` over ``steps`` decode steps each, in milliseconds."""
    step, pre, call, fill = timed(engine, steps)
    hidden, late = busy_wait(engine, steps)
    ms = lambda s: None if s is None else round(s * 1e3, 3)  # noqa: E731
    return {"step_ms": ms(step), "hidden_host_ms": ms(hidden), "unhidden_steps": late, "pre_graph_ms": ms(pre),
            "graph_call_ms": ms(call), "graph_fill_ms": ms(fill)}


def pieces_ab(engine: Engine, args) -> dict:
    """Decode steps timed with the decode graphs in pieces of ``--piece-layers`` layers (captured anew), as
    `decode_times` times them, then again with the graphs as they were (``after``: the contexts grow over
    the run, so the first timing alone would favour the graphs timed first)."""
    graphs = engine.runner.graphs
    before = graphs.piece_layers
    return {"layers": args.piece_layers,
            **_a_b_a(engine, args, "pieces", lambda: graphs.set_piece_layers(args.piece_layers),
                     lambda: graphs.set_piece_layers(before))}


def linear_ab(engine: Engine, args) -> dict:
    """Decode steps timed with the projections' LoRA the other way (`lora_linear.LINEAR`'s ``max_tokens``: the
    fused decode projection if the engine runs the separate launches, else those), graphs captured anew,
    then as before (``after``), as `pieces_ab` does."""
    before = lora_linear.LINEAR["max_tokens"]
    other = 0 if before else FUSED_TOKENS

    def switch(max_tokens: int) -> None:
        lora_linear.LINEAR["max_tokens"] = max_tokens
        engine.runner.graphs.drop()  # the captured graphs hold the other launches

    return {"max_tokens": other, **_a_b_a(engine, args, "other", lambda: switch(other), lambda: switch(before))}


def stack_ab(engine: Engine, args) -> dict:
    """Decode steps timed without the shrink stack (`unipage.models.shrink_stack`: the paged shrink kernels
    again), graphs captured anew, then with it (``after``), as `pieces_ab` does."""
    model, stack = engine.model, engine.runner.stack

    def switch(on: bool) -> None:
        model.stack = stack if on else None
        _drop_graphs(engine)

    return _a_b_a(engine, args, "off", lambda: switch(False), lambda: switch(True))


def moe_ab(engine: Engine, args) -> dict:
    """Decode steps timed with ``--moe-ab``'s overrides set on every MoE LoRA launch config (paths as
    `kernels_moe.with_path`: ``"split_k"``, ``"gate_up.num_warps"``), then as before (`_lookup_ab`)."""
    return _lookup_ab(engine, args, moe_lora_plan, overridden(moe_lora_plan.launch_config, args.moe_ab), args.moe_ab)


def dense_ab(engine: Engine, args) -> dict:
    """Decode steps timed with ``--dense-ab``'s settings over every dense LoRA launch config (the tuned
    entries too: e.g. ``"block_n"``, ``"expand_warps"``), then as before (`_lookup_ab`)."""
    lookup = lora_plan.launch_config
    return _lookup_ab(engine, args, lora_plan, lambda *config_args: lookup(*config_args) | args.dense_ab,
                      args.dense_ab)


def skinny_ab(engine: Engine, args) -> dict:
    """Decode steps timed with every projection on ``F.linear`` (`skinny.ENABLED` off), graphs captured anew,
    then with the tuned skinny entries again (``after``), as `pieces_ab` does."""
    def switch(on: bool) -> None:
        skinny.ENABLED = on
        _drop_graphs(engine)

    return _a_b_a(engine, args, "off", lambda: switch(False), lambda: switch(True))


def _lookup_ab(engine: Engine, args, module, other, overrides: dict) -> dict:
    """``module.launch_config`` (the lookup its kernels' launches call) replaced by ``other``, graphs captured
    anew, decode steps timed; then the lookup put back and timed again, as `pieces_ab` does."""
    lookup = module.launch_config

    def switch(fn) -> None:
        module.launch_config = fn
        _drop_graphs(engine)

    return {"overrides": overrides,
            **_a_b_a(engine, args, "other", lambda: switch(other), lambda: switch(lookup))}


def _drop_graphs(engine: Engine) -> None:
    for graphs in (engine.runner.graphs, engine.runner.mixed):  # the captured graphs hold the other launches
        if graphs is not None:
            graphs.drop()


def overridden(lookup, overrides: dict):
    """``lookup`` (`moe_align.launch_config`'s signature) with ``overrides`` set on every entry it returns."""
    def config(kind, *rest):
        entry = lookup(kind, *rest)
        for path, value in overrides.items():
            entry = with_path(entry, path, value)
        return entry
    return config


def _a_b_a(engine: Engine, args, name: str, change, restore) -> dict:
    """``change``, time; ``restore`` (also when that raised), time again (``after``)."""
    out = {}
    try:
        change()
        out[name] = _warm_times(engine, args)
    finally:
        restore()
    out["after"] = _warm_times(engine, args)
    return out


def _warm_times(engine: Engine, args) -> dict:
    for _ in range(args.warmup_steps):
        engine.step()
    return decode_times(engine, args.timed_steps)


def trace(engine: Engine, steps: int, path: str) -> None:
    """A Chrome trace of ``steps`` engine steps, host calls and device kernels, gzipped to ``path``."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as raw:
        prof.export_chrome_trace(raw.name)
        with open(raw.name, "rb") as src, gzip.open(path, "wb") as dst:
            dst.write(src.read())


def run(engine: Engine, args, adapters: list[str | None], kind: str, profiling: bool) -> dict:
    """One run (``kind`` base or LoRA), timed (``profiling`` False: ``{"times": `decode_times`}``, and "pieces" /
    "linear_ab" with ``--piece-layers`` / ``--linear-ab``) or profiled (``{"decode": (wall s/step,
    {kernel: us/step}), "mixed": (...)}``).  `main` times both runs before it profiles either: once the
    profiler has run, CUPTI stays attached to the process and every CUDA call on the host is slower after
    (setup (a)'s LoRA graph run call on an H200: 0.24 ms before, 0.83 ms after, host-steps-h200.jsonl).
    The profiled phase runs on new requests, so its contexts are shorter (``--prompt`` + warm-up) than the
    timed phase's (up to ``--prompt`` + `decode_tokens`): its attention times are not the timed steps'."""
    tag = f"{kind}-p" if profiling else kind  # request ids of their own
    with decoding(engine, args, adapters, tag, decode_tokens(args)) as prompt:
        if profiling:
            return _profiled_run(engine, args, adapters, kind, prompt)
        return _timed_run(engine, args, adapters)


@contextlib.contextmanager
def decoding(engine: Engine, args, adapters: list[str | None], tag: str, max_tokens: int):
    """``args.running`` requests (ids ``<tag>-d<i>``, adapters round-robin, ``args.prompt``-token random prompts)
    brought to steady decode: adapters loaded, prompts prefilled, ``args.warmup_steps`` decode steps run (the
    full batch's decode graph captured and replayed).  Yields the prompt maker; aborts and drains them after
    (not after an error: the error is what counts)."""
    rng, vocab = random.Random(0), min(engine.vocab_size, 30000)
    prompt = lambda n: [rng.randrange(1, vocab) for _ in range(n)]  # noqa: E731
    for i in range(args.running):
        engine.add_request(Request(f"{tag}-d{i}", prompt(args.prompt), adapters[i % len(adapters)], GREEDY,
                                   max_tokens=max_tokens))
    started: set[str] = set()
    while len(started) < args.running:
        started.update(out[0] for out in engine.step())
    for _ in range(args.warmup_steps):
        engine.step()
    yield prompt
    for i in range(args.running):
        engine.abort(f"{tag}-d{i}")
    while engine.has_unfinished():
        engine.step()


def _timed_run(engine: Engine, args, adapters: list[str | None]) -> dict:
    out = {"times": decode_times(engine, args.timed_steps)}
    if args.piece_layers:  # the same steps with the decode graphs cut into pieces, then one graph again
        out["pieces"] = pieces_ab(engine, args)
    if args.linear_ab and any(adapters):  # the projections' LoRA the other way (fused / separate), then back
        out["linear_ab"] = linear_ab(engine, args)
    if args.stack_ab and any(adapters) and engine.runner.stack is not None:  # without the stack, then with it
        out["stack_ab"] = stack_ab(engine, args)
    if args.moe_ab and any(adapters):  # the MoE LoRA kernels with other launch settings, then as tuned
        out["moe_ab"] = moe_ab(engine, args)
    if args.dense_ab and any(adapters):  # the dense LoRA kernels likewise
        out["dense_ab"] = dense_ab(engine, args)
    if args.skinny_ab:  # the projections on cuBLAS, then with the skinny kernel where tuned
        out["skinny_ab"] = skinny_ab(engine, args)
    return out


def _profiled_run(engine: Engine, args, adapters: list[str | None], kind: str, prompt) -> dict:
    out = {"decode": profiled(engine, args.steps)[:2]}
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        trace(engine, 3, os.path.join(args.trace, f"{kind}-decode.json.gz"))
    count, tokens = args.prefill
    for rep in range(2):  # the first mixed step of this shape captures its graphs; the second is measured
        names = [f"{kind}-p{rep}-{i}" for i in range(count)]
        for i, name in enumerate(names):
            engine.add_request(Request(name, prompt(tokens), adapters[i % len(adapters)], GREEDY, max_tokens=1))
        wall, kernels, finished = profiled(engine, 1)
        if rep:
            out["mixed"] = (wall, kernels)
        if not set(names) <= finished:
            raise RuntimeError(f"the mixed step did not prefill every prompt: {sorted(set(names) - finished)}")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b", choices=sorted(sm.SHAPES))
    p.add_argument("--layers", type=int, default=None, help="cut the model to this many layers")
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--max-adapters", type=int, default=None,
                   help="max_adapters_per_batch (default: --adapters); setup b serves 16 at about 4 a step")
    p.add_argument("--resident", type=int, default=None,
                   help="adapters made and loaded before the runs (default: --adapters); the runs use --adapters "
                        "of them, spread over the slots")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--running", type=int, default=252, help="requests decoding")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens of the decoding requests")
    p.add_argument("--prefill", type=int, nargs=2, default=[4, 960], metavar=("COUNT", "TOKENS"),
                   help="prompts prefilled in the mixed step beside the decodes")
    p.add_argument("--budget", type=int, default=4096, help="max_num_batched_tokens")
    p.add_argument("--steps", type=int, default=5, help="decode steps profiled")
    p.add_argument("--timed-steps", type=int, default=30, help="decode steps timed (median), before the profile")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--no-early", action="store_true",
                   help="launch the dense LoRA shrinks plainly, not as dependents of their projections")
    p.add_argument("--no-moe-pdl", action="store_true",
                   help="launch the MoE LoRA expands plainly, not as dependents of the kernels before them")
    p.add_argument("--piece-layers", type=int, default=0,
                   help="also time the decode steps with the decode graphs in pieces of this many layers")
    p.add_argument("--linear-ab", action="store_true",
                   help="also time the LoRA run's decode steps with the projections' LoRA the other way (fused "
                        "into the decode projection, `lora_linear`, or separate launches), then as before")
    p.add_argument("--moe-stack-entries", type=int, default=0,
                   help="LoRAConfig.moe_stack_entries: the experts' LoRA of this many adapters held densely")
    p.add_argument("--stack-ab", action="store_true",
                   help="also time the LoRA run's decode steps without the shrink stack, then with it again")
    p.add_argument("--moe-ab", type=overrides_arg, default=None, metavar="JSON",
                   help="also time the LoRA run's decode steps with these settings on every MoE LoRA launch config "
                        "(group-mode entries too; e.g. '{\"split_k\": 8, \"gate_up.num_warps\": 1}'), then as tuned")
    p.add_argument("--dense-ab", type=overrides_arg, default=None, metavar="JSON",
                   help="also time the LoRA run's decode steps with these settings over every dense LoRA launch config "
                        "(e.g. '{\"expand_warps\": 1}'), then as before")
    p.add_argument("--skinny-ab", action="store_true",
                   help="also time both runs' decode steps with every projection on F.linear, then with the tuned "
                        "skinny kernel entries again")
    p.add_argument("--linear-config", default=None, metavar="JSON",
                   help="launch settings merged into lora_linear.LINEAR (the fused decode projection)")
    p.add_argument("--trace", default=None, metavar="DIR", help="write Chrome traces of 3 decode steps here")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.piece_layers < 0:
        p.error(f"--piece-layers must be >= 0, got {args.piece_layers}")
    if args.moe_stack_entries < 0:
        p.error(f"--moe-stack-entries must be >= 0, got {args.moe_stack_entries}")
    args.max_adapters = args.adapters if args.max_adapters is None else args.max_adapters
    if args.max_adapters < args.adapters:
        p.error(f"--max-adapters must be >= --adapters ({args.adapters}), got {args.max_adapters}")
    args.resident = args.adapters if args.resident is None else args.resident
    if args.resident < args.adapters:
        p.error(f"--resident must be >= --adapters ({args.adapters}), got {args.resident}")
    if args.no_early:  # the default config of every path, which the tuned entries overlay
        for path in lora_meta._load_json()["default"].values():
            path["early"] = False
    if args.no_moe_pdl:
        _no_moe_pdl()
    lora_linear.LINEAR.update(json.loads(args.linear_config or "{}"))
    if not torch.cuda.is_available():
        raise SystemExit("lora_breakdown.py needs a CUDA device")
    sink = open(args.out, "a") if args.out else contextlib.nullcontext(sys.stdout)  # noqa: SIM115
    with sink as out, tempfile.TemporaryDirectory(prefix="unipage-breakdown-") as root:
        engine, names = build(args, root)
        kinds = {"base": [None], "lora": names}
        runs = {kind: run(engine, args, ads, kind, profiling=False) for kind, ads in kinds.items()}
        for kind, ads in kinds.items():  # profiles after every timing (the profiler slows the host for good)
            runs[kind] |= run(engine, args, ads, kind, profiling=True)
        for window in ("decode", "mixed"):
            emit(record(args, engine, runs, window), out)


def _no_moe_pdl() -> None:
    """Every MoE LoRA launch config (tuned or default) with ``"pdl": false``: is the base expert GEMM
    slower in LoRA runs because the expands' early programs share its SMs?"""
    lookup = moe_lora_plan.launch_config
    moe_lora_plan.launch_config = lambda kind, *a: {**lookup(kind, *a), "pdl": False}


def record(args, engine: Engine, runs: dict, window: str) -> dict:
    """One window's record: wall and device time per step, base against LoRA, and the kernels' share."""
    (base_wall, base), (lora_wall, lora) = runs["base"][window], runs["lora"][window]
    layers = engine.config.model.num_layers
    extra = {k: round((lora.get(k, 0.0) - base.get(k, 0.0)) / layers, 2) for k in set(base) | set(lora)}
    extra = dict(sorted(((k, v) for k, v in extra.items() if abs(v) >= 0.05), key=lambda kv: -abs(kv[1])))
    row = {"bench": "lora_breakdown", "model": sm.model_key(args.shape, False, args.layers), "window": window,
           "running": args.running, "prefill": args.prefill if window == "mixed" else None,
           "adapters": args.adapters, "max_adapters": args.max_adapters, "resident": args.resident,
           "lora_slots": engine.runner.lora.num_slots, "rank": args.rank,
           "early_shrink": not args.no_early,
           "moe_pdl": not args.no_moe_pdl, "linear": dict(lora_linear.LINEAR),
           "shrink_stack": engine.runner.stack is not None, "moe_stack_entries": engine.config.lora.moe_stack_entries,
           "moe_stacks": engine.runner.moe_stacks is not None}
    if window == "decode":  # the medians of the unprofiled steps
        for kind in ("base", "lora"):  # step time, with the host hidden, the host's share before the graph
            times = runs[kind]["times"]
            row |= {f"{kind}_{name}": times[name] for name in ("step_ms", "hidden_host_ms", "unhidden_steps")}
        for kind in ("base", "lora"):
            for ab in ("pieces", "linear_ab", "stack_ab", "moe_ab", "dense_ab", "skinny_ab"):
                if ab in runs[kind]:
                    row[f"{kind}_{ab}"] = runs[kind][ab]
        for kind in ("base", "lora"):  # host time before the graph's run call, and of that call
            row |= {f"{kind}_{name}": runs[kind]["times"][name]
                    for name in ("pre_graph_ms", "graph_call_ms", "graph_fill_ms")}
    return row | {"base_profiled_ms": round(base_wall * 1e3, 3), "lora_profiled_ms": round(lora_wall * 1e3, 3),
                  "base_device_us": round(sum(base.values()), 1), "lora_device_us": round(sum(lora.values()), 1),
                  "lora_extra_us_per_layer": extra,
                  "lora_kernels_us": {k: round(v, 1) for k, v in sorted(lora.items(), key=lambda kv: -kv[1])}}


if __name__ == "__main__":
    main()
