"""Sweeps: one config, a grid of overrides (policies x pool sizes x rates x ...), run on several cores.

Every grid point is validated before any runs.  Points run in worker
processes (`multiprocessing`), each returning its record as a JSON line;
records come back in grid order whatever order the workers finish in, so a
sweep's output is deterministic.  A point that fails with bad input (e.g. a
pool too small for the workload's longest request) fails the sweep with that
point named, and nothing is written.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import sys
import time
from pathlib import Path

from unipage.sim.config import OVERRIDES, apply_overrides, build_config
from unipage.sim.errors import SimInputError, SimulationError


def grid(axes: dict[str, list]) -> list[dict]:
    """Every combination of the axes' values (keys of `unipage.sim.config.OVERRIDES`), in a fixed order."""
    for key in axes:
        if key not in OVERRIDES:
            raise SimInputError(f"cannot sweep over {key!r}; choose from {sorted(OVERRIDES)}")
    keys = [k for k, values in axes.items() if values]
    return [dict(zip(keys, combo)) for combo in itertools.product(*(axes[k] for k in keys))]


def describe(point: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items()) or "(base config)"


def run_point(raw: dict, base_dir: Path, where: str, point: dict) -> str:
    """Run one grid point; its record as a JSON line."""
    from unipage.sim.engine import simulate
    from unipage.sim.metrics import dumps, make_record

    config = build_config(apply_overrides(raw, point), base_dir, where)
    return dumps(make_record(simulate(config)))


def _worker(args) -> tuple[int, str, str]:
    """(index, record line, error): errors come back as text so the parent decides what to do."""
    index, raw, base_dir, where, point = args
    try:
        return index, run_point(raw, base_dir, where, point), ""
    except SimInputError as err:
        return index, "", f"input: {err}"
    except Exception as err:  # noqa: BLE001 - reported with the point's name, then re-raised by the parent
        return index, "", f"crash: {type(err).__name__}: {err}"


class Progress:
    """A progress bar on stderr (a line per point when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool = True, stream=None) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        if self.tty:
            filled = int(30 * self.done / self.total)
            self.stream.write(f"\r[{'#' * filled}{'-' * (30 - filled)}] {self.done}/{self.total} "
                              f"{elapsed:6.1f}s elapsed, ~{eta:.0f}s left ")
            if self.done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(f"sweep {self.done}/{self.total} ({elapsed:.1f}s, ~{eta:.0f}s left): {what}\n")
        self.stream.flush()


def sweep(raw: dict, base_dir: Path, axes: dict[str, list], jobs: int = 0, where: str = "config",
          progress: bool = True) -> list[str]:
    """Run the grid; the records' JSON lines in grid order.  ``jobs`` = 0: one per core."""
    points = grid(axes)
    for point in points:  # validate everything before running anything
        try:
            build_config(apply_overrides(raw, point), base_dir, where)
        except SimInputError as err:
            raise SimInputError(f"sweep point {describe(point)}: {err}") from None
    jobs = min(jobs or os.cpu_count() or 1, len(points))
    tasks = [(i, raw, base_dir, where, p) for i, p in enumerate(points)]
    bar = Progress(len(points), progress)
    lines: list[str] = [""] * len(points)

    def take(index: int, line: str, error: str) -> None:
        if error:
            kind, _, message = error.partition(": ")
            cls = SimInputError if kind == "input" else SimulationError
            raise cls(f"sweep point {describe(points[index])}: {message}")
        lines[index] = line
        bar.step(describe(points[index]))

    if jobs <= 1:
        for task in tasks:
            take(*_worker(task))
        return lines
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with context.Pool(jobs) as pool:
        for result in pool.imap_unordered(_worker, tasks):
            take(*result)
    return lines
