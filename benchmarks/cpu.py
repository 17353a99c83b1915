"""Shared by the CPU benchmarks: how fast this machine runs Python, to compare records across machines."""

from __future__ import annotations

import time


def calibrate() -> float:
    """Nanoseconds per iteration of ``for i in range(n): x += i`` (the best of five runs)."""
    best = float("inf")
    for _ in range(5):
        x, start = 0, time.perf_counter()
        for i in range(1_000_000):
            x += i
        best = min(best, time.perf_counter() - start)
    return best * 1e3
