"""Metrics of a run, and its record: one JSON object, in the format the GPU benchmarks write.

Definitions (N = requests in the trace; "finished" excludes requests the
scheduler dropped):

- throughput: finished requests (and their generated tokens) per second of
  simulated time, from 0 (the first arrival) to the last request's end;
- TTFT = first token − arrival; TPOT = (finish − first token) / (output − 1)
  for outputs of 2+ tokens; latency = finish − arrival; p50/p90/p99 over
  finished requests;
- SLO attainment: share of all N requests that finished with TTFT <= ttft_s
  and TPOT <= tpot_s (dropped ones miss); goodput: those per second; also
  for the *hot* adapters (the most requested ones that together make half of
  the adapter requests) and the *cold* rest, with their p99 TTFT;
- adapter hit ratio: share of adapter requests whose adapter was loaded on
  the GPU when the request arrived; loads and bytes moved (host-to-device,
  and from disk on host-cache misses); evictions by kind; preemptions;
- occupancy: pages by kind sampled over time, and their time averages;
- Little's law: over the middle 80% of the arrival span, L = the time
  average of requests in the system as the scheduler holds them, against
  lambda * W from the arrival and finish times of the requests arriving in
  that window.

A record carries no wall-clock time, so the same config and seed give
byte-identical records.
"""

from __future__ import annotations

import json
import math
import platform

import numpy as np
from unipage.sim.engine import ABORTED_LOAD, ABORTED_SLO, FINISHED, SimResult

PERCENTILES = (50, 90, 99)


def _r(x: float, digits: int = 6) -> float | None:
    """JSON-ready float: rounded, None for nan/inf."""
    x = float(x)
    return round(x, digits) if math.isfinite(x) else None


def _stats(prefix: str, values: np.ndarray) -> dict:
    if not values.size:
        return {f"{prefix}_mean_s": None, **{f"{prefix}_p{p}_s": None for p in PERCENTILES}}
    pct = np.percentile(values, PERCENTILES)
    return {f"{prefix}_mean_s": _r(values.mean()), **{f"{prefix}_p{p}_s": _r(v) for p, v in zip(PERCENTILES, pct)}}


def summarize(result: SimResult) -> dict:
    """Scalar metrics of a run (JSON-ready)."""
    trace, cfg = result.trace, result.config
    n = len(trace)
    done = result.status == FINISHED
    arrival = trace.arrival
    ttft = result.first_token - arrival
    out = result.num_output
    multi = done & (out > 1)
    tpot = np.full(n, np.nan)
    tpot[multi] = (result.finish[multi] - result.first_token[multi]) / (out[multi] - 1)
    latency = result.finish - arrival
    attain = done & (ttft <= cfg.slo.ttft_s) & ((out <= 1) | (tpot <= cfg.slo.tpot_s))
    duration = max(result.end_time, 1e-12)
    with_adapter = trace.adapter >= 0
    gen_tokens = int(out[done].sum())
    in_tokens = int(trace.input_tokens[done].sum())
    record = {
        "requests": n, "finished": int(done.sum()), "aborted_slo": int((result.status == ABORTED_SLO).sum()),
        "aborted_load_failed": int((result.status == ABORTED_LOAD).sum()), "clipped_requests": trace.clipped,
        "duration_s": _r(result.end_time), "throughput_rps": _r(done.sum() / duration),
        "output_tokens_per_s": _r(gen_tokens / duration), "total_tokens_per_s": _r((gen_tokens + in_tokens) / duration),
        **_stats("ttft", ttft[done]), **_stats("tpot", tpot[multi]), **_stats("latency", latency[done]),
        "slo_attainment": _r(attain.sum() / max(n, 1)), "goodput_rps": _r(attain.sum() / duration),
        "goodput_tokens_per_s": _r(out[attain].sum() / duration),
    }
    record.update(_hot_cold(trace.adapter, attain, ttft, done))
    record.update(_adapter_metrics(result, with_adapter))
    record.update(_engine_metrics(result))
    record.update(_little(result, latency))
    return record


