"""benchmarks/kernels_moe.py's tuner bookkeeping (CPU): how tuned "lora" entries go into a config table,
and joint candidates of the coordinate descent; and `ncu_moe_lora`'s rows from an ncu CSV."""

from __future__ import annotations

import argparse
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import kernels_moe as km
from unipage.kernels import moe_lora_plan

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
    got = km.with_path(entry, "down", {"sum": True, "block_n": 64})
    assert got == {"down": {"block_n": 64, "num_warps": 4, "sum": True}, "pdl": True}
    assert entry["down"] == {"block_n": 2048, "num_warps": 4}  # the start entry is untouched
    assert km.with_path(entry, "down.num_warps", 8)["down"]["num_warps"] == 8


def test_sum_candidates_in_any_mode_and_narrow():
    pair = {"block_m": 1, "down": {"block_n": 2048}}
    assert km._candidate(pair, "down", {"sum": True, "block_n": 128})["down"] == {"block_n": 128, "sum": True}
    assert km._candidate(pair, "down", {"sum": True}) is None  # 2048 columns of K x rank rows
    assert km._candidate(pair, "down.block_n", 2048) is None  # the entry itself
    group = {"block_m": 16, "down": {"block_n": 256}}
    assert km._candidate(group, "down", {"sum": False}) is None  # "sum": false is the entry itself
    assert km._candidate(group, "down", {"sum": True, "block_n": 64})["down"] == {"block_n": 64, "sum": True}
    summing = {"block_m": 1, "down": {"block_n": 64, "sum": True}}
    assert km._candidate(summing, "block_m", 16) == {"block_m": 16, "down": {"block_n": 64, "sum": True}}
    assert km._candidate(summing, "down", {"sum": False}) == {"block_m": 1, "down": {"block_n": 64}}


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
    assert [e["down"] for e in timed] == [{"block_n": 256}, {"block_n": 64, "sum": True}, {"block_n": 128}]


def test_one_warp_gate_up_is_tried_with_a_narrower_tile():
    entry = {"block_m": 1, "gate_up": {"block_n": 256, "num_warps": 4, "num_stages": 2}}
    joint = [value for path, values in km.LORA_SPACE if path == "gate_up" for value in values]
    assert {"block_n": 128, "num_warps": 1} in joint
    got = km._candidate(entry, "gate_up", {"block_n": 128, "num_warps": 1})
    assert got["gate_up"] == {"block_n": 128, "num_warps": 1, "num_stages": 2}
    assert all(1 in values for path, values in km.LORA_SPACE if path.endswith("num_warps"))


def test_split_variants_must_be_json_objects():
    assert km.overrides_arg('{"gate_up.num_warps": 1}') == {"gate_up.num_warps": 1}
    for bad in ("{", "[1]", "{}", "3"):
        with pytest.raises(argparse.ArgumentTypeError):
            km.overrides_arg(bad)


def _tiny(monkeypatch, ran: list) -> dict:
    """A toy layer on CPU (the interpreter), with a stand-in timer that runs each timed call once."""
    tiny = {"hidden": 64, "inter": 64, "experts": 4, "top_k": 2, "rank": 8}
    monkeypatch.setitem(km.SHAPES, "tiny", tiny)
    monkeypatch.setattr(km, "DEVICE", "cpu")
    monkeypatch.setattr(km, "DTYPE", torch.float32)
    monkeypatch.setattr(km, "PAGE_ELEMS", 256)
    monkeypatch.setattr(km, "ADAPTERS", 2)
    monkeypatch.setattr(km, "time_graph", lambda fn, iters: (ran.append(fn), fn(), 2e-6)[-1])
    return km.setup("tiny")


def test_split_times_each_pass_with_the_overrides(monkeypatch):
    """`split_row` on a toy layer in the interpreter: the overrides reach the config the passes run with, and
    every pass runs (a stand-in timer calls each once)."""
    ran = []
    s = _tiny(monkeypatch, ran)
    row = km.split_row("tiny", s, 4, {"gate_up.num_warps": 1, "split_k": 2})
    assert row["config"]["gate_up"]["num_warps"] == 1 and row["config"]["split_k"] == 2
    assert row["overrides"] == {"gate_up.num_warps": 1, "split_k": 2}
    passes = ("shrink", "gate_up_pass", "down_pass", "all", "topk_sum", "moe_lora", "base")
    assert [row[f"{k}_us"] for k in passes] == [2.0] * len(passes)
    assert len(ran) == len(passes)


