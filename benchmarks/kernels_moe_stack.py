"""Launch settings of the stacked expert LoRA's two shrinks (`fused_moe.moe_project`: x by the stacked gate/up A,
act by the stacked down A; `kernels.moe_lora_stack`), timed alone at a `kernels_moe` mix, over the base alignment
of the tuned base entry's ``block_m`` and of 16.  One JSON line per setting; the best four per shrink and
alignment are printed.  The winners go into the base entry's ``"stack"`` in ``kernels/configs/moe_<device>.json``.

    python benchmarks/kernels_moe_stack.py --tokens 256 --adapters 4 --slot-order sorted --out rows.jsonl
"""

from __future__ import annotations

import argparse
import itertools

import torch

import kernels_moe as km
from timing import emit, time_graph
from unipage.kernels.fused_moe import base_config, moe_project
from unipage.kernels.moe_align import moe_align
from unipage.kernels.moe_lora_stack import build_stack

SPACE = {"block_n": (16, 32, 64), "block_k": (64, 128, 256), "num_warps": (2, 4), "num_stages": (2, 3)}


def sweep(shape: str, tokens: int) -> list[dict]:
    s = km.setup(shape)
    b = km.batch(s, tokens)
    stack = build_stack(b["lora"], km.slot_ids())
    block_m = base_config(s["experts"], s["hidden"], s["inter"], b["topk_ids"], None)["block_m"]
    rows = []
    for bm in sorted({block_m, 16}):
        align = moe_align(b["topk_ids"], s["experts"], bm)
        for name, a, w, a_div in (("gate_up", b["x"], stack.a_gu, s["top_k"]), ("down", b["act"], stack.a_d, 1)):
            out = torch.empty(b["topk_ids"].numel(), w.shape[1], device=km.DEVICE, dtype=km.DTYPE)
            for values in itertools.product(*SPACE.values()):
                cfg = {**dict(zip(SPACE, values)), "group_m": 1, "tma": False}
                if cfg["block_n"] > w.shape[1]:
                    continue
                seconds = time_graph(lambda: moe_project(a, w, b["topk_ids"], align, out, cfg, a_div=a_div), iters=20)
                rows.append({"shrink": name, "block_m": bm, "width": w.shape[1], **cfg, "us": round(seconds * 1e6, 2)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=list(km.SHAPES))
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--slot-order", default="sorted", choices=km.SLOT_ORDERS)
    p.add_argument("--active-slots", type=int, default=None)
    p.add_argument("--out", default=None, help="append JSON lines here (default: stdout)")
    a = p.parse_args()
    km.configure(a.adapters, a.rank, a.slot_order, a.active_slots)
    rows = sweep(a.shape, a.tokens)
    meta = {"bench": "kernels_moe_stack", "shape": a.shape, "tokens": a.tokens, "adapters": a.adapters,
            "rank": a.rank, "slot_order": a.slot_order}
    out = open(a.out, "a") if a.out else None
    for row in rows:
        emit(meta | row, out)
    if out:
        out.close()
    for key in sorted({(r["shrink"], r["block_m"]) for r in rows}):
        best = sorted((r for r in rows if (r["shrink"], r["block_m"]) == key), key=lambda r: r["us"])[:4]
        print(key, [(r["us"], r["block_n"], r["block_k"], r["num_warps"], r["num_stages"]) for r in best])


if __name__ == "__main__":
    main()
