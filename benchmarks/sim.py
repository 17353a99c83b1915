"""CPU benchmark of unipage-sim: host seconds to simulate one hour of traffic, one JSON line per row.

    python benchmarks/sim.py [--out FILE] [--duration S] [--rate R]

Row ``calibration``: nanoseconds per iteration of a bare Python loop, to
compare machines (the same row as benchmarks/scheduler.py).

Row ``sim_hour``: one simulated hour at 20 requests/s (about 72,000
requests), 1,000 adapters of ranks 8-64 on all linear layers with Zipf(1)
popularity, Llama-3.1-8B geometry on a 16,384-page pool (32 GiB), the default
cost profile, FCFS and LRU.  ``wall_s`` is the host time of the whole run
(workload generation, adapter registration, the event loop, the record) in
one single-threaded process, ``cpu_s`` its CPU time (the better figure on a
shared machine: ``loadavg_1m`` says how busy it was).  Target: <= 60 s.

Row ``sim_split``: a shorter run of the same workload with the scheduler's
``schedule``/``update``/``add`` timed, to show how the host time divides
between the real scheduler and pool (``scheduler_share``) and the
simulator's own executor, event loop and metrics.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time

try:
    from benchmarks.cpu import calibrate, commit
except ImportError:  # run as a script: benchmarks/ itself is on sys.path
    from cpu import calibrate, commit
from unipage.sim import build_config, make_record
from unipage.sim.engine import Simulation

SEED = 0


def emit(record: dict, out) -> None:
    record = {"bench": "sim", "device": platform.processor() or platform.machine(),
              "python": sys.version.split()[0], "seed": SEED, "unix_time": round(time.time(), 3),
              "commit": commit(), "loadavg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(), **record}
    print(json.dumps(record), file=out, flush=True)



def config(duration_s: float, rate: float):
    return build_config({
        "seed": SEED, "model": {"preset": "llama3-8b"}, "pool": {"num_pages": 16384},
        "lora": {"max_adapters_per_batch": 64, "host_cache_bytes": 16 << 30, "eviction_policy": "lru"},
        "scheduler": {"policy": "fcfs", "max_num_batched_tokens": 2048, "max_num_seqs": 256},
        "workload": {"rate": rate, "duration_s": duration_s, "num_adapters": 1000, "popularity": "zipf",
                     "zipf_s": 1.0, "ranks": [8, 16, 32, 64], "targets": "all"},
    })


def timed_scheduler(sim: Simulation) -> list[float]:
    """Wrap the scheduler's entry points with timers; returns the running total (one cell)."""
    spent = [0.0]

    def wrap(method):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0
        return timed

    for name in ("schedule", "update", "add"):
        setattr(sim.sched, name, wrap(getattr(sim.sched, name)))
    return spent


def bench_hour(duration_s: float, rate: float) -> dict:
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    sim = Simulation(config(duration_s, rate))
    result = sim.run()
    record = make_record(result)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"row": "sim_hour", "simulated_s": duration_s, "rate": rate, "requests": record["requests"],
            "adapters": 1000, "pool_pages": 16384, "steps": record["steps"],
            "mean_batch_requests": record["mean_batch_requests"], "throughput_rps": record["throughput_rps"],
            "ttft_p99_s": record["ttft_p99_s"], "adapter_hit_ratio": record["adapter_hit_ratio"],
            "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "event_loop_s": round(result.wall_s, 2),
            "us_per_step": round(result.wall_s / max(record["steps"], 1) * 1e6, 1),
            "simulated_s_per_wall_s": round(record["duration_s"] / wall, 1), "target_wall_s": 60.0}


def bench_split(duration_s: float, rate: float) -> dict:
    gc.collect()
    sim = Simulation(config(duration_s, rate))
    spent = timed_scheduler(sim)
    result = sim.run()
    return {"row": "sim_split", "simulated_s": duration_s, "rate": rate, "steps": result.steps,
            "event_loop_s": round(result.wall_s, 2), "scheduler_s": round(spent[0], 2),
            "scheduler_share": round(spent[0] / result.wall_s, 3),
            "simulator_us_per_step": round((result.wall_s - spent[0]) / max(result.steps, 1) * 1e6, 1)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=argparse.FileType("a"), default=sys.stdout)
    parser.add_argument("--duration", type=float, default=3600.0)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--split-duration", type=float, default=600.0)
    args = parser.parse_args(argv)
    emit({"row": "calibration", "python_loop_ns_per_iter": round(calibrate(), 2)}, args.out)
    emit(bench_hour(args.duration, args.rate), args.out)
    emit(bench_split(args.split_duration, args.rate), args.out)


if __name__ == "__main__":
    main()
