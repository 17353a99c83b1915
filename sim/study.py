"""The study behind docs/sim_study.md: ``unipage-sim study [--out docs/sim_study]``.

Three sweeps, each from a config written next to its results (so any one can
be rerun with ``unipage-sim sweep``):

1. ``eviction``: every eviction policy of the pool (Belady's bound included)
   x pool sizes, on a skewed workload (500 adapters, Zipf(1), ranks 8-64 on
   all linear layers, a 2 GiB host cache): adapter hit ratio and p99 TTFT vs
   pool size.
2. ``scheduler``: FCFS vs SLO-aware early abort vs VTC at arrival CV 1
   (Poisson) and CV 8 (bursty), three seeds each: SLO attainment.
3. ``rate``: the same three policies, throughput and p99 TTFT vs arrival
   rate at CV 1: where the load of study 2 sits.

Writes ``<name>.toml``, ``<name>.jsonl`` (records), ``<name>.csv``, the PNG
plots and ``results.md`` (tables generated from the records) into the output
directory.  Nothing in the tables is typed in: rerunning the command
regenerates every number.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from unipage.sim.config import to_toml
from unipage.sim.report import (
    _line_plot,
    _occupancy_plot,
    _slo_plot,
    to_csv,
    write_outputs,
)
from unipage.sim.sweep import sweep

from unipage.eviction import POLICIES as EVICTION_POLICIES

MODEL = {"preset": "llama3-8b"}
EVICTION = {
    "name": "eviction", "seed": 0, "model": MODEL,
    "pool": {"num_pages": 4096, "block_tokens": 16, "prefix_caching": True},
    "lora": {"max_rank": 64, "max_adapters_per_batch": 32, "host_cache_bytes": 2 << 30},
    "scheduler": {"policy": "fcfs", "max_num_batched_tokens": 2048, "max_num_seqs": 256},
    "workload": {"rate": 6.0, "cv": 1.0, "duration_s": 600.0, "num_adapters": 500, "popularity": "zipf",
                 "zipf_s": 1.0, "ranks": [8, 16, 32, 64], "targets": "all"},
    "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
}
EVICTION_AXES = {"seed": [0, 1], "eviction": sorted(EVICTION_POLICIES),
                 "pool_pages": [1024, 1536, 2048, 3072, 4096, 6144, 8192]}
SCHEDULER = {
    "name": "scheduler", "seed": 0, "model": MODEL,
    "pool": {"num_pages": 8192},
    "lora": {"max_adapters_per_batch": 32, "host_cache_bytes": 8 << 30},
    "scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 256},
    "workload": {"rate": 22.0, "cv": 1.0, "duration_s": 600.0, "num_adapters": 200, "popularity": "zipf",
                 "zipf_s": 1.0, "ranks": [8, 16, 32, 64], "targets": "attention"},
    "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
}
SCHEDULER_AXES = {"seed": [0, 1, 2], "cv": [1.0, 8.0], "policy": ["fcfs", "slo", "vtc"]}
RATE_AXES = {"rate": [8.0, 12.0, 16.0, 20.0, 24.0, 28.0, 32.0], "policy": ["fcfs", "slo", "vtc"]}


def _quick(raw: dict, axes: dict) -> tuple[dict, dict]:
    """A seconds-long version (smoke test of the pipeline, not for conclusions)."""
    raw = {**raw, "workload": {**raw["workload"], "duration_s": 20.0}}
    return raw, {k: v[:2] for k, v in axes.items()}


def _records(lines: list[str]) -> list[dict]:
    import json

    return [json.loads(line) for line in lines]


def _mean(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def _fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def _grid_table(records, row_key, col_key, metric, spec, rows, cols, row_title, col_fmt) -> list[str]:
    lines = [f"| {row_title} | " + " | ".join(col_fmt(c) for c in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for row in rows:
        cells = []
        for col in cols:
            sel = [r for r in records if row_key(r) == row and col_key(r) == col]
            cells.append(_fmt(_mean(sel, metric), spec))
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return lines


def eviction_tables(records: list[dict]) -> list[str]:
    policies = sorted({r["config"]["lora"]["eviction_policy"] for r in records})
    pages = sorted({r["config"]["pool"]["num_pages"] for r in records})
    policy = lambda r: r["config"]["lora"]["eviction_policy"]
    pool = lambda r: r["config"]["pool"]["num_pages"]
    out = []
    for metric, spec, title in (("adapter_hit_ratio", ".3f", "Adapter hit ratio"),
                                ("ttft_p99_s", ".3f", "p99 TTFT (s)"),
                                ("adapter_loads", ".0f", "Adapter loads"),
                                ("slo_attainment", ".3f", "SLO attainment")):
        out += [f"### {title} (mean over seeds)", ""]
        out += _grid_table(records, policy, pool, metric, spec, policies, pages, "policy \\ pool pages", str)
        out.append("")
    return out


def scheduler_tables(records: list[dict]) -> list[str]:
    policies = [p for p in SCHEDULER_AXES["policy"] if any(r["config"]["scheduler"]["policy"] == p for r in records)]
    cvs = sorted({r["config"]["workload"]["cv"] for r in records})
    lines = [("| policy | CV | SLO attainment (per seed) | mean | hot adapters | cold adapters | goodput req/s "
              "| p99 TTFT (s) | p99 TTFT hot / cold (s) | p99 TPOT (s) | dropped (SLO) | requests |"),
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for policy in policies:
        for cv in cvs:
            sel = sorted((r for r in records if r["config"]["scheduler"]["policy"] == policy
                          and r["config"]["workload"]["cv"] == cv), key=lambda r: r["seed"])
            per_seed = ", ".join(f"{r['slo_attainment']:.3f}" for r in sel)
            dropped = sum(r["aborted_slo"] for r in sel) / max(sum(r["requests"] for r in sel), 1)
            m = {key: _mean(sel, key) for key in ("slo_attainment", "slo_attainment_hot", "slo_attainment_cold",
                                                   "goodput_rps", "ttft_p99_s", "ttft_p99_hot_s", "ttft_p99_cold_s",
                                                   "tpot_p99_s")}
            lines.append(f"| {policy} | {cv:g} | {per_seed} | {_fmt(m['slo_attainment'], '.3f')} "
                         f"| {_fmt(m['slo_attainment_hot'], '.3f')} | {_fmt(m['slo_attainment_cold'], '.3f')} "
                         f"| {_fmt(m['goodput_rps'], '.2f')} | {_fmt(m['ttft_p99_s'], '.2f')} "
                         f"| {_fmt(m['ttft_p99_hot_s'], '.2f')} / {_fmt(m['ttft_p99_cold_s'], '.2f')} "
                         f"| {_fmt(m['tpot_p99_s'], '.3f')} | {dropped:.1%} | {sum(r['requests'] for r in sel)} |")
    lines += ["", ("Hot adapters: the most requested ones that together make half of the adapter requests; "
                   "cold: the rest.")]
    return lines + [""]


def rate_tables(records: list[dict]) -> list[str]:
    policies = [p for p in RATE_AXES["policy"] if any(r["config"]["scheduler"]["policy"] == p for r in records)]
    rates = sorted({r["config"]["workload"]["rate"] for r in records})
    policy = lambda r: r["config"]["scheduler"]["policy"]
    rate = lambda r: r["config"]["workload"]["rate"]
    out = []
    for metric, spec, title in (("throughput_rps", ".2f", "Throughput (req/s)"), ("ttft_p99_s", ".2f", "p99 TTFT (s)"),
                                ("slo_attainment", ".3f", "SLO attainment")):
        out += [f"### {title}", ""]
        out += _grid_table(records, policy, rate, metric, spec, policies, rates, "policy \\ rate (req/s)",
                           lambda c: f"{c:g}")
        out.append("")
    return out


def run_study(out: Path, jobs: int = 0, quick: bool = False, progress: bool = True) -> dict[str, list[dict]]:
    """Run the three sweeps and write configs, records, CSV, plots and results.md into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    rate_base = {**SCHEDULER, "name": "rate"}
    parts = {"eviction": (EVICTION, EVICTION_AXES), "scheduler": (SCHEDULER, SCHEDULER_AXES),
             "rate": (rate_base, RATE_AXES)}
    texts: dict[Path, str] = {}
    results: dict[str, list[dict]] = {}
    timings = {}
    for name, (raw, axes) in parts.items():
        if quick:
            raw, axes = _quick(raw, axes)
        start = time.perf_counter()
        lines = sweep(raw, out, axes, jobs, f"study {name}", progress=progress)
        timings[name] = time.perf_counter() - start
        results[name] = _records(lines)
        texts[out / f"{name}.toml"] = to_toml(raw)
        texts[out / f"{name}.jsonl"] = "".join(line + "\n" for line in lines)
        texts[out / f"{name}.csv"] = to_csv(results[name])
    ev, sc, ra = results["eviction"], results["scheduler"], results["rate"]
    mid = sorted({r["config"]["pool"]["num_pages"] for r in ev})[len({r["config"]["pool"]["num_pages"] for r in ev}) // 2]
    occupancy = [r for r in ev if r["seed"] == 0 and r["config"]["pool"]["num_pages"] == mid
                 and r["config"]["lora"]["eviction_policy"] in ("lru", "idle", "belady")]
    figures = {
        out / "eviction_pool.png": _line_plot(plt, ev, "config.pool.num_pages", "pool size (pages of 2 MiB)",
                                              [("adapter_hit_ratio", "adapter hit ratio", False),
                                               ("ttft_p99_s", "p99 TTFT (s)", True)],
                                              ["config.lora.eviction_policy"],
                                              "eviction policies on a skewed workload (mean of seeds)"),
        out / "eviction_occupancy.png": _occupancy_plot(plt, occupancy),
        out / "scheduler_slo.png": _slo_plot(plt, sc, ["config.workload.cv"]),
        out / "rate.png": _line_plot(plt, ra, "config.workload.rate", "arrival rate (req/s)",
                                     [("throughput_rps", "throughput (req/s)", False),
                                      ("ttft_p99_s", "p99 TTFT (s)", True)], ["config.scheduler.policy"],
                                     "throughput and p99 TTFT vs rate (CV 1)"),
    }
    md = ["# unipage-sim study: generated tables", "",
          "Generated by `unipage-sim study" + (" --quick" if quick else "") + "`; do not edit (rerun instead).",
          f"Profile: `{ev[0]['device']}`. Host time per sweep: "
          + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + ".", "",
          "## 1. Eviction policies × pool size (skewed workload)", "", *eviction_tables(ev),
          "## 2. Scheduling policies at CV 1 and CV 8", "", *scheduler_tables(sc),
          "## 3. Throughput and p99 TTFT vs rate (CV 1)", "", *rate_tables(ra)]
    texts[out / "results.md"] = "\n".join(md)
    write_outputs(texts, figures)
    return results
