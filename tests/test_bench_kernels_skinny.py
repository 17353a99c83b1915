"""benchmarks/kernels_skinny.py on CPU: what its tuner writes into configs/skinny.json (timing needs a GPU)."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import kernels_skinny as ks

O_KEY = "bfloat16/2880x4096"  # "gpt-oss-20b o"


def row(tokens, best_us, linear_us, block_n=32):
    best = ks.SKINNY | {"block_n": block_n, "split_k": 2, "swap": True}
    return {"shape": "gpt-oss-20b o", "tokens": tokens, "best_us": best_us, "linear_us": linear_us, "best": best}


def saved(tmp_path, rows, before=None):
    path = tmp_path / "skinny.json"
    path.write_text(json.dumps({"_doc": "kept", "tuned": {"gpu": before or {}}}))
    ks.save(rows, "gpu", path)
    data = json.loads(path.read_text())
    assert data["_doc"] == "kept"
    return data["tuned"]["gpu"]


def test_entry_up_to_the_largest_count_won_at_every_count(tmp_path):
    table = saved(tmp_path, [row(1, 5.0, 6.0, 16), row(16, 10.0, 12.0, 32), row(64, 11.9, 12.0, 64)])
    assert table[O_KEY] == {"block_n": 32, "block_k": 256, "split_k": 2, "num_warps": 4, "num_stages": 4,
                            "swap": True, "max_tokens": 16}  # 64 rows: under the margin


def test_no_entry_where_the_kernel_lost_at_the_smallest_count(tmp_path):
    table = saved(tmp_path, [row(1, 6.0, 6.0), row(16, 9.0, 12.0)], before={O_KEY: {"max_tokens": 16}, "x": {}})
    assert table == {"x": {}}  # the shape's old entry dropped, others kept
