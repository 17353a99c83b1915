"""Shared by the CPU benchmarks: how fast this machine runs Python, to compare records across machines,
and the commit a record was measured at."""

from __future__ import annotations

import os
import subprocess
import time


def commit(paths: tuple[str, ...] = ()) -> str:
    """The checkout's commit, with "+dirty" when tracked files (under ``paths``, if given) differ from it
    ("" outside git)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no", "--", *paths],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+dirty" if dirty else "")


def calibrate() -> float:
    """Nanoseconds per iteration of ``for i in range(n): x += i`` (the best of five runs)."""
    best = float("inf")
    for _ in range(5):
        x, start = 0, time.perf_counter()
        for i in range(1_000_000):
            x += i
        best = min(best, time.perf_counter() - start)
    return best * 1e3
