"""GPU benchmark of the fused decode projection (`lora_linear.linear_lora`) and of the shrink stack's path
(`shrink_stack`: one GEMM over W and the A rows, then `lora_stack.lora_expand_stacked`) against the separate
launches (``x @ W.T`` with its bias, `lora.lora_shrink_expand`), JSON lines.

    python benchmarks/kernels_lora_linear.py [--tokens 1 16] [--out FILE]
    python benchmarks/kernels_lora_linear.py --tune [--best FILE]   # sweep the launch settings
    python benchmarks/kernels_lora_linear.py --projection [--tokens 1 16 64 256 2048]   # the bias, no LoRA

Shapes: the attention projections (qkv with its bias, o) of GPT-OSS-20B (rank 32) and Qwen3-30B-A3B
(rank 8), bf16, 8 adapters in shuffled pool pages, tokens round-robin over the adapters with every
ninth token without one.  Each timing is a CUDA graph of ``LAYERS`` such projections with weights of
their own (so W comes from HBM, as in a decode step), L2 flushed before each replay, per projection.
Per row: ``fused_us``, ``stacked_us`` and ``separate_us`` (``*max_rel_diff``: each against the separate
path); ``floor_us``: the bytes a projection must read (W, the bias,
x, the LoRA weights of the adapters present) over the read bandwidth measured in the run.  ``--tune``
times every setting of `SWEEP` on every shape and writes the best over them all to ``--best`` as JSON.
``--projection`` times the base projection alone at the shapes with a bias, three ways (rows
``projection_bias``): ``x @ W.T`` then the bias add (two launches), ``F.linear`` (the bias in cuBLAS's
epilogue, what the engine runs) and ``x @ W.T`` without the bias.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import emit, read_bandwidth, time_graph
from unipage.adapter_pack import pack_adapter, random_lora_weights
from unipage.config import ModelConfig
from unipage.kernels import lora_linear
from unipage.kernels.lora_linear import LINEAR, fused_linear, linear_lora
from unipage.kernels.lora_meta import dense_lora_meta, plan_lora_batch
from unipage.kernels.lora_stack import fill_entry, lora_expand_stacked
from unipage.lora_layout import TargetSpec, build_layout
from unipage.models.shrink_stack import rank_block

LAYERS = 24
ADAPTERS = 8
PAGE = 4096
QKV = ("q_proj", "k_proj", "v_proj")
# name: (hidden, heads, kv heads, head dim), targets, rank, bias
SHAPES = {"gpt-oss-20b qkv": ((2880, 64, 8, 64), QKV, 32, True),
          "gpt-oss-20b o": ((2880, 64, 8, 64), ("o_proj",), 32, True),
          "qwen3-30b-a3b qkv": ((2048, 32, 4, 128), QKV, 8, False),
          "qwen3-30b-a3b o": ((2048, 32, 4, 128), ("o_proj",), 8, False)}
SWEEP = {"block_n": (16, 32, 64), "block_k": (128, 256), "num_warps": (4, 8), "stacked": (True, False)}


def setup(name: str, tokens: int, layers: int = LAYERS, device: str = "cuda", dtype=torch.bfloat16) -> dict:
    """One shape's projections (``layers`` weights of their own), pool, adapters and ``tokens`` tokens."""
    (hidden, heads, kv_heads, head_dim), targets, rank, bias = SHAPES[name]
    model = ModelConfig(num_layers=1, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                        intermediate_size=hidden)
    gen = torch.Generator().manual_seed(0)
    layout = build_layout(model, [tuple(TargetSpec(t, (rank,)) for t in targets)])
    n = layout.num_pages(PAGE)
    pool = torch.randn(ADAPTERS * n + 64, PAGE, generator=gen).to(dtype)
    ids = torch.randperm(pool.shape[0], generator=gen)[: ADAPTERS * n].view(ADAPTERS, n)
    for slot in range(ADAPTERS):
        pool[ids[slot]] = pack_adapter(layout, random_lora_weights(layout, gen, std=0.02), PAGE, dtype)[0]
    meta = dense_lora_meta([layout] * ADAPTERS, 0, targets, device=device, model=model)
    slots = torch.arange(tokens, dtype=torch.int32) % ADAPTERS
    slots[8::9] = -1
    random = lambda *shape: torch.randn(*shape, generator=gen).to(dtype).to(device)  # noqa: E731
    present = len(set(slots.tolist()) - {-1})
    lora_bytes = present * rank * (meta.d_in * len(targets) + meta.out_cols) * pool.element_size()
    return {"meta": meta, "pool": pool.to(device), "table": ids.to(torch.int32).to(device), "slots": slots.to(device),
            "w": [random(meta.out_cols, meta.d_in) * 0.02 for _ in range(layers)],
            "bias": random(meta.out_cols) if bias else None, "x": random(tokens, meta.d_in), "rank": rank,
            "bytes": (meta.out_cols * meta.d_in + meta.out_cols + tokens * meta.d_in) * pool.element_size()
            + lora_bytes}


