"""Compile the MoE kernels (routing, experts, LoRA) for Hopper without a GPU: catch compiler failures early.

Triton's passes run on the host, so a kernel that the device's Triton cannot compile (a
``PassManager::run failed`` from its layout passes, say) fails here too, with the same message,
before any device time is spent.  Nothing runs: launches become ``warmup`` calls against a
stand-in driver that reports an sm_90 target, and each launcher's Python around them runs on CPU
tensors at the benchmark's real shapes (`kernels_moe.setup` / `batch`), with the H100's tuned
configs.

Use the Triton the device has (3.6 on the lent machines), e.g. installed beside the venv::

    pip install --target /tmp/triton36 triton==3.6.0
    PYTHONPATH=/tmp/triton36 .venv/bin/python benchmarks/compile_check.py \\
        --tokens 1024 4096 --lora '{"fused": true, "lora_k": 64, "lora_steps": 2}'

One JSON line per (shape, tokens): each kernel compiled, ok or its error (a kernel that needs more
shared memory than an H100 has is not ok either), with its shared memory, registers per thread and
local memory (spills) and static SASS instruction count from ``cuobjdump``: compare variants' register
pressure without a GPU, e.g. the H200's configs at serve.py's setup (b) mix: ``--device-key nvidia_h200
--adapters 16 --rank 8 --lora '{}'``; ``--base`` compiles the experts without LoRA too (rows ``"base": true``), ``--stack`` the stacked expert LoRA
(rows ``"stack": true``),
``--slot-order`` / ``--active-slots`` as `kernels_moe`'s (setup (b)'s mixed steps: ``--tokens 4096
--adapters 5 --slot-order mixed --active-slots 16``); ``--lines N`` lists each kernel's N source lines with the
most instructions (``nvdisasm -gi``): where a variant's extra code comes from.
Exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.errors import CompilationError
from triton.runtime import driver

TUNED_DEVICE = "nvidia_h100_80gb_hbm3"
PATCHED = ("launch", "fused_moe", "moe_route", "fused_moe_lora", "moe_lora_plan", "moe_lora_sum",  # unipage.kernels
           "moe_ranks", "moe_align")
SHARED_LIMIT = 232448  # bytes of shared memory one program may use on an H100 or H200 (227 KiB)


class HopperStandIn:
    """The little of a driver that compiling needs: a target, a device, a stream."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+[@A-Z].*;")  # a SASS line (cuobjdump's or nvdisasm's)


def _tool_output(tool: str, flags: list[str], cubin: bytes) -> str:
    """``tool flags cubin``'s stdout ('' when this Triton ships no such tool)."""
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            return subprocess.run([str(path), *flags, f.name], capture_output=True, text=True).stdout
        except OSError:
            return ""


def count_instructions(sass: str) -> int:
    """Static SASS instructions in a disassembly (-1 for none: no tool)."""
    return sum(1 for row in sass.splitlines() if INSTRUCTION.match(row)) if sass else -1


def line_counts(text: str, top: int) -> list:
    """The ``top`` source lines (``file:line``, the innermost frame, files by name) with the most static SASS
    instructions in ``nvdisasm -gi`` output: each instruction counted under the line listed before it (those
    before any line are left out), so a helper's lines gather its every call site."""
    counts, line = {}, None
    for row in text.splitlines():
        found = re.search(r'//## File "([^"]+)", line (\d+)', row)
        if found:
            line = f"{Path(found.group(1)).name}:{found.group(2)}"
        elif line and INSTRUCTION.match(row):
            counts[line] = counts.get(line, 0) + 1
    return sorted(counts.items(), key=lambda item: -item[1])[:top]


def resources(cubin: bytes) -> dict:
    """Registers per thread and local memory (spills, stack) of a compiled kernel, from ``cuobjdump
    --dump-resource-usage`` (Triton ships the tool; no driver needed; -1 without it), and its static SASS
    instruction count (``cuobjdump -sass``: code size, loop bodies once, padding included; beside a variant's,
    where code was added)."""
    found = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", _tool_output("cuobjdump", ["--dump-resource-usage"], cubin)))
    return {"registers": int(found.get("REG", -1)), "local_bytes": int(found.get("LOCAL", -1)),
            "stack_bytes": int(found.get("STACK", -1)),
            "instructions": count_instructions(_tool_output("cuobjdump", ["-sass"], cubin))}


def source_lines(cubin: bytes, top: int) -> list:
    """`line_counts` of the kernel's ``nvdisasm -gi`` listing: where its code goes."""
    return line_counts(_tool_output("nvdisasm", ["-gi"], cubin), top)


def compile_only(compiled: list, lines: int = 0):
    """A `launch` that compiles (``warmup``) instead of running, and records what came of it (with ``lines``,
    each kernel's top source lines by instructions, `source_lines`)."""
    def launch(kernel, grid, *args, **kwargs):
        name = kernel.fn.__name__
        try:
            binary = kernel.warmup(*args, grid=grid, **kwargs)
            shared = binary.metadata.shared  # past the limit the launch would fail: counted as a failure
            compiled.append({"kernel": name, "ok": shared <= SHARED_LIMIT, "shared": shared,
                             "warps": binary.metadata.num_warps, **resources(binary.asm["cubin"]),
                             **({"lines": source_lines(binary.asm["cubin"], lines)} if lines else {})})
        except (CompilationError, RuntimeError) as exc:  # the front end's, or the passes' (PassManager)
            compiled.append({"kernel": name, "ok": False, "error": repr(exc)[:300]})
    return launch