def test_fused_min_tokens_in_rows_and_tuning(monkeypatch):
    """An entry that fuses from more tokens than a row has: `measure` labels the row with the path the engine
    takes there (separate); a ``--split`` variant that sets "fused" takes it at any count unless it sets
    "fused_min_tokens" too; the tuner (which times the separate pass) starts without the fused keys."""
    ran = []
    s = _tiny(monkeypatch, ran)
    entry = {**km.lora_config(km.batch(s, 4)["lora"], km.batch(s, 4)["topk_ids"]),
             "fused": True, "lora_k": 32, "lora_steps": 1, "fused_min_tokens": 8}
    monkeypatch.setattr(km, "lora_config", lambda *args: entry)
    assert km.measure(s, 4, 1e9, 1e9)["lora_path"] == "separate"
    assert km.split_row("tiny", s, 4, {"fused": True})["config"]["fused_min_tokens"] == 0
    assert km.split_row("tiny", s, 4, {"fused": True, "fused_min_tokens": 4})["config"]["fused_min_tokens"] == 4
    assert km.split_row("tiny", s, 4, {"split_k": 2})["config"]["fused_min_tokens"] == 8
    starts = []
    monkeypatch.setattr(km, "descend", lambda start, space, fn: (starts.append(start), (start, 1e-6))[1])
    km._tune_shape(s, [4], lambda kind, entries: None, stages=("lora",))
    assert starts and not set(km.FUSED_KEYS) & set(starts[0]) and starts[0]["split_k"] == entry["split_k"]


def test_active_slots_bound_picks_the_entry(monkeypatch):
    """``--active-slots``: the MoeLora's bound (a graph's adapter class) is set on every batch, picks the tuned
    entry by its load, goes into the rows, and may not be below the adapters."""
    s = _tiny(monkeypatch, [])
    for name in ("ADAPTERS", "SLOT_ORDER", "ACTIVE", "SLOT_IDS"):
        monkeypatch.setattr(km, name, getattr(km, name))  # (configure sets them: undone after the test)
    km.configure(2, slot_order="sorted", active=16)
    assert km.batch(s, 4)["lora"].active_slots == 16
    seen = []
    monkeypatch.setattr(moe_lora_plan, "launch_config", lambda kind, shape, load, devices: seen.append(load) or {})
    km.lora_config(km.batch(s, 4)["lora"], km.batch(s, 4)["topk_ids"])
    assert seen == [km.expected_load(4 * 2, 16 * 4)]  # T·K pairs over 16 slots of 4 experts, not 2 slots
    with open(os.devnull, "w") as out:
        row = km._emit({"row": "x"}, out)
    assert row["active_slots"] == 16 and row["slot_order"] == "sorted"  # every row says both
    km.configure(2)
    assert km.batch(s, 4)["lora"].active_slots == 2
    with pytest.raises(ValueError, match="below"):
        km.configure(4, active=3)


def test_mixed_slot_order(monkeypatch):
    """``--slot-order mixed``: a mixed step's decodes round-robin over all adapters but the last, then the last
    adapter's prompt; at most half the tokens decode."""
    monkeypatch.setattr(km, "DEVICE", "cpu")
    for name in ("ADAPTERS", "SLOT_ORDER", "ACTIVE", "SLOT_IDS"):
        monkeypatch.setattr(km, name, getattr(km, name))
    km.configure(5, slot_order="mixed")
    slots = km.token_slots(4096).tolist()
    assert slots[:8] == [0, 1, 2, 3, 0, 1, 2, 3] and set(slots[:256]) == {0, 1, 2, 3} and set(slots[256:]) == {4}
    assert km.token_slots(6).tolist() == [0, 1, 2, 4, 4, 4]
    km.configure(1, slot_order="mixed")
    assert km.token_slots(4).tolist() == [0, 0, 0, 0]