def _hot_cold(adapter: np.ndarray, attain: np.ndarray, ttft: np.ndarray, done: np.ndarray) -> dict:
    """SLO attainment and p99 TTFT of the hot adapters (the most requested ones that together make half of
    the adapter requests) and of the cold rest: who pays for a policy's choices."""
    used = adapter[adapter >= 0]
    if not used.size:
        return {f"{k}_{h}": None for k in ("slo_attainment", "ttft_p99") for h in ("hot", "cold")}
    counts = np.bincount(used)
    order = np.argsort(-counts, kind="stable")
    hot_count = int(np.searchsorted(np.cumsum(counts[order]), used.size / 2) + 1)
    is_hot = np.zeros(counts.size, dtype=bool)
    is_hot[order[:hot_count]] = True
    out = {}
    for name, mask in (("hot", (adapter >= 0) & is_hot[np.maximum(adapter, 0)]),
                       ("cold", (adapter >= 0) & ~is_hot[np.maximum(adapter, 0)])):
        served = mask & done
        out[f"slo_attainment_{name}"] = _r(attain[mask].mean()) if mask.any() else None
        out[f"ttft_p99_{name}_s"] = _r(np.percentile(ttft[served], 99)) if served.any() else None
    return out


def _adapter_metrics(result: SimResult, with_adapter: np.ndarray) -> dict:
    loads, a = result.loads, result.adapter_stats
    requests = int(with_adapter.sum())
    return {
        "adapter_requests": requests,
        "adapter_hit_ratio": _r(result.hit[with_adapter].mean()) if requests else None,
        "adapter_loads": loads.loads, "adapter_loads_from_host": loads.from_host,
        "adapter_evictions": a["evictions"], "kv_block_evictions": result.evictions.get("kv", 0),
        "bytes_h2d": loads.bytes_h2d, "bytes_disk": loads.bytes_disk,
    }


def _engine_metrics(result: SimResult) -> dict:
    s, samples = result.scheduler_stats, result.samples
    t = np.asarray(samples["t"])
    record = {"preemptions": s["preemptions"], "prefix_hit_tokens": s["prefix_hit_tokens"],
              "steps": result.steps, "busy_fraction": _r(result.busy_s / max(result.end_time, 1e-12)),
              "mean_batch_requests": _r(result.scheduled_requests / max(result.steps, 1)),
              "mean_batch_tokens": _r(result.scheduled_tokens / max(result.steps, 1)),
              "mean_batch_adapters": _r(result.scheduled_adapters / max(result.steps, 1))}
    total = result.config.unipage_config.num_pages
    for kind in ("free", "kv", "cached_kv", "adapter"):
        values = np.asarray(samples[kind], dtype=np.float64)
        mean = np.average(values[:-1], weights=np.diff(t)) if t.size > 1 and t[-1] > t[0] else values.mean()
        record[f"occupancy_{kind}_mean"] = _r(mean / total)
    return record


def _little(result: SimResult, latency: np.ndarray) -> dict:
    (w0, w1), area = result.little["window"], result.little["area"]
    if w1 <= w0:
        return {"little_L": None, "little_lambda_W": None, "little_rel_error": None}
    inside = (result.trace.arrival >= w0) & (result.trace.arrival < w1)
    L = area / (w1 - w0)
    lam_w = inside.sum() / (w1 - w0) * (latency[inside].mean() if inside.any() else 0.0)
    return {"little_L": _r(L), "little_lambda_W": _r(lam_w),
            "little_rel_error": _r(abs(L - lam_w) / lam_w) if lam_w else None}


def occupancy_series(result: SimResult) -> dict:
    """Pages by kind over time (and running / waiting requests), as lists."""
    samples = result.samples
    out = {"t": [_r(x, 4) for x in samples["t"]]}
    out.update({k: list(samples[k]) for k in ("free", "kv", "cached_kv", "adapter", "running", "waiting")})
    return out


def label(config: dict) -> str:
    """A short name of a run: scheduler policy / eviction / pool pages / rate / cv / seed."""
    w = config["workload"]
    rate = "trace" if "trace" in w else f"{w['rate']:g}rps cv{w['cv']:g}"
    return (f"{config['scheduler']['policy']}/{config['scheduler']['admission']}/{config['lora']['eviction_policy']}"
            f"/{config['pool']['num_pages']}p/{rate}/seed{config['seed']}")


def make_record(result: SimResult) -> dict:
    """The run's JSON record: benchmark header fields, the resolved config, metrics, occupancy series."""
    config = result.config.to_dict()
    return {"bench": "sim", "row": "run", "device": f"sim:{result.config.profile.name}",
            "python": platform.python_version(), "seed": result.config.seed, "label": label(config),
            "config": config, **summarize(result), "occupancy": occupancy_series(result)}


def dumps(record: dict) -> str:
    return json.dumps(record, sort_keys=False, allow_nan=False)
