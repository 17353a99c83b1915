"""benchmarks/graph_launch.py's generated kernels on the CPU (Triton interpreter): each launch of a case
adds one, whatever its argument count and kinds (the timings themselves need CUDA)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import graph_launch  # noqa: E402


@pytest.mark.parametrize("kind, count", [("torch_add", 0), ("triton_args2", 2), ("triton_args48", 48),
                                         ("triton_args48_ints", 48)])
def test_each_launch_adds_one(kind, count):
    buf = torch.zeros(64)
    one = graph_launch._launches(kind, count, False, buf)
    one()
    one()
    assert buf[0].item() == 2.0