def fused(s: dict, config: dict | None = None):
    """The fused kernel (on whatever `LINEAR` says: ``max_tokens`` is set to cover the batch)."""
    config = on(s, config)
    batch = plan_lora_batch(s["slots"], s["meta"].num_slots)

    def run():
        for w in s["w"]:
            linear_lora(s["x"], w, s["bias"], s["pool"], s["table"], s["slots"], s["meta"], batch=batch,
                        config=config, early=True)
    return run


def on(s: dict, config: dict | None) -> dict:
    """``config`` with ``max_tokens`` covering the batch, checked to take the fused kernel."""
    config = {**(config or {}), "max_tokens": max(16, len(s["slots"]))}
    if not fused_linear(len(s["slots"]), s["meta"], config):
        raise SystemExit(f"the fused kernel does not take this batch ({len(s['slots'])} tokens)")
    return config


def separate(s: dict):
    """The separate launches: `linear_lora` with the kernel off (the engine's default path)."""
    batch = plan_lora_batch(s["slots"], s["meta"].num_slots)

    def run():
        for w in s["w"]:
            linear_lora(s["x"], w, s["bias"], s["pool"], s["table"], s["slots"], s["meta"], batch=batch,
                        config={"max_tokens": 0}, early=True)
    return run


def stacked(s: dict):
    """The shrink stack's path (`unipage.models.shrink_stack`): one GEMM over W and every adapter's A rows,
    then `lora_expand_stacked` from its h (adapter slot s in entry s)."""
    meta, block = s["meta"], rank_block(s["rank"])
    n, width = meta.out_cols, meta.num_slices * block
    exts = []
    for w in s["w"]:
        ext = torch.zeros(n + ADAPTERS * width, meta.d_in, dtype=w.dtype, device=w.device)
        ext[:n] = w
        for slot in range(ADAPTERS):
            fill_entry(ext[n + slot * width:n + (slot + 1) * width], s["pool"], s["table"], meta, slot)
        exts.append(ext)
    bias = None if s["bias"] is None else torch.cat([s["bias"], s["bias"].new_zeros(ADAPTERS * width)])
    entries = torch.arange(meta.num_slots, dtype=torch.int32, device=s["x"].device)
    batch = plan_lora_batch(s["slots"], meta.num_slots)

    def one(ext):
        out = F.linear(s["x"], ext, bias)
        return lora_expand_stacked(out[:, :n], out[:, n:], entries, s["pool"], s["table"], s["slots"], meta,
                                   rank_block=block, batch=batch)

    def run():
        for ext in exts:
            one(ext)
    run.first = lambda: one(exts[0])  # the first layer's result, for `check`
    return run


