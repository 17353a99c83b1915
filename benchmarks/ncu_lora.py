"""Eager launches of the dense LoRA kernels for Nsight Compute: every call of a Llama-3.1-8B layer.

    ncu --clock-control none --cache-control all -k regex:"_shrink_kernel|_expand_kernel|_expand_silu_kernel" \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__registers_per_thread,\\
launch__block_size,launch__shared_mem_per_block,sm__warps_active.avg.pct_of_peak_sustained_active \\
        --csv --page raw python benchmarks/ncu_lora.py 16 256 > ncu.csv

For each target group of `kernels_lora.py` (q/k/v, o, gate/up, down) and each token count given (default
256), four calls as that benchmark sets them up (16 adapters of rank 16, tokens round-robin); gate/up goes
through `lora_shrink` + `lora_silu_mul`, as the model runs it.  Under ncu every kernel runs alone with
flushed caches: the times have no PDL overlap (`benchmarks/results/lora-ncu-h100.jsonl`).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from kernels_lora import GROUPS, Setup

from unipage.kernels.lora import lora_shrink, lora_shrink_expand
from unipage.kernels.lora_meta import plan_lora_batch
from unipage.kernels.lora_silu import lora_silu_mul

CALLS = 4


def main(argv=None) -> None:
    tokens = [int(t) for t in (sys.argv[1:] if argv is None else argv)] or [256]
    for name, targets in GROUPS.items():
        setup = Setup(targets=targets)
        for count in tokens:
            slots, x, y = setup.inputs(count)
            batch = plan_lora_batch(slots, setup.adapters)
            for _ in range(CALLS):
                if name == "gate_up":
                    shrunk = lora_shrink(x, setup.pool, setup.table, slots, setup.meta, batch=batch)
                    lora_silu_mul(y.clone(), shrunk)
                else:
                    lora_shrink_expand(y, x, setup.pool, setup.table, slots, setup.meta, batch=batch)
            torch.cuda.synchronize()
            print(name, count, "block_m", batch.block_m, flush=True)


if __name__ == "__main__":
    main()