def test_slot_ids_scatter_the_adapters_over_the_tables(monkeypatch):
    """``--slot-ids``: adapter i sits at the given slot, the rows between hold no adapter, the rows say so,
    and a batch carries the step's slot ranks (made once, as the engine does) and runs the fused path."""
    ran = []
    for name in ("ADAPTERS", "SLOT_ORDER", "ACTIVE", "SLOT_IDS"):
        monkeypatch.setattr(km, name, getattr(km, name))
    _tiny(monkeypatch, ran)
    km.configure(3, slot_order="mixed", ids=[5, 1, 9])
    s = km.setup("tiny")
    assert s["page_table"].shape[0] == 10 and s["meta"].slot_flags.tolist() == [0, 1, 0, 0, 0, 1, 0, 0, 0, 1]
    assert km.token_slots(6).tolist() == [5, 1, 5, 9, 9, 9]
    b = km.batch(s, 6)
    assert b["lora"].active_slots == 3 and b["lora"].ranks is not None
    row = km.split_row("tiny", s, 6, {"fused": True})
    assert row["moe_lora_us"] > 0
    with open(os.devnull, "w") as out:
        assert km._emit({"row": "x"}, out)["slot_ids"] == [5, 1, 9]
    for bad in ([5, 1], [5, 5, 1], [-1, 2, 3]):
        with pytest.raises(ValueError, match="slot ids"):
            km.configure(3, ids=bad)


def test_ncu_csv_rows(tmp_path):
    """`ncu_moe_lora.parse`: ncu's ``--csv --page details`` lines (after its own log lines) -> one row per
    launch, times in us whatever unit ncu chose, thousands separators dropped, unknown metrics and rule lines
    ignored, raw metrics (``--metrics``) kept by name."""
    import ncu_moe_lora

    head = '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
    lines = ['"0","_moe_shrink_kernel","GPU Speed Of Light Throughput","Duration","ns","17,472"',
             '"0","_moe_shrink_kernel","Launch Statistics","Grid Size","","1,216"',
             '"0","_moe_shrink_kernel","Occupancy","Achieved Occupancy","%","16.96"',
             '"0","_moe_shrink_kernel","WarpStateStats","","",""',
             '"1","_expand_down_kernel","Launch Statistics","Registers Per Thread","register/thread","64"',
             '"1","_expand_down_kernel","GPU Speed Of Light Throughput","Duration","us","20.74"',
             '"1","_expand_down_kernel","Memory Workload Analysis","Mem Busy","%","51.06"',
             '"1","_expand_down_kernel","Command line profiler metrics",'
             '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","","1,234.5"',
             '"1","_expand_down_kernel","Command line profiler metrics","gpu__time_duration.sum","usecond","20.74"',
             '"1","_expand_down_kernel","Command line profiler metrics","sm__x__y.ratio","","n/a"']
    path = tmp_path / "ncu.csv"
    path.write_text("==PROF== Connected to process 582\nconfig {'block_m': 16}\n" + head + "\n".join(lines) + "\n")
    assert ncu_moe_lora.parse(str(path)) == [
        {"kernel": "_moe_shrink_kernel", "us": 17.472, "grid": 1216, "achieved_occupancy_pct": 16.96},
        {"kernel": "_expand_down_kernel", "registers": 64, "us": 20.74,
         "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": 1234.5,  # (raw metrics asked for)
         "gpu__time_duration.sum": 20.74, "gpu__time_duration.sum unit": "usecond", "sm__x__y.ratio": "n/a"}]
    path.write_text(head + '"0","k","GPU Speed Of Light Throughput","Duration","s","1"\n')
    with pytest.raises(ValueError, match="unknown unit"):
        ncu_moe_lora.parse(str(path))


def test_overlap_goes_with_pair_mode():
    """The side-stream overlap (measured slower in pair mode, and not timed by the tuner) leaves an entry that
    the descent takes back to pair mode, and stays with group mode."""
    group = {"block_m": 16, "overlap": True, "down": {"block_n": 256}}
    assert "overlap" not in km._candidate(group, "block_m", 1)
    assert km._candidate(group, "block_m", 32)["overlap"] is True


def test_stack_sweep_parses_its_arguments():
    """benchmarks/kernels_moe_stack.py (GPU only) imports and parses its arguments on the CPU."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "kernels_moe_stack.py"
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--slot-order" in done.stdout, done.stderr