def check(s: dict, config: dict | None = None, other=None) -> float:
    """Largest difference of the fused result (or ``other()``'s) from the separate one, over the largest value."""
    args = (s["x"], s["w"][0], s["bias"], s["pool"], s["table"], s["slots"], s["meta"])
    want = linear_lora(*args, config={"max_tokens": 0})
    got = other() if other is not None else linear_lora(*args, config=on(s, config))
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def per_layer_us(fn) -> float:
    return time_graph(fn) / LAYERS * 1e6


def tune(args, out) -> None:
    """Every `SWEEP` setting on every shape; the best is the least time summed over the shapes (`LINEAR` is
    one setting for all projections)."""
    shapes = {name: setup(name, max(args.tokens)) for name in args.shapes}
    results = []
    for values in itertools.product(*SWEEP.values()):
        config = dict(zip(SWEEP, values))
        try:
            times = {name: round(per_layer_us(fused(s, config)), 2) for name, s in shapes.items()}
        except Exception as exc:  # noqa: BLE001 (out of resources: that setting is skipped, and said so)
            print(f"{config}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
            continue
        results.append((sum(times.values()), times, config))
    results.sort(key=lambda r: r[0])
    separate_us = {name: round(per_layer_us(separate(s)), 2) for name, s in shapes.items()}
    emit({"bench": "lora_linear_tune", "tokens": max(args.tokens), "best": results[0][2], "best_us": results[0][1],
          "separate_us": separate_us, "top5": [[t, c] for _, t, c in results[:5]]}, out)
    if args.best:
        with open(args.best, "w") as f:
            json.dump(results[0][2], f)


def bench(args, out) -> None:
    bandwidth = read_bandwidth()
    for name, tokens in itertools.product(args.shapes, args.tokens):
        s = setup(name, tokens)
        floor = s["bytes"] / bandwidth * 1e6
        takes = tokens <= lora_linear.MAX_TOKENS  # the fused kernel's limit
        fused_us = per_layer_us(fused(s)) if takes else None
        separate_us, stack = per_layer_us(separate(s)), stacked(s)
        emit({"bench": "lora_linear", "shape": name, "tokens": tokens, "adapters": ADAPTERS, "rank": s["rank"],
              "fused_us": fused_us and round(fused_us, 2), "separate_us": round(separate_us, 2),
              "stacked_us": round(per_layer_us(stack), 2), "floor_us": round(floor, 2),
              "fused_over_floor": fused_us and round(fused_us / floor, 2), "read_gbps": round(bandwidth / 1e9, 1),
              "max_rel_diff": round(check(s), 5) if takes else None,
              "stacked_max_rel_diff": round(check(s, other=stack.first), 5),
              "config": on(s, dict(LINEAR)) if takes else dict(LINEAR)}, out)


def projection(args, out) -> None:
    """The ``--projection`` rows: per shape with a bias and token count, the three ways of the docstring."""
    for name, tokens in itertools.product([n for n in args.shapes if SHAPES[n][3]], args.tokens):
        s = setup(name, tokens)
        x, b = s["x"], s["bias"]
        ways = {"matmul_add_us": lambda: [x @ w.T + b for w in s["w"]],
                "linear_us": lambda: [F.linear(x, w, b) for w in s["w"]],
                "matmul_only_us": lambda: [x @ w.T for w in s["w"]]}
        emit({"bench": "projection_bias", "shape": name, "tokens": tokens,
              **{key: round(per_layer_us(run), 2) for key, run in ways.items()}}, out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 16])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--tune", action="store_true", help="sweep the launch settings instead")
    mode.add_argument("--projection", action="store_true",
                      help="time the projections with a bias three ways instead (no LoRA)")
    p.add_argument("--best", default=None, help="--tune: write the best setting here (JSON)")
    p.add_argument("--config", default=None, help="JSON merged into lora_linear.LINEAR first")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernels_lora_linear.py needs a CUDA device")
    LINEAR.update(json.loads(args.config or "{}"))
    with open(args.out, "a") if args.out else open(os.devnull, "w") as f:
        out = f if args.out else sys.stdout
        (tune if args.tune else projection if args.projection else bench)(args, out)


if __name__ == "__main__":
    main()
