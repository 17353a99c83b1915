"""benchmarks/kernels_lora.py's tuner bookkeeping (CPU): what a re-tune writes into a token bucket."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import kernels_lora as kl


def test_a_retune_keeps_the_settings_it_does_not_search():
    """The stacked expand's column tile was set from the engine's A/B runs, not by the tuner: a new tuning of
    the bucket replaces what it searched (block_n, the shrink's warps) and keeps the rest."""
    old = {"shrink_warps": 8, "block_n": 512, "stacked_block_n": 128}
    new = {"block_n": 256}
    assert "stacked_block_n" not in kl.SEARCH and "block_n" in kl.SEARCH
    assert kl.kept_overrides(old, new) == {"stacked_block_n": 128, "block_n": 256}
    assert kl.kept_overrides({}, new) == new
