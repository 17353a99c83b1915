"""Timing helpers shared by the GPU benchmarks: CUDA-graph replay with a flushed L2,
the measured copy bandwidth (the floor the kernels are compared against), the
measured read bandwidth (the floor of a decode step, which mostly reads), and
one JSON-lines record format (the same fields the simulator writes, and the commit measured)."""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

L2_FLUSH_BYTES = 256 << 20  # larger than any Hopper L2 (50-60 MB)


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"


def time_graph(fn, iters: int = 30, warmup: int = 3) -> float:
    """Median seconds of one call of ``fn`` replayed from a CUDA graph, L2 flushed before each replay."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()  # warm-up on the capture stream
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.synchronize()
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def read_bandwidth(nbytes: int = 4 << 30) -> float:
    """Bytes/s of a large read-only stream (the max of fp32 values: nothing written but one scalar).
    A decode step's traffic is nearly all reads (weights and KV), and HBM reads run faster than a copy
    (H200: 4.4 TB/s here against 2.7 TB/s for a copy counting bytes read and written)."""
    nbytes = min(nbytes, torch.cuda.mem_get_info()[0] // 4) // 4 * 4
    src = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    seconds = time_graph(lambda: src.amax(), iters=10)
    return nbytes / seconds


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = time_graph(lambda: dst.copy_(src), iters=10)
    return 2 * nbytes / seconds


@functools.cache
def commit() -> str:
    """``$UNIPAGE_COMMIT`` if set (a run of an installed build, not of this checkout), else ``git describe
    --always --dirty`` of this checkout ("" outside git)."""
    if os.environ.get("UNIPAGE_COMMIT"):
        return os.environ["UNIPAGE_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        return subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def emit(record: dict, out=None) -> None:
    """Write one JSON line: the record plus the device, versions and wall time, and the commit (`commit`)
    unless the record has one."""
    full = {"device": device_name(), "torch": torch.__version__, "python": sys.version.split()[0],
            "unix_time": round(time.time(), 3), **record}
    full.setdefault("commit", commit())
    line = json.dumps(full, sort_keys=False)
    print(line, file=out or sys.stdout, flush=True)
