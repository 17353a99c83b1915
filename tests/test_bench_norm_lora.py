"""benchmarks/kernels_norm_lora.py on CPU (Triton interpreter, fp16, two layers): its set-up and the result
check it reports (the timings need a GPU)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import kernels_norm_lora as knl


def test_fused_matches_the_two_launches_it_replaces():
    s = knl.setup("qwen3-30b-a3b o", 10, layers=2, device="cpu", dtype=torch.float16)
    assert len(s["layers"]) == 2 and s["n"] == 2048 and s["bytes"] > 4 * 10 * 2048 * 2
    assert knl.max_rel_diff(s) < 2e-3
    layer = s["layers"][1]
    plain = knl.add_rms_norm(layer[0], layer[1][:, :s["n"]], layer[2], knl.EPS)[0]
    assert not torch.equal(knl.fused(s, layer)[0], plain)  # the LoRA delta is there
