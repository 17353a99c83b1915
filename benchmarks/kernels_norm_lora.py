"""GPU benchmark of the post-attention norm with the stacked o projection's LoRA expand folded in
(`norm_lora.add_rms_norm_stacked`) against the two launches it replaces, JSON lines.

    python benchmarks/kernels_norm_lora.py [--tokens 1 64 256] [--variants '{"flat": true}' ...] [--out FILE]

Shapes: the o projections of GPT-OSS-20B (rank 32) and Qwen3-30B-A3B (rank 8) as `kernels_lora_linear` sets
them up (bf16, 8 adapters in shuffled pool pages, tokens round-robin with every ninth token without one; a
stack entry per slot).  The projection's GEMM is not timed: each of ``LAYERS`` layers has its own residual
stream, projection output and h (the GEMM's, made once), and a CUDA graph runs them all, L2 flushed before each
replay (the adapters' B rows, shared by the layers, come from L2 after the first).  Per row, a layer's time:
``two_us``, `lora_expand_stacked` then `add_rms_norm` (the engine before the fold); ``fused_us`` per variant of
`norm_lora.LAUNCH` (``{}``: as set); ``norm_us``, `add_rms_norm` alone (the base model's launch).  The LoRA's
cost is each less ``norm_us``; ``floor_us``: the fused kernel's bytes (residual and projection in, sum and
norm out, h and the adapters' B) over the read bandwidth; ``max_rel_diff`` of each variant against the two
launches.
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
import kernels_lora_linear as kll
from timing import emit, read_bandwidth, time_graph
from unipage.kernels import norm_lora
from unipage.kernels.elementwise import add_rms_norm
from unipage.kernels.lora_stack import fill_entry, lora_expand_stacked
from unipage.kernels.norm_lora import add_rms_norm_stacked
from unipage.models.shrink_stack import rank_block

SHAPES = ("qwen3-30b-a3b o", "gpt-oss-20b o")
EPS = 1e-6


def setup(name: str, tokens: int, layers: int = kll.LAYERS, device: str = "cuda", dtype=torch.bfloat16) -> dict:
    """`kernels_lora_linear.setup`'s shape, and per layer the residual stream, the stacked GEMM's output and the
    norm's weight."""
    s = kll.setup(name, tokens, layers, device, dtype)
    meta, block = s["meta"], rank_block(s["rank"])
    n, width = meta.out_cols, meta.num_slices * block
    ext = torch.zeros(n + kll.ADAPTERS * width, meta.d_in, dtype=s["x"].dtype, device=s["x"].device)
    for slot in range(kll.ADAPTERS):
        fill_entry(ext[n + slot * width:n + (slot + 1) * width], s["pool"], s["table"], meta, slot)
    layers = []
    for w in s["w"]:
        ext[:n] = w
        out = F.linear(s["x"], ext)
        layers.append((torch.randn_like(out[:, :n]), out, 1 + 0.1 * torch.randn_like(out[0, :n])))
    entries = torch.arange(meta.num_slots, dtype=torch.int32, device=s["x"].device)
    present = len(set(s["slots"].tolist()) - {-1})
    size = s["x"].element_size()
    s.update(layers=layers, n=n, block=block, entries=entries,
             bytes=(4 * tokens * n + tokens * width + present * s["rank"] * n) * size)
    return s


def _tail(s: dict) -> tuple:
    return s["entries"], s["pool"], s["table"], s["slots"], s["meta"]


def two(s: dict, layer: tuple, y: torch.Tensor | None = None):
    """The two launches on one layer (the expand in place, into ``y`` if given, else the GEMM's output)."""
    res, out, weight = layer
    y = out[:, :s["n"]] if y is None else y
    lora_expand_stacked(y, out[:, s["n"]:], *_tail(s), rank_block=s["block"])
    return add_rms_norm(res, y, weight, EPS)


def fused(s: dict, layer: tuple):
    res, out, weight = layer
    return add_rms_norm_stacked(res, out[:, :s["n"]], out[:, s["n"]:], weight, EPS, *_tail(s), rank_block=s["block"])


def max_rel_diff(s: dict) -> float:
    """The fused result's largest difference from the two launches' (on a copy), over the largest value."""
    layer = s["layers"][0]
    want = two(s, layer, layer[1][:, :s["n"]].clone())[1].float()
    got = fused(s, layer)[1].float()
    return ((got - want).abs().max() / want.abs().max()).item()


def per_layer_us(s: dict, step) -> float:
    return time_graph(lambda: [step(s, layer) for layer in s["layers"]]) / len(s["layers"]) * 1e6


def row(name: str, tokens: int, variants: list[dict], bandwidth: float) -> dict:
    s = setup(name, tokens)
    before = dict(norm_lora.LAUNCH)
    out = {"bench": "norm_lora", "shape": name, "tokens": tokens, "adapters": kll.ADAPTERS, "rank": s["rank"],
           "norm_us": round(per_layer_us(s, lambda s, layer: add_rms_norm(layer[0], layer[1][:, :s["n"]], layer[2],
                                                                          EPS)), 2),
           "two_us": round(per_layer_us(s, two), 2), "floor_us": round(s["bytes"] / bandwidth * 1e6, 2),
           "read_gbps": round(bandwidth / 1e9, 1), "fused": [], "commit": os.environ.get("UNIPAGE_COMMIT")}
    for variant in variants:
        try:
            norm_lora.LAUNCH.update(variant)
            out["fused"].append({"launch": dict(norm_lora.LAUNCH), "us": round(per_layer_us(s, fused), 2),
                                 "max_rel_diff": round(max_rel_diff(s), 5)})
        finally:
            norm_lora.LAUNCH.clear()
            norm_lora.LAUNCH.update(before)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 64, 256])
    p.add_argument("--variants", nargs="*", type=json.loads, default=[],
                   help="JSON objects of norm_lora.LAUNCH settings, each timed besides the settings as they are")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernels_norm_lora.py needs a CUDA device")
    bandwidth = read_bandwidth()
    with open(args.out, "a") if args.out else open(os.devnull, "w") as f:
        for name, tokens in itertools.product(args.shapes, args.tokens):
            emit(row(name, tokens, [{}] + args.variants, bandwidth), f if args.out else None)


if __name__ == "__main__":
    main()
