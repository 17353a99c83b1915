"""benchmarks/kernels_moe.py's tuner bookkeeping (CPU): how tuned "lora" entries go into a config table,
and joint candidates of the coordinate descent."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import kernels_moe as km

OLD = [{"max_load": 1.0, "old": 0}, {"max_load": 2.0, "old": 1}, {"max_load": 5.0, "old": 2},
       {"max_load": 1e12, "old": 3}]


def _served(table, load):
    return next(e for e in table if load <= e["max_load"])


def test_tuned_entries_replace_only_their_loads():
    table = km._merged(OLD, [(1.5, {"new": 0}), (1.8, {"new": 1})])
    assert [e.get("old", e.get("new")) for e in table] == [0, 0, 1, 2, 3]
    assert _served(table, 0.9)["old"] == 0 and _served(table, 1.2)["new"] == 0
    assert _served(table, 1.7)["new"] == 1 and _served(table, 2.0)["new"] == 1  # up to the old bucket's end
    assert _served(table, 3.0)["old"] == 2 and _served(table, 1e6)["old"] == 3


def test_tuned_entries_at_the_ends_and_without_a_table():
    assert [e.get("old", e.get("new")) for e in km._merged(OLD, [(0.5, {"new": 0})])] == [0, 1, 2, 3]
    assert km._merged(OLD, [(0.5, {"new": 0})])[0] == {"new": 0, "max_load": 1.0}
    assert [e.get("old", e.get("new")) for e in km._merged(OLD, [(6.0, {"new": 0})])] == [0, 1, 2, 0]
    assert km._merged([], [(6.0, {"new": 0}), (2.0, {"new": 1})]) == [
        {"new": 1, "max_load": 12 ** 0.5}, {"new": 0, "max_load": 1e12}]


def test_a_dict_candidate_is_merged_into_its_stage():
    entry = {"down": {"block_n": 2048, "num_warps": 4}, "pdl": True}
    got = km._with(entry, "down", {"sum": True, "block_n": 64})
    assert got == {"down": {"block_n": 64, "num_warps": 4, "sum": True}, "pdl": True}
    assert entry["down"] == {"block_n": 2048, "num_warps": 4}  # the start entry is untouched
    assert km._with(entry, "down.num_warps", 8)["down"]["num_warps"] == 8


def test_sum_candidates_only_in_pair_mode_and_narrow():
    pair = {"block_m": 1, "down": {"block_n": 2048}}
    assert km._candidate(pair, "down", {"sum": True, "block_n": 128})["down"] == {"block_n": 128, "sum": True}
    assert km._candidate(pair, "down", {"sum": True}) is None  # 2048 columns of K x rank rows
    assert km._candidate(pair, "down.block_n", 2048) is None  # the entry itself
    group = {"block_m": 16, "down": {"block_n": 256}}
    assert km._candidate(group, "down", {"sum": False}) is None  # no sum in group mode: the same entry
    summing = {"block_m": 1, "down": {"block_n": 64, "sum": True}}
    assert km._candidate(summing, "block_m", 16) == {"block_m": 16, "down": {"block_n": 64}}


def test_whole_k_candidates_only_in_group_mode():
    pair = {"block_m": 1, "shrink": {"num_warps": 4}, "down": {"block_n": 2048}}
    assert km._candidate(pair, "shrink.whole_k", True) is None  # pair mode loads whole splits anyway
    joint = km._candidate(pair, "", {"block_m": 16, "shrink": {"whole_k": True}})
    assert joint == {"block_m": 16, "shrink": {"num_warps": 4, "whole_k": True}, "down": {"block_n": 2048}}
    assert km._candidate(joint, "block_m", 1) == pair  # back to pair mode: the flag goes
    assert km._candidate(joint, "shrink.whole_k", False)["shrink"] == {"num_warps": 4, "whole_k": False}
    assert pair["shrink"] == {"num_warps": 4}  # the start entry is untouched


def test_descent_skips_what_is_not_worth_timing(monkeypatch):
    timed = []

    def time_fn(entry):
        timed.append(entry)

    monkeypatch.setattr(km, "time_graph", lambda fn, iters: fn() or 1.0)
    start = {"block_m": 16, "down": {"block_n": 256}}
    km.descend(start, [("down", [{"sum": False}, {"sum": True, "block_n": 64}]), ("down.block_n", [128, 256])],
               time_fn)
    assert [e["down"] for e in timed] == [{"block_n": 256}, {"block_n": 64}, {"block_n": 128}]