def patch(compiled: list, tuned_device: str = TUNED_DEVICE, lines: int = 0) -> None:
    launch = compile_only(compiled, lines)
    for name in PATCHED:
        try:
            module = importlib.import_module(f"unipage.kernels.{name}")
        except ImportError:  # an older build (compared side by side on PYTHONPATH) lacks a newer module
            continue
        module.launch = launch
        if hasattr(module, "device_key"):
            module.device_key = lambda device=None: tuned_device
        if hasattr(module, "config_devices"):  # the lookups of the tuned configs (fused_moe, moe_lora_plan)
            module.config_devices = lambda device=None: (tuned_device,)
        if hasattr(module, "hopper_or_later"):  # the Hopper-only variants (PDL launches) the GPU compiles
            module.hopper_or_later = lambda device=None: True


def main(argv=None) -> int:
    sys.path.insert(0, str(Path(__file__).parent))
    import kernels_moe as km  # the inputs (their set-up binds no lookup that `patch` replaces)

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-20b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 256, 1024, 4096])
    parser.add_argument("--lora", default='{"fused": true}', help="keys merged into the tuned LoRA config")
    parser.add_argument("--device-key", default=TUNED_DEVICE, help="whose tuned configs (e.g. nvidia_h200)")
    parser.add_argument("--adapters", type=int, default=8, help="adapters the tokens spread over")
    parser.add_argument("--rank", type=int, help="every adapter's rank (default: the shape's)")
    parser.add_argument("--slot-order", default="round-robin", choices=km.SLOT_ORDERS,
                        help="the tokens' adapters (kernels_moe's orders)")
    parser.add_argument("--active-slots", type=int, default=None, help="the MoeLora's bound (a graph's class)")
    parser.add_argument("--slot-ids", type=int, nargs="+", help="each adapter's slot, as kernels_moe's")
    parser.add_argument("--base", action="store_true", help="also compile the experts without LoRA")
    parser.add_argument("--stack", action="store_true",
                        help="also compile the stacked expert LoRA (the batch's adapters in a `moe_lora_stack`; rows "
                             "\"stack\": true)")
    parser.add_argument("--lines", type=int, default=0, metavar="N",
                        help="each kernel's N source lines with the most static SASS instructions")
    args = parser.parse_args(argv)
    if args.lines < 0:
        parser.error(f"--lines must be >= 0, got {args.lines}")
    if args.active_slots is not None and args.active_slots < args.adapters:
        parser.error(f"--active-slots must be >= --adapters ({args.adapters}), got {args.active_slots}")
    driver.set_active(HopperStandIn())
    compiled: list = []
    patch(compiled, args.device_key, args.lines)
    km.configure(args.adapters, args.rank, args.slot_order, args.active_slots, args.slot_ids)
    from unipage.kernels.fused_moe import fused_experts, route_topk
    from unipage.kernels.moe_lora_plan import lora_config
    from unipage.kernels.moe_lora_stack import build_stack
    from unipage.kernels.moe_ranks import slot_ranks

    km.DEVICE = "cpu"
    failed = False
    for shape in args.shapes:
        s = km.setup(shape)
        for tokens in args.tokens:
            b = km.batch(s, tokens)
            compiled.clear()
            extra = json.loads(args.lora)
            if "fused" in extra:  # that path at every token count
                extra = {"fused_min_tokens": 0, **extra}
            config = {**lora_config(b["lora"], b["topk_ids"]), **extra}
            if args.base:  # the experts without LoRA first, their kernels marked as the base's
                fused_experts(b["x"], s["w_gate_up"], s["w_down"], b["topk_weights"], b["topk_ids"], None)
                compiled[:] = [{"base": True, **c} for c in compiled]
            fused_experts(b["x"], s["w_gate_up"], s["w_down"], b["topk_weights"], b["topk_ids"], b["lora"],
                          lora_config=config)
            if args.stack:  # the stacked path's kernels after the paged ones, marked
                done = len(compiled)
                fused_experts(b["x"], s["w_gate_up"], s["w_down"], b["topk_weights"], b["topk_ids"], b["lora"],
                              stack=build_stack(b["lora"], km.slot_ids()))
                compiled[done:] = [{"stack": True, **c} for c in compiled[done:]]
            experts, top_k, dtype = s["w_gate_up"].shape[0], b["topk_ids"].shape[1], b["x"].dtype
            for bias in (None, torch.zeros(experts, dtype=dtype)):  # routing as the engine calls it
                route_topk(torch.zeros(tokens, experts, dtype=dtype), top_k, True, bias=bias, weight_dtype=dtype)
            if b["lora"].ranks is not None:  # the step's slot ranks, made once a step (the batch has the
                slot_ranks(b["lora"].token_slots, s["page_table"].shape[0], b["lora"].active_slots)  # ref's)
            failed |= not all(c["ok"] for c in compiled)
            print(json.dumps({"shape": shape, "tokens": tokens, "compiled": compiled}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
