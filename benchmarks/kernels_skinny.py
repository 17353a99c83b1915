"""GPU benchmark of the skinny linear (`kernels.skinny`) against ``F.linear`` (cuBLAS), JSON lines.

    python benchmarks/kernels_skinny.py [--tokens 1 16 64] [--config JSON] [--out FILE]
    python benchmarks/kernels_skinny.py --tune [--tokens 16] [--save] [--out FILE]   # sweep the settings

Shapes: GPT-OSS-20B's decode projections, bf16 (with its bias where the model has one): qkv and o with
the shrink stack of 8 adapters of rank 32 under W (what setup (a)'s LoRA steps run), without it (the
base model's), and the router.  Each timing is a CUDA graph of ``LAYERS`` projections with weights of
their own (W comes from HBM, as in a decode step), L2 flushed before each replay, per projection.
Rows ``skinny``: ``linear_us`` (F.linear), ``skinny_us`` (the kernel with the shape's tuned entry for
this GPU, else `SKINNY`, updated by ``--config``), ``floor_us`` (W, the bias and x over the read bandwidth measured in the run) and
``max_rel_diff`` (the kernel against F.linear, over the largest value).  ``--tune`` times every
setting of `SWEEP` per shape and ``--tokens`` count: rows ``skinny_tune`` with the best setting and the
five fastest; with ``--save`` it writes a shape's entry into ``configs/skinny.json`` for this GPU up to
the largest count to which the kernel beat ``F.linear`` by `MARGIN` at every count timed (`save`), and
drops it where the kernel lost at the smallest, so that `skinny.linear` keeps cuBLAS there.
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
from unipage.kernels import skinny as sk
from unipage.kernels.common import device_key, record_tuned_device
from unipage.kernels.skinny import SKINNY, skinny_linear

LAYERS = 24
MARGIN = 0.03  # --save: an entry only where the kernel beat F.linear by this fraction
# name: (N, K, bias)
SHAPES = {"gpt-oss-20b qkv+stack": (5120 + 8 * 3 * 32, 2880, True), "gpt-oss-20b o+stack": (2880 + 8 * 32, 4096, True),
          "gpt-oss-20b qkv": (5120, 2880, True), "gpt-oss-20b o": (2880, 4096, True),
          "gpt-oss-20b router": (32, 2880, True)}
# the plain kernel, then the swapped one (w's tile the dot's tall operand: block_n >= 64)
SWEEP = ({"swap": (False,), "block_n": (16, 32, 64), "block_k": (128, 256, 512), "split_k": (1, 2, 4, 8),
          "num_stages": (3, 5)},
         {"swap": (True,), "block_n": (64, 128), "block_k": (128, 256), "split_k": (1, 2, 4), "num_stages": (3, 5),
          "num_warps": (4, 8)})


def settings() -> list[dict]:
    """Every setting of every grid of `SWEEP`."""
    return [dict(zip(grid, values)) for grid in SWEEP for values in itertools.product(*grid.values())]


def setup(name: str, tokens: int) -> dict:
    n, k, bias = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)  # noqa: E731
    return {"x": rand(tokens, k), "w": [rand(n, k) * 0.02 for _ in range(LAYERS)], "b": rand(n) if bias else None,
            "bytes": (n * k + (n if bias else 0) + tokens * k) * 2}


def per_layer_us(fn) -> float:
    return time_graph(fn) / LAYERS * 1e6


def skinny(s: dict, config: dict):
    return lambda: [skinny_linear(s["x"], w, s["b"], config) for w in s["w"]]


def cublas(s: dict):
    return lambda: [F.linear(s["x"], w, s["b"]) for w in s["w"]]


def rel_diff(s: dict, config: dict) -> float:
    want = F.linear(s["x"], s["w"][0], s["b"]).float()
    got = skinny_linear(s["x"], s["w"][0], s["b"], config).float()
    return ((got - want).abs().max() / want.abs().max()).item()


def tune(args, out) -> None:
    for name in args.shapes:
        rows = [row for row in (tune_one(name, tokens) for tokens in sorted(args.tokens)) if row is not None]
        for row in rows:
            emit(row, out)
        if args.save:
            save(rows, device_key("cuda"))
    if args.save:
        record_tuned_device()


def tune_one(name: str, tokens: int) -> dict | None:
    """The ``skinny_tune`` row of one shape at ``tokens`` rows: every `SWEEP` setting timed (None: none ran)."""
    s, results = setup(name, tokens), []
    for setting in settings():
        config = SKINNY | setting
        try:
            results.append((round(per_layer_us(skinny(s, config)), 2), config))
        except Exception as exc:  # noqa: BLE001 (out of resources: that setting is skipped, and said so)
            print(f"{name} {config}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
    if not results:
        print(f"{name} at {tokens} tokens: no setting ran", file=sys.stderr)
        return None
    results.sort(key=lambda r: r[0])
    return {"bench": "skinny_tune", "shape": name, "tokens": tokens, "linear_us": round(per_layer_us(cublas(s)), 2),
            "best_us": results[0][0], "best": results[0][1], "top5": [[t, c] for t, c in results[:5]],
            "max_rel_diff": round(rel_diff(s, results[0][1]), 5)}


def save(rows: list[dict], device: str, path=None) -> None:
    """The entry of one shape for ``device`` in ``configs/skinny.json`` (``path``: that file), from its
    ``skinny_tune`` rows (ascending tokens): the best setting of the largest token count up to which the
    kernel beat F.linear by `MARGIN` at every count timed (``max_tokens``: that count); no entry if it
    lost at the smallest."""
    if not rows:
        return
    won = None
    for row in rows:
        if row["best_us"] > row["linear_us"] * (1 - MARGIN):
            break
        won = row
    path = path or sk.CONFIG_PATH
    data = json.loads(path.read_text())
    n, k, _ = SHAPES[rows[0]["shape"]]
    table, key = data.setdefault("tuned", {}).setdefault(device, {}), sk.shape_key(n, k, torch.bfloat16)
    if won is not None:
        table[key] = {**{name: won["best"][name] for name in SKINNY if name != "max_tokens"},
                      "max_tokens": won["tokens"]}
    else:
        table.pop(key, None)
    path.write_text(json.dumps(data, indent=1) + "\n")
    sk.reload_configs()


def served_config(name: str) -> dict:
    """The setting `skinny.linear` runs for shape ``name`` on this GPU (its tuned entry), else `SKINNY`'s."""
    n, k, _ = SHAPES[name]
    return sk.tuned_config(n, k, torch.bfloat16, torch.device("cuda", torch.cuda.current_device())) or SKINNY


