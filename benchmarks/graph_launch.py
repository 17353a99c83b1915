"""Host time of a CUDA graph launch, per node, by the kind of node (JSON lines).

    python benchmarks/graph_launch.py [--nodes 200] [--reps 50] [--out FILE]

A decode step replays one captured graph, and the GPU starts on it only once the
host's ``cudaGraphLaunch`` returns; that call's time grows with the nodes.  Each
row captures ``--nodes`` launches of one kind into a graph and times its
``replay()`` on the host (median of ``--reps``, the GPU idle before each, so
the call never waits for queue space), and the replay's device time:

- ``torch_add``: an in-place torch add (an ATen elementwise kernel);
- ``triton_args<N>``: a Triton kernel of N tensor arguments (it reads the first
  and writes the last), plain, and with ``launch_pdl`` (programmatic dependent
  launch, the kernel waiting on its predecessor with ``gdc_wait``);
- ``triton_args<N>_ints``: N/2 tensors and N/2 int arguments (values from 2: none that Triton
  specialises away as 1).

``us_per_node`` is the host time of the call over the nodes.  Then the engine's own launches, ``--calls``
of each in one graph at setup (a)'s decode batch (GPT-OSS-20B, 16 tokens, 8 adapters of rank 32), with
``us_per_call`` the host time over the calls:

- ``qkv_matmul``: the qkv projection with its bias (`F.linear`: one cuBLAS launch);
- ``qkv_lora``: the same with its LoRA as the engine runs it (`lora_linear` off: the projection, the
  shrink launched early as its dependent, the expand); ``qkv_lora_late``: the shrink not early;
- ``experts`` and ``experts_lora``: `fused_experts` without and with the experts' LoRA (random routing).
"""

from __future__ import annotations

import argparse
import contextlib
import linecache
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from timing import emit

try:
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # pragma: no cover - Triton without PDL
    gdc_wait = None


def _kernel(count: int):
    """A Triton kernel of ``count`` pointer arguments ``p0..`` that adds one from ``p0`` into the last (the
    others are passed and unused): generated, one per count."""
    names = [f"p{i}" for i in range(count)]
    source = (f"def kernel({', '.join(names)}, PDL: tl.constexpr):\n"
              f"    if PDL:\n        gdc_wait()\n"
              f"    tl.store({names[-1]} + tl.program_id(0), tl.load(p0 + tl.program_id(0)) + 1)\n")
    filename = f"<graph_launch_kernel_{count}>"  # triton.jit reads the source back through linecache
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    scope = {"tl": tl, "gdc_wait": gdc_wait}
    exec(compile(source, filename, "exec"), scope)  # noqa: S102 - source built from the names above
    fn = scope["kernel"]
    return triton.jit(fn)


def _launches(kind: str, count: int, pdl: bool, buf: torch.Tensor):
    if kind == "torch_add":
        return lambda: buf.add_(1)
    kernel = _kernel(count)
    if kind.endswith("_ints"):
        args = [buf] * (count // 2 - 1) + list(range(2, 2 + count - count // 2)) + [buf]
    else:
        args = [buf] * count
    extra = {"launch_pdl": True} if pdl else {}
    return lambda: kernel[(1,)](*args, PDL=pdl, **extra)


def _graph_of(one, count: int) -> torch.cuda.CUDAGraph:
    """A graph of ``count`` calls of ``one`` (warmed up first: compiles, cuBLAS handles)."""
    for _ in range(3):
        one()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(count):
            one()
    return graph


def _replays(graph: torch.cuda.CUDAGraph, reps: int) -> tuple[float, float]:
    """Medians over ``reps`` replays, the GPU idle before each: the host microseconds of the ``replay()``
    call and the replay's device microseconds."""
    host, device = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        graph.replay()
        host.append(time.perf_counter() - t0)
        end.record()
        end.synchronize()
        device.append(start.elapsed_time(end) * 1e3)
    return statistics.median(host) * 1e6, statistics.median(device)


def measure(kind: str, count: int, pdl: bool, nodes: int, reps: int) -> dict:
    buf = torch.zeros(64, device="cuda", dtype=torch.float32)
    us, device_us = _replays(_graph_of(_launches(kind, count, pdl, buf), nodes), reps)
    return {"bench": "graph_launch", "kind": kind, "args": count, "pdl": pdl, "nodes": nodes,
            "launch_us": round(us, 1), "us_per_node": round(us / nodes, 3), "device_us": round(device_us, 1)}


def _engine_ops() -> dict:
    """The engine-launch cases of the module docstring: name -> one call's launches."""
    import kernels_lora_linear as kll
    import kernels_moe as km

    from unipage.kernels.fused_moe import fused_experts
    from unipage.kernels.lora_linear import linear_lora
    from unipage.kernels.lora_meta import plan_lora_batch

    d = kll.setup("gpt-oss-20b qkv", 16, layers=1)
    batch = plan_lora_batch(d["slots"], d["meta"].num_slots)
    args = (d["x"], d["w"][0], d["bias"], d["pool"], d["table"], d["slots"], d["meta"])
    off = {"max_tokens": 0}
    m = km.setup("gpt-oss-20b")
    b = km.batch(m, 16)
    experts = (b["x"], m["w_gate_up"], m["w_down"], b["topk_weights"], b["topk_ids"])
    return {"qkv_matmul": lambda: F.linear(d["x"], d["w"][0], d["bias"]),
            "qkv_lora": lambda: linear_lora(*args, batch=batch, config=off, early=True),
            "qkv_lora_late": lambda: linear_lora(*args, batch=batch, config=off, early=False),
            "experts": lambda: fused_experts(*experts),
            "experts_lora": lambda: fused_experts(*experts, b["lora"])}


def measure_op(name: str, one, calls: int, reps: int) -> dict:
    us, device_us = _replays(_graph_of(one, calls), reps)
    return {"bench": "graph_launch", "kind": name, "calls": calls, "launch_us": round(us, 1),
            "us_per_call": round(us / calls, 2), "device_us": round(device_us, 1)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=200)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--calls", type=int, default=24, help="engine launches per graph (a step's layers)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("graph_launch.py needs a CUDA device")
    cases = [("torch_add", 0, False)]
    for count in (2, 16, 48):
        for pdl in (False, True):
            cases.append((f"triton_args{count}", count, pdl))
    cases += [("triton_args48_ints", 48, False), ("triton_args48_ints", 48, True)]
    sink = open(args.out, "a") if args.out else contextlib.nullcontext(sys.stdout)  # noqa: SIM115
    with sink as out:
        for kind, count, pdl in cases:
            emit(measure(kind, count, pdl, args.nodes, args.reps), out)
        for name, one in _engine_ops().items():
            emit(measure_op(name, one, args.calls, args.reps), out)


if __name__ == "__main__":
    main()
