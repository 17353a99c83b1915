"""Does MoE LoRA work hide behind the base expert GEMMs when it runs on a second stream? (JSON lines)

    python benchmarks/moe_lora_overlap.py [--tokens 256] [--layers 4] [--out FILE]

A Qwen3-30B-A3B MoE layer (H 2048, I 768, 128 experts, top-8), 16 adapters of rank 8 on
gate/up and down, tokens round-robin over them (the serving benchmark's setup b at
decode).  ``--layers`` layers with their own weights are captured in one CUDA graph and
timed as replays (L2 flushed before each); per layer:

- ``base_us``: `fused_experts` without LoRA; ``serial_us``: with LoRA as the engine runs it.
- ``shrink_side_us``: the LoRA shrink on a second stream beside the base gate/up GEMM, the
  rest in line (the down expand reads the gate/up expand's results, so the order holds).
- ``both_side_us``: also the down expand on the second stream beside the base down GEMM,
  into its own output rows (timing only: a real path must add them in the final sum).
Each ``*_side`` variant runs with the side stream at high and at default priority, and
with the LoRA config's PDL on and off (``pdl``: the gate/up expand reads the base GEMM's
output before its wait, so with PDL the side variants race: timing only).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys

import torch

import kernels_moe as km
from timing import emit, time_graph
from unipage.kernels import fused_moe_lora as fml
from unipage.kernels.fused_moe import base_config, fused_experts, moe_down, moe_gate_up
from unipage.kernels.fused_moe_lora import lora_config, moe_lora_down, moe_lora_gate_up, plan_moe_lora
from unipage.kernels.moe_align import moe_align

SHAPE = "qwen3-30b-a3b"


def _layer_weights(s: dict, layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    h, i, e = s["hidden"], s["inter"], s["experts"]
    return [(torch.randn(e, 2 * i, h, device="cuda", dtype=km.DTYPE) / h ** 0.5,
             torch.randn(e, h, i, device="cuda", dtype=km.DTYPE) / i ** 0.5) for _ in range(layers)]


def _side_layer(b: dict, w_gu, w_d, cfg_lora: dict, side: torch.cuda.Stream, down_side: bool) -> torch.Tensor:
    x, ids, weights, lora = b["x"], b["topk_ids"], b["topk_weights"], b["lora"]
    tokens, top_k = ids.shape
    e, inter, hidden = w_gu.shape[0], w_d.shape[2], w_d.shape[1]
    cfg = base_config(e, hidden, inter, ids, None)
    align = moe_align(ids, e, cfg["block_m"])
    plan = plan_moe_lora(lora, ids, cfg_lora)
    act = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    raw = torch.empty(tokens * top_k, 2 * inter, dtype=x.dtype, device=x.device)
    y = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    y_lora = torch.empty_like(y)
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        fml.moe_lora_shrink(plan, x)
    moe_gate_up(x, w_gu, ids, align, act, raw, lora.token_slots, lora.meta.slot_flags, cfg)
    main.wait_stream(side)
    shrink, fml.moe_lora_shrink = fml.moe_lora_shrink, lambda plan, x: None
    try:
        moe_lora_gate_up(plan, x, raw, act)  # the expand alone: its shrink ran on the side stream
    finally:
        fml.moe_lora_shrink = shrink
    if down_side:
        side.wait_stream(main)
        with torch.cuda.stream(side):
            moe_lora_down(plan, act, y_lora, weights)
        moe_down(act, w_d, ids, weights, align, y, cfg)
        main.wait_stream(side)
    else:
        moe_down(act, w_d, ids, weights, align, y, cfg)
        moe_lora_down(plan, act, y, weights)
    return y.view(tokens, top_k, hidden).sum(dim=1)


def run(tokens: int, layers: int) -> dict:
    km.configure(16, 8)
    s = km.setup(SHAPE)
    b = km.batch(s, tokens)
    ws = _layer_weights(s, layers)
    cfg_lora = lora_config(b["lora"], b["topk_ids"])
    row = {"bench": "moe_lora_overlap", "shape": SHAPE, "adapters": 16, "rank": 8,
           "tokens": tokens, "layers": layers, "lora_config": cfg_lora}

    def each(fn):
        return lambda: [fn(w_gu, w_d) for w_gu, w_d in ws]

    def per_layer(fn) -> float:
        return round(time_graph(each(fn), iters=40) / layers * 1e6, 2)

    row["base_us"] = per_layer(lambda g, d: fused_experts(b["x"], g, d, b["topk_weights"], b["topk_ids"]))
    row["serial_us"] = per_layer(lambda g, d: fused_experts(b["x"], g, d, b["topk_weights"], b["topk_ids"],
                                                            b["lora"]))
    for pdl in (True, False):
        cfg = copy.deepcopy(cfg_lora)
        cfg["pdl"] = pdl
        for priority in (-1, 0):
            side = torch.cuda.Stream(priority=priority)
            for down_side in (False, True):
                name = f"{'both' if down_side else 'shrink'}_side_p{priority}_pdl{int(pdl)}_us"
                row[name] = per_layer(lambda g, d: _side_layer(b, g, d, cfg, side, down_side))
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[256])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    with open(args.out, "a") if args.out else contextlib.nullcontext() as out:
        for tokens in args.tokens:
            emit(run(tokens, args.layers), out)


if __name__ == "__main__":
    sys.exit(main())
