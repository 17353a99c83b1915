"""CPU benchmark of the LoRA tables' upkeep: one adapter load with N adapters resident, one JSON line per row.

    python benchmarks/lora_tables.py [--resident 5 50 500 5000] [--models llama-1b qwen3-30b-a3b] [--out FILE]

Row ``assign_refresh``: N adapters resident in slots 0..N-1 (ranks 4, 8 and 16 in turn), then,
``reps`` times, `LoraTables.assign` of one more adapter in slot N and `refresh` (timed: what an
engine step pays for a load), then its `release` and `refresh` (timed apart: an eviction).  N is
capped by ``--max-slots``.  The timed adapter shares its layout object with resident ones (as
`cached_layout` makes adapters of one shape do), or with ``--fresh-layouts`` has a new one.
Model shapes: Llama-3.2-1B (16 layers) with LoRA on every target or on attention only (serve
setup c), Qwen3-30B-A3B (48 layers, 128 experts) with attention and expert LoRA.  A row stops
repeating after ``--budget-s`` seconds (at least 3 repetitions), so the per-load cost of a full
rebuild over thousands of slots stays measurable.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time

import torch

try:
    from benchmarks.cpu import commit
except ImportError:  # run as a script: benchmarks/ itself is on sys.path
    from cpu import commit
from unipage.config import ModelConfig
from unipage.lora_layout import TargetSpec, build_layout
from unipage.models.lora_tables import LoraTables

SEED = 0
BLOCK_TOKENS = 16
RANKS = (4, 8, 16)
MODELS = {  # key -> (model, LoRA targets)
    "llama-1b": (ModelConfig(num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8, head_dim=64,
                             intermediate_size=8192), "all"),
    "llama-1b-attention": (ModelConfig(num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8, head_dim=64,
                                       intermediate_size=8192), "attention"),
    "qwen3-30b-a3b": (ModelConfig(num_layers=48, hidden_size=2048, num_heads=32, num_kv_heads=4, head_dim=128,
                                  intermediate_size=6144, num_experts=128, top_k=8, expert_intermediate_size=768),
                      "all"),
}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def emit(record: dict, out) -> None:
    record = {"bench": "lora_tables", "device": platform.processor() or platform.machine(),
              "python": sys.version.split()[0], "torch": torch.__version__, "seed": SEED,
              "unix_time": round(time.time(), 3), "commit": commit(), "cpus": os.cpu_count(), **record}
    print(json.dumps(record), file=out, flush=True)


def layouts(model: ModelConfig, targets: str) -> list:
    """One layout per rank in RANKS (adapters of one shape share a layout, as `cached_layout` makes them)."""
    def layer(index: int, rank: int) -> tuple:
        names = [t for t in model.targets(index) if targets == "all" or t in ATTENTION]
        return tuple(TargetSpec(t, (rank,)) for t in names)

    return [build_layout(model, [layer(i, r) for i in range(model.num_layers)]) for r in RANKS]


def bench(key: str, resident: int, reps: int, budget_s: float, fresh: bool) -> dict:
    model, targets = MODELS[key]
    shapes = layouts(model, targets)
    page_elems = BLOCK_TOKENS * 2 * model.num_kv_heads * model.head_dim
    pages = [list(range(i * 64, i * 64 + s.num_pages(page_elems))) for i, s in enumerate(shapes)]
    tables = LoraTables(model, torch.device("cpu"))
    start = time.perf_counter()
    for slot in range(resident):
        tables.assign(slot, pages[slot % 3], shapes[slot % 3])
    tables.refresh()
    fill_s = time.perf_counter() - start
    loads, evictions = [], []
    deadline = time.perf_counter() + budget_s
    for rep in range(reps):
        layout = layouts(model, targets)[rep % 3] if fresh else shapes[rep % 3]  # fresh: a layout never seen
        start = time.perf_counter()
        tables.assign(resident, pages[rep % 3], layout)
        tables.refresh()
        mid = time.perf_counter()
        tables.release(resident)
        tables.refresh()
        loads.append(mid - start)
        evictions.append(time.perf_counter() - mid)
        if rep >= 2 and time.perf_counter() > deadline:
            break
    ms = [t * 1e3 for t in loads]
    return {"row": "assign_refresh", "model": key, "layers": model.num_layers, "targets": targets,
            "experts": model.num_experts, "layouts": "fresh" if fresh else "shared", "resident": resident, "slots": tables.num_slots, "reps": len(loads),
            "assign_refresh_ms_median": round(statistics.median(ms), 4),
            "assign_refresh_ms_max": round(max(ms), 4),
            "release_refresh_ms_median": round(statistics.median(evictions) * 1e3, 4),
            "fill_s": round(fill_s, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--resident", type=int, nargs="+", default=[5, 50, 500, 5000])
    p.add_argument("--models", nargs="+", default=sorted(MODELS), choices=sorted(MODELS))
    p.add_argument("--max-slots", type=int, default=8192, help="cap on N (the slot capacity)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--budget-s", type=float, default=10.0, help="time per row after which repetitions stop")
    p.add_argument("--fresh-layouts", action="store_true",
                   help="the timed adapter's layout is a new object each time (no layout shared with resident ones)")
    p.add_argument("--label", default="", help="free text in every record (e.g. before / after)")
    p.add_argument("--out", default=None, help="append the JSON lines to this file (default: stdout)")
    args = p.parse_args()
    with open(args.out, "a") if args.out else contextlib.nullcontext(sys.stdout) as out:
        for key in args.models:
            for resident in sorted({min(n, args.max_slots - 1) for n in args.resident}):
                emit({**bench(key, resident, args.reps, args.budget_s, args.fresh_layouts), "label": args.label}, out)


if __name__ == "__main__":
    main()
