"""The MLP's gate/up LoRA expand fused with ``silu(gate) · up`` (`lora_silu_mul`) on a GPU, against the two
kernels it replaces (`lora_expand` into gate_up, then `silu_mul`): Llama-3.1-8B gate/up (4096 -> 2 x 14336),
rank 16, 16 adapters, bf16, one token in seven without adapter, the shrink included in both.

One JSON line per token count: the fused kernel's time with the shrink (CUDA graph, L2 flushed) and the
two kernels' with it, the kernels `lora_silu_mul` picks there, the HBM floor of the fused pass (LoRA weights
touched + x read + gate_up read + the activation written, over the copy bandwidth measured in the same run)
and time / floor, and the error of the activation against an fp32 reference.

    python -m benchmarks.kernels_lora_silu [--tokens 1 16 64 256 1024 4096]
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback

import torch

try:
    from benchmarks.kernels_lora import ADAPTERS, GROUPS, RANK, SEED, TOKENS, Setup, timed
    from benchmarks.timing import copy_bandwidth, emit
except ImportError:  # run as a script: benchmarks/ itself is on sys.path
    from kernels_lora import ADAPTERS, GROUPS, RANK, SEED, TOKENS, Setup, timed
    from timing import copy_bandwidth, emit
from unipage.kernels import lora_expand, lora_shrink, lora_shrink_expand_ref, lora_silu_mul, silu_mul
from unipage.kernels.lora_meta import plan_lora_batch
from unipage.kernels.lora_silu import CONFIGS

log = logging.getLogger("benchmarks.kernels_lora_silu")
BENCH = "lora_silu_mul"


def inputs(setup: Setup, tokens: int):
    slots, x, _ = setup.inputs(tokens)
    slots[3::7] = -1
    gen = torch.Generator(device=setup.device).manual_seed(SEED + 1)
    gate_up = torch.randn(tokens, setup.meta.out_cols, device=setup.device, generator=gen).to(setup.dtype)
    batch = plan_lora_batch(slots, setup.adapters, group_tokens=-(-tokens // setup.adapters),
                            max_groups=setup.adapters)
    return slots, x, gate_up, batch


def rel_err(setup: Setup, slots, x, gate_up, batch) -> float:
    """||act - act_ref|| / ||act_ref|| of the chosen kernels against fp32 (the pool's pages in fp32)."""
    act = lora_silu_mul(gate_up.clone(), lora_shrink(x, setup.pool, setup.table, slots, setup.meta, batch=batch))
    ref = lora_shrink_expand_ref(gate_up.float(), x.float(), setup.pool.float(), setup.table, slots, setup.meta)
    want = silu_mul(ref)
    return ((act.float() - want).norm() / want.norm()).item()


def row(setup: Setup, tokens: int, bandwidth: float) -> dict:
    slots, x, gate_up, batch = inputs(setup, tokens)
    err = rel_err(setup, slots, x, gate_up, batch)  # before the two kernels' timing adds into gate_up
    args = (setup.pool, setup.table, slots, setup.meta)

    def fused():
        lora_silu_mul(gate_up, lora_shrink(x, *args, batch=batch), config={"fused": True})

    def two_kernels():
        silu_mul(lora_expand(gate_up, lora_shrink(x, *args, batch=batch), dependent=True))

    fused_s, graph = timed(fused)
    two_s, _ = timed(two_kernels)
    inter = setup.meta.slice_cols[0]
    floor_bytes = (min(tokens, setup.adapters) * setup.weight_bytes + tokens * setup.meta.d_in * 2
                   + tokens * 3 * inter * 2)
    floor = floor_bytes / bandwidth
    return {"bench": BENCH, "model": "Llama-3.1-8B", "targets": "gate_proj+up_proj", "tokens": tokens,
            "adapters": setup.adapters, "rank": RANK, "dtype": str(setup.dtype).removeprefix("torch."),
            "seed": SEED, "path": "grouped" if batch.grouped else "gemv", "block_m": batch.block_m,
            "fused_us": fused_s * 1e6, "two_kernels_us": two_s * 1e6, "fused_over_two": fused_s / two_s,
            "picked": "fused" if batch.block_m in CONFIGS else "two kernels", "floor_us": floor * 1e6,
            "fused_x_floor": fused_s / floor, "graph": graph, "rel_err": err,
            "copy_gbps": bandwidth / 1e9}


def run(out=None, tokens=TOKENS) -> None:
    """Emit one JSON line per token count to ``out`` (stdout by default); failures become error rows."""
    bandwidth = copy_bandwidth()
    setup = Setup(targets=GROUPS["gate_up"], adapters=ADAPTERS)
    for count in tokens:
        try:
            emit(row(setup, count, bandwidth), out)
        except Exception as exc:  # noqa: BLE001 - one failing row must not end the run; it is reported
            log.error("tokens=%d failed:\n%s", count, traceback.format_exc())
            emit({"bench": BENCH, "tokens": count, "error": repr(exc)}, out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS), help="token counts")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        sys.exit("benchmarks.kernels_lora_silu needs a CUDA GPU")
    run(tokens=tuple(args.tokens))


if __name__ == "__main__":
    main()
