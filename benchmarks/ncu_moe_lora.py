"""Eager launches of the paged MoE LoRA kernels for Nsight Compute: one Qwen3-30B-A3B layer's LoRA pass.

    ncu --clock-control none --cache-control all \\
        -k regex:"_moe_shrink_kernel|_expand_gate_up_kernel|_expand_down_kernel|_down_sum_kernel" \\
        --launch-skip 3 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --csv --page details python benchmarks/ncu_moe_lora.py --adapters 4 --rank 8 --tokens 256 > ncu.csv

The inputs are `kernels_moe.py`'s (adapters of the fused gate/up format in scattered pool pages, random
routing); ``--slot-order sorted`` puts the tokens' adapters in runs, as setup (b)'s affinity policy does.
``--calls`` LoRA passes (`kernels_moe.lora_step`, with the tuned launch config), the first of them to be
skipped by ncu (compilation and first-touch).  Under ncu every kernel runs alone with flushed caches: no
PDL overlap, and the metadata and page-table reads come from DRAM, as for a layer's first touch in a step.

    python benchmarks/ncu_moe_lora.py --parse ncu.csv --device-name "NVIDIA H200" --adapters 4 >> rows.jsonl

turns that CSV into one JSON line per kernel (`benchmarks/results/lora-ncu-moe-h200.jsonl`).

``--moe`` runs `fused_moe` end to end instead, ``--calls`` times without LoRA, then as many with it (the tuned
config, ``--active-slots`` its bound): with ``-k regex:_moe_gemm_kernel`` that compares the base GEMMs with
those that carry the LoRA steps (the fused path, setup (b)'s mixed steps: ``--tokens 4096 --adapters 5
--slot-order mixed --active-slots 16``; ``--launch-skip 2 --launch-count 6`` with ``--calls 2``: the second
base call, then both LoRA calls, the gate/up GEMM then the down GEMM of each; ``--parse`` does not label them).
Raw metrics asked for with ``--metrics`` (names with ``__``) are kept under their own names, their unit (if
any) beside them (``"<name> unit"``: ncu picks it by the value unless ``--print-units base``).
"""

import argparse
import csv
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernels_moe as km  # noqa: E402
import torch  # noqa: E402

from unipage.kernels.fused_moe import fused_moe  # noqa: E402
from unipage.kernels.fused_moe_lora import lora_config  # noqa: E402


METRICS = {  # ncu's metric name -> the row's field (Duration: in `TIME_UNITS`)
    "Duration": ("us", None), "Grid Size": ("grid", 1), "Block Size": ("threads", 1),
    "Registers Per Thread": ("registers", 1), "Theoretical Occupancy": ("occupancy_pct", 1),
    "Achieved Occupancy": ("achieved_occupancy_pct", 1), "DRAM Throughput": ("dram_pct", 1),
    "Waves Per SM": ("waves", 1), "L2 Hit Rate": ("l2_hit_pct", 1),
    "Warp Cycles Per Issued Instruction": ("cycles_per_issue", 1),
}
TIME_UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}  # -> us


def _number(value: str):
    """ncu's value as a number (thousands separators dropped), or the text as it is ("n/a")."""
    try:
        return round(float(value.replace(",", "")), 4)
    except ValueError:
        return value


def parse(path: str) -> list[dict]:
    """One dict per kernel launch profiled in an ncu ``--csv --page details`` file: the `METRICS`."""
    rows: dict[str, dict] = {}
    with open(path, newline="") as f:
        for record in csv.DictReader(line for line in f if line.startswith('"')):
            name, value = record.get("Metric Name"), record.get("Metric Value")
            if value and "__" in (name or ""):  # a raw metric asked for by name, with its unit if it has one
                row = rows.setdefault(record["ID"], {"kernel": record["Kernel Name"]})
                row[name] = _number(value)
                if record.get("Metric Unit"):
                    row[f"{name} unit"] = record["Metric Unit"]
            if name in METRICS and value:
                field, factor = METRICS[name]
                if factor is None:  # ncu picks the unit by the value unless --print-units base
                    unit = record.get("Metric Unit", "")
                    if unit not in TIME_UNITS:
                        raise ValueError(f"{path}: {name} in unknown unit {unit!r}")
                    factor = TIME_UNITS[unit]
                row = rows.setdefault(record["ID"], {"kernel": record["Kernel Name"]})
                number = float(value.replace(",", "")) * factor
                row[field] = int(number) if number.is_integer() else round(number, 3)
    return list(rows.values())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--slot-order", default="sorted", choices=km.SLOT_ORDERS)
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--moe", action="store_true", help="fused_moe end to end, without LoRA then with it")
    p.add_argument("--active-slots", type=int, default=None, help="the MoeLora's bound on the step's adapters")
    p.add_argument("--parse", metavar="CSV", help="print the rows of an ncu CSV of this script instead")
    p.add_argument("--device-name", default="", help="--parse: the GPU the CSV was made on")
    args = p.parse_args(argv)
    if args.active_slots is not None and args.active_slots < args.adapters:
        p.error(f"--active-slots must be >= --adapters ({args.adapters}), got {args.active_slots}")
    if args.parse:
        for row in parse(args.parse):
            print(json.dumps({"device": args.device_name, "bench": "lora_ncu_moe", "model": "qwen3-30b-a3b",
                              "adapters": args.adapters, "rank": args.rank, "tokens": args.tokens,
                              "slot_order": args.slot_order, "active_slots": args.active_slots, **row}))
        return
    km.configure(args.adapters, args.rank, args.slot_order, args.active_slots)
    s = km.setup("qwen3-30b-a3b")
    b = km.batch(s, args.tokens)
    if args.moe:
        moe = (b["x"], b["logits"], s["w_gate_up"], s["w_down"], s["top_k"], True)
        for lora in [None] * args.calls + [b["lora"]] * args.calls:
            fused_moe(*moe, lora=lora)
    else:
        for _ in range(args.calls):
            km.lora_step(s, b)
    torch.cuda.synchronize()
    print("config", lora_config(b["lora"], b["topk_ids"]), flush=True)


if __name__ == "__main__":
    main()