def bench(args, out) -> None:
    bandwidth, overrides = read_bandwidth(), json.loads(args.config or "{}")
    for name, tokens in itertools.product(args.shapes, args.tokens):
        s, config = setup(name, tokens), served_config(name) | overrides
        floor = s["bytes"] / bandwidth * 1e6
        skinny_us = per_layer_us(skinny(s, config))
        emit({"bench": "skinny", "shape": name, "tokens": tokens, "linear_us": round(per_layer_us(cublas(s)), 2),
              "skinny_us": round(skinny_us, 2), "floor_us": round(floor, 2),
              "skinny_over_floor": round(skinny_us / floor, 2), "read_gbps": round(bandwidth / 1e9, 1),
              "max_rel_diff": round(rel_diff(s, config), 5), "config": config}, out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[16])
    p.add_argument("--tune", action="store_true", help="sweep the launch settings instead")
    p.add_argument("--save", action="store_true", help="--tune: write the winners into configs/skinny.json")
    p.add_argument("--config", default=None, help="JSON merged into each shape's setting (not with --tune)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernels_skinny.py needs a CUDA device")
    with open(args.out, "a") if args.out else open(os.devnull, "w") as f:
        (tune if args.tune else bench)(args, f if args.out else sys.stdout)


if __name__ == "__main__":
    main()
