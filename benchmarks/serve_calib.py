"""Calibrate `unipage-sim` against the engine: fit a `CostProfile` from measured step times, and replay
each measured workload in the simulator with it.

Fit: each engine step that ran a batch is one row ``seconds = c . [1, terms]``
with the simulator's terms (`serve_driver.TERMS`); the coefficients are a
non-negative least-squares fit (Lawson-Hanson, columns scaled to unit norm)
over every step of the runs of one model, steps that start adapter loads
included: the step loop's host work per load is the ``load_s`` term (the file
reads themselves run in reader processes, as the simulator's ``read_workers``
readers at ``disk_bytes_per_s``, the measured read-and-pack rate of one).
The steps' launch times (seconds until the engine submits and polls its reads,
once the forward pass is launched) are fitted as ``launch_base_s + launch_token_s *
scheduled tokens`` the same way, over the runs whose logs record them (older
logs do not: without any, both stay 0 and reads are polled at the step's end
only, as before the term).

Replay: the same requests (adapters, lengths, submission order) as a `Trace`.
Adapters the measured run had warmed up are made resident first by one tiny
request each, ``WARM_OFFSET_S`` before the workload.  An all-at-once run
keeps its submission times; a closed loop of concurrency C runs as one in the
simulator (`ClosedLoop`): the first C requests at their measured submission
times, request ``C + k`` at the end of the simulated step in which the k-th
request finishes, as the driver submits it.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
from serve_driver import COLUMNS, TERMS, Timeline, serving_metrics
from unipage.sim import ClosedLoop, CostProfile, SimResult, Trace, build_config, simulate
from unipage.sim.profile import _COEFFICIENTS as COEFFICIENTS
from unipage.sim.profile import _LAUNCH_COEFFICIENTS as LAUNCH_COEFFICIENTS

assert len(TERMS) + 3 == len(COEFFICIENTS) and set(TERMS) <= set(COLUMNS), "fitted terms vs profile fields"
WARM_OFFSET_S = 1000.0  # simulated seconds between the warm-up requests and the workload
THROUGHPUT_TOLERANCE, TTFT_TOLERANCE = 0.05, 0.10  # the targets


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``argmin ||a x - b||`` subject to ``x >= 0`` (Lawson and Hanson's active-set method)."""
    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    tol = 1e-12 * max(1.0, float(np.abs(a).max()) * float(np.abs(b).max()) * len(b))
    for _ in range(3 * n + 10):
        grad = a.T @ (b - a @ x)
        if passive.all() or grad[~passive].max() <= tol:
            break
        passive[int(np.argmax(np.where(passive, -np.inf, grad)))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if z[passive].min() > 0:
                x = z
                break
            bad = passive & (z <= 0)
            step = float(np.min(x[bad] / (x[bad] - z[bad])))
            x = x + step * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x


def design_matrix(rows: np.ndarray) -> np.ndarray:
    """The fitted terms of step rows (`COLUMNS`), in `COEFFICIENTS` order: 1, the logged `TERMS`, 1 for a
    step with a prefill (the engine runs it eagerly; decode-only steps replay CUDA graphs) and 1 for a step
    with LoRA tokens (the LoRA kernels' fixed time)."""
    col = {name: i for i, name in enumerate(COLUMNS)}
    eager = (rows[:, col["prefill"]] > 0).astype(np.float64)
    lora = (rows[:, col["adapters"]] > 0).astype(np.float64)
    return np.column_stack([np.ones(len(rows))] + [rows[:, col[t]] for t in TERMS] + [eager, lora])


def fit_coefficients(runs: list[np.ndarray]) -> tuple[dict, dict]:
    """Coefficients by `CostProfile` field, and the fit's quality, from each run's step rows (`COLUMNS`).

    Each run's rows are weighted by one over its mean step time, so a run of short steps counts as much
    as a run of long ones (each run's throughput matters equally)."""
    col = {name: i for i, name in enumerate(COLUMNS)}
    runs = [r for r in runs if len(r)]
    rows = np.concatenate(runs) if runs else np.zeros((0, len(COLUMNS)))
    if len(rows) < 2:
        raise ValueError(f"{len(rows)} steps: too few to fit a profile")
    weight = np.concatenate([np.full(len(r), 1.0 / r[:, col["seconds"]].mean()) for r in runs])
    design = design_matrix(rows)
    seconds = rows[:, col["seconds"]]
    weighted = design * weight[:, None]
    scale = np.linalg.norm(weighted, axis=0)
    used = _distinct(design) & (scale > 0)
    coef = np.zeros(design.shape[1])
    coef[used] = nnls(weighted[:, used] / scale[used], seconds * weight) / scale[used]
    predicted = design @ coef
    quality = {"steps": len(rows), "total_ratio": round(float(predicted.sum() / seconds.sum()), 4),
               "rms_rel_error": round(float(np.sqrt(np.mean(((predicted - seconds) / seconds) ** 2))), 4)}
    return dict(zip(COEFFICIENTS, (float(c) for c in coef))), quality


def _distinct(design: np.ndarray) -> np.ndarray:
    """Which columns to fit: not one equal to an earlier column (the fit cannot tell the two terms apart, so
    the earlier takes it; e.g. every step with LoRA tokens: `lora_step_s` is `step_base_s`)."""
    keep = np.ones(design.shape[1], dtype=bool)
    for j in range(design.shape[1]):
        keep[j] = not any(keep[i] and np.array_equal(design[:, i], design[:, j]) for i in range(j))
    return keep


def fit_launch(runs: list[np.ndarray]) -> tuple[dict, dict]:
    """``launch_base_s`` and ``launch_token_s`` (`CostProfile`), and the fit's quality, from the step rows
    (`COLUMNS`) that record a launch time; zeros (and 0 steps) when none does."""
    col = {name: i for i, name in enumerate(COLUMNS)}
    rows = np.concatenate(runs) if runs else np.zeros((0, len(COLUMNS)))
    rows = rows[np.isfinite(rows[:, col["launch"]])]
    if not len(rows):
        return dict.fromkeys(LAUNCH_COEFFICIENTS, 0.0), {"launch_steps": 0}
    tokens = rows[:, col["prefill"]] + rows[:, col["decode"]]
    design = np.column_stack([np.ones(len(rows)), tokens])
    launch = rows[:, col["launch"]]
    scale = np.linalg.norm(design, axis=0)
    coef = nnls(design / scale, launch) / scale
    rms = float(np.sqrt(np.mean((design @ coef - launch) ** 2)))
    return dict(zip(LAUNCH_COEFFICIENTS, map(float, coef))), {"launch_steps": len(rows),
                                                               "launch_rms_s": round(rms, 6)}


def fit_gap(logs: list[dict]) -> float:
    """``step_gap_s`` (`CostProfile`): the runs' wall time outside the engine's steps that ran a batch, per
    such step, averaged over the runs.  That is the benchmark loop's host work between steps (outputs, new
    requests, and its own per-step log rows), and the few engine steps that ran nothing (waiting on a load:
    the simulator jumps over those waits instead, so they are counted twice, a small excess)."""
    gaps = []
    for lg in logs:
        seconds = step_rows(lg)[:, COLUMNS.index("seconds")]
        duration = lg.get("measured", {}).get("duration_s")
        if duration and len(seconds):
            gaps.append(max(0.0, (duration - float(np.sum(seconds))) / len(seconds)))
    return float(np.mean(gaps)) if gaps else 0.0


def step_rows(lg: dict) -> np.ndarray:
    """A run log's step rows in `COLUMNS` order; a column the log lacks (an older log) is NaN."""
    columns = lg.get("columns", COLUMNS)
    raw = np.asarray(lg["steps"], dtype=np.float64).reshape(-1, len(columns))
    rows = np.full((len(raw), len(COLUMNS)), np.nan)
    for i, name in enumerate(columns):
        if name in COLUMNS:
            rows[:, COLUMNS.index(name)] = raw[:, i]
    return rows


def read_log(path: str | Path) -> dict:
    """A run log that ``serve.py --log-dir`` wrote (``.json``), or one gzipped (``.json.gz``, as the
    logs committed under ``benchmarks/results/logs/`` are)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def gpu_tag(device: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``; a CPU -> ``"cpu"``."""
    found = re.search(r"\b([a-z]{1,2}\d{2,3}[a-z]?)\b", device.lower())
    return found.group(1) if found and "cpu" not in device.lower() else "cpu"


def fit_profile(logs: list[dict], commit: str) -> tuple[CostProfile, dict]:
    """One profile from the run logs of one model on one device."""
    keys = {(lg["model_key"], lg["device"], lg["device_type"]) for lg in logs}
    if len(keys) != 1:
        raise ValueError(f"one profile fits the runs of one model on one device; got {sorted(keys)}")
    (key, device, device_type), = keys
    runs = [step_rows(lg) for lg in logs]
    coef, quality = fit_coefficients(runs)
    launch, launch_quality = fit_launch(runs)
    quality.update(launch_quality)
    gap = fit_gap(logs)
    disk_bytes, disk_s = sum(lg["disk_bytes"] for lg in logs), sum(lg["disk_seconds"] for lg in logs)
    disk = disk_bytes / disk_s if disk_s > 0 else CostProfile.__dataclass_fields__["disk_bytes_per_s"].default
    tag = "cpu" if device_type == "cpu" else gpu_tag(device)
    runs = ", ".join(map(run_name, logs))
    run_commits = ", ".join(sorted({str(lg.get("commit", "?")) for lg in logs}))
    source = (f"measured by benchmarks/serve.py on {device} (runs at {run_commits}; fitted at {commit}): "
              f"non-negative least-squares fit "
              f"of {quality['steps']} engine step times (runs: {runs}); predicted/measured total step time "
              f"{quality['total_ratio']}, RMS relative error per step {quality['rms_rel_error']}; "
              f"{_launch_source(quality)}; "
              f"step gap: the runs' wall time outside their steps, per step ({gap * 1e6:.0f} us); "
              f"h2d = pinned copy measured in the run; disk = the engine's adapter read-and-pack rate"
              f"{'' if disk_s > 0 else ' (no file reads measured: the default)'}")
    workers = {max(1, lg["read_workers"]) for lg in logs}  # 0: read in the step (CPU)
    if len(workers) != 1:
        raise ValueError(f"the runs used different numbers of adapter readers: {sorted(workers)}")
    h2d = float(np.median([lg["h2d_bytes_per_s"] for lg in logs]))
    profile = CostProfile(name=f"{key}-{tag}", **coef, **launch, step_gap_s=gap, h2d_bytes_per_s=h2d,
                          disk_bytes_per_s=float(disk), read_workers=int(workers.pop()), source=source)
    return profile, quality


def _launch_source(quality: dict) -> str:
    if not quality["launch_steps"]:
        return "launch terms 0: no run log records the steps' launch times (reads are polled at step ends only)"
    return (f"launch terms: a fit of {quality['launch_steps']} steps' launch times, RMS error "
            f"{quality['launch_rms_s'] * 1e6:.0f} us")


def write_profile(profile: CostProfile, directory: str | Path) -> Path:
    path = Path(directory) / f"{profile.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_dict(), indent=1) + "\n")
    return path


# -- replay ----------------------------------------------------------------------
def sim_config(lg: dict, profile_path: Path):
    raw = {"name": lg["label"], "seed": 0, "model": lg["model"], "pool": lg["pool"],
           "lora": {k: lg["lora"][k] for k in ("max_rank", "max_adapters_per_batch", "host_cache_bytes",
                                               "eviction_policy")},
           "scheduler": lg["scheduler"],
           "workload": {"num_adapters": len(lg["adapter_names"]), "ranks": [lg["rank"]], "targets": lg["targets"]},
           "sim": {"profile": str(Path(profile_path).resolve())}}
    return build_config(raw, where=f"replay of {lg['label']}")


def sim_trace(lg: dict) -> tuple[Trace, int]:
    """The run's requests after one 1-token request per warmed-up adapter; and how many of those come first."""
    req, names = lg["requests"], lg["adapter_names"]
    index = {name: i for i, name in enumerate(names)}
    warm = [index[a] for a in lg["warm_adapters"]]
    n, w = len(req["input"]), len(warm)
    arrival = np.concatenate([np.zeros(w), WARM_OFFSET_S + np.asarray(req["submit"], dtype=np.float64)])
    ints = lambda xs: np.asarray(xs, dtype=np.int32)
    trace = Trace(arrival, ints(warm + req["adapter"]), ints([1] * w + req["input"]),
                  ints([1] * w + req["output"]), np.zeros(n + w, dtype=np.int32), list(names),
                  [lg["rank"]] * len(names), ["t0"])
    return trace, w


def replay(lg: dict, profile_path: Path, scheduler: dict | None = None) -> tuple[Timeline, SimResult]:
    """The simulated timeline of a measured run (seconds from its first submission) and the whole result;
    ``scheduler``: `SchedulerConfig` fields set over the run's own."""
    if scheduler:
        lg = {**lg, "scheduler": {**lg["scheduler"], **scheduler}}
    config = sim_config(lg, profile_path)
    trace, w = sim_trace(lg)
    result = simulate(config, trace, ClosedLoop(first=w, concurrency=lg["concurrency"]))
    finish, first = result.finish[w:], result.first_token[w:]
    unserved = np.isnan(finish) | np.isnan(first)
    if unserved.any():
        raise RuntimeError(f"replay of {lg['label']}: {int(unserved.sum())} requests were not served to the end")
    off = WARM_OFFSET_S
    return Timeline(result.trace.arrival[w:] - off, first - off, finish - off, result.num_output[w:]), result


def run_policy(lg: dict) -> str:
    """The queue order a run was served under (logs from before the policy was recorded: "fcfs")."""
    return lg.get("scheduler", {}).get("policy", "fcfs")


def run_name(lg: dict) -> str:
    """A run's label, with its policy when that is not FCFS (two runs of one label may differ in it)."""
    policy = run_policy(lg)
    return lg["label"] if policy == "fcfs" else f"{lg['label']} ({policy})"


def compare(lg: dict, profile: CostProfile, profile_path: Path, in_sample: bool) -> dict:
    """Simulated against measured throughput and p50 TTFT of one run (``in_sample``: the profile was fit
    on it)."""
    timeline, _ = replay(lg, profile_path)
    sim = serving_metrics(timeline, np.asarray(lg["requests"]["input"]))
    meas = lg["measured"]
    tput = sim["output_tokens_per_s"] / meas["output_tokens_per_s"]
    ttft = sim["ttft_p50_s"] / meas["ttft_p50_s"] if meas["ttft_p50_s"] else float("nan")
    return {"bench": "serve", "row": "calibration", "setup": lg["setup"], "label": lg["label"],
            "model": lg["model_key"], "policy": run_policy(lg), "profile": profile.name,
            "fit_on_this_run": in_sample,
            "measured_output_tokens_per_s": meas["output_tokens_per_s"],
            "sim_output_tokens_per_s": sim["output_tokens_per_s"], "throughput_ratio": round(tput, 4),
            "measured_ttft_p50_s": meas["ttft_p50_s"], "sim_ttft_p50_s": sim["ttft_p50_s"],
            "ttft_p50_ratio": round(ttft, 4),
            "throughput_within_target": abs(tput - 1) <= THROUGHPUT_TOLERANCE,
            "ttft_p50_within_target": abs(ttft - 1) <= TTFT_TOLERANCE,
            "measured_ttft_p99_s": meas["ttft_p99_s"], "sim_ttft_p99_s": sim["ttft_p99_s"]}


def what_if(lg: dict, profile: CostProfile, profile_path: Path, scheduler: dict) -> dict:
    """A measured run replayed twice with ``profile``: under its own scheduler settings and with ``scheduler``
    (`SchedulerConfig` fields) over them — the simulator's prediction of what those settings change, on the real
    scheduler.  ``mean_batch_adapters``: distinct adapters a step, over the steps that ran a batch;
    ``policy`` / ``affinity_max_wait_s``: as the replay's scheduler had them."""
    row = {"bench": "serve", "row": "what-if", "setup": lg["setup"], "label": lg["label"], "model": lg["model_key"],
           "profile": profile.name, "scheduler": scheduler,
           "measured_output_tokens_per_s": lg["measured"]["output_tokens_per_s"]}
    for tag, settings in (("own", None), ("new", scheduler)):
        timeline, result = replay(lg, profile_path, settings)
        sim = serving_metrics(timeline, np.asarray(lg["requests"]["input"]))
        config = result.config.scheduler
        row |= {f"{tag}_output_tokens_per_s": sim["output_tokens_per_s"], f"{tag}_ttft_p50_s": sim["ttft_p50_s"],
                f"{tag}_ttft_p99_s": sim["ttft_p99_s"],
                f"{tag}_mean_batch_adapters": round(result.scheduled_adapters / max(result.steps, 1), 3),
                f"{tag}_policy": config.policy, f"{tag}_affinity_max_wait_s": config.affinity_max_wait_s}
    row["throughput_change"] = round(row["new_output_tokens_per_s"] / row["own_output_tokens_per_s"], 4)
    return row
