"""benchmarks/lora_breakdown.py on CPU: its MoE LoRA A/B's config overrides and flags (the run itself needs a GPU)."""

from __future__ import annotations

import copy
import os
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import lora_breakdown as lb
from unipage.kernels import moe_lora_plan
from unipage.kernels.moe_align import shape_key

QWEN3 = shape_key(2048, 768, 128, 8)


def test_overrides_reach_every_entry_and_leave_the_table_alone():
    lookup = moe_lora_plan.launch_config
    before = copy.deepcopy(lookup("lora", QWEN3, 1.6, ("nvidia_h200",)))
    new = lb.overridden(lookup, {"split_k": 8, "gate_up.block_n": 64})
    got = new("lora", QWEN3, 1.6, ("nvidia_h200",))
    assert got["split_k"] == 8 and got["gate_up"]["block_n"] == 64 != before["gate_up"]["block_n"]
    assert got["gate_up"]["num_warps"] == before["gate_up"]["num_warps"]  # the rest of the stage kept
    assert lookup("lora", QWEN3, 1.6, ("nvidia_h200",)) == before  # the cached tuned entry is untouched
    assert new("lora", QWEN3, 1e9, ("nvidia_h200",))["split_k"] == 8  # group entries too


def test_bad_moe_ab_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        lb.main(["--moe-ab", "{"])
    assert exc.value.code == 2 and "not JSON" in capsys.readouterr().err


def test_max_adapters_below_the_adapters_served_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        lb.main(["--adapters", "4", "--max-adapters", "2"])
    assert exc.value.code == 2 and "--max-adapters must be >= --adapters (4), got 2" in capsys.readouterr().err


def test_negative_moe_stack_entries_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        lb.main(["--shape", "qwen3-30b-a3b", "--moe-stack-entries", "-1"])
    assert exc.value.code == 2 and "--moe-stack-entries must be >= 0, got -1" in capsys.readouterr().err


def test_resident_adapters_spread_and_bounded(capsys):
    """``--resident``: the runs use ``--adapters`` of them, spread over their slots; fewer is refused."""
    assert lb.spread([f"a{i}" for i in range(16)], 4) == ["a0", "a4", "a8", "a12"]
    assert lb.spread(["a0", "a1"], 2) == ["a0", "a1"]
    with pytest.raises(SystemExit) as exc:
        lb.main(["--adapters", "4", "--resident", "3"])
    assert exc.value.code == 2 and "--resident must be >= --adapters (4), got 3" in capsys.readouterr().err


def test_dense_ab_overlays_every_dense_config_and_restores_the_lookup(monkeypatch):
    """`dense_ab` sets its keys over every config the dense LoRA kernels look up (a tuned entry's too), then
    puts the lookup back; the A-B-A timing itself is stood in for (it needs a GPU engine)."""
    from unipage.kernels import lora_plan

    seen, dropped = [], []
    lookup = lora_plan.launch_config
    monkeypatch.setattr(lb.lora_plan, "launch_config", lambda *a: {"block_n": 512, "expand_warps": 4})

    def a_b_a(engine, args, name, change, restore):
        for apply in (change, restore):
            apply()
            seen.append(lora_plan.launch_config("meta", "batch", "dtype", "device"))
        return {}

    monkeypatch.setattr(lb, "_a_b_a", a_b_a)
    monkeypatch.setattr(lb, "_drop_graphs", lambda engine: dropped.append(engine))
    stub = lb.lora_plan.launch_config
    out = lb.dense_ab("engine", SimpleNamespace(dense_ab={"block_n": 128}))
    assert seen == [{"block_n": 128, "expand_warps": 4}, {"block_n": 512, "expand_warps": 4}]
    assert out["overrides"] == {"block_n": 128} and dropped == ["engine", "engine"]
    assert lb.lora_plan.launch_config is stub  # the lookup put back
    # (that the kernels see a lookup set there: test_kernel_lora_stack's own-column-tile test)
    monkeypatch.undo()
    assert lora_plan.launch_config is lookup


def test_skinny_ab_turns_the_kernel_off_then_back(monkeypatch):
    """`skinny_ab`: `skinny.linear` on F.linear everywhere (graphs dropped), then the kernel again."""
    from unipage.kernels import skinny

    seen, dropped = [], []

    def a_b_a(engine, args, name, change, restore):
        for apply in (change, restore):
            apply()
            seen.append(skinny.ENABLED)
        return {}

    monkeypatch.setattr(lb, "_a_b_a", a_b_a)
    monkeypatch.setattr(lb, "_drop_graphs", lambda engine: dropped.append(engine))
    lb.skinny_ab("engine", None)
    assert seen == [False, True] and dropped == ["engine", "engine"] and skinny.ENABLED


def test_a_b_a_restores_when_the_changed_run_fails(monkeypatch):
    calls = []

    def failing(engine, args):
        raise RuntimeError("step failed")

    monkeypatch.setattr(lb, "_warm_times", failing)
    with pytest.raises(RuntimeError, match="step failed"):
        lb._a_b_a("engine", None, "other", lambda: calls.append("change"), lambda: calls.append("restore"))
    assert calls == ["change", "restore"]


def test_decode_tokens_cover_every_a_b_a(monkeypatch):
    """A request of the timed run must outlast every step of it: with each A-B-A asked for, the steps are
    counted on a stand-in engine (before, a run with two A-B-As outran its requests' max_tokens)."""
    steps = []
    engine = SimpleNamespace(step=lambda: steps.append(1), model=SimpleNamespace(stack="stack"))
    graphs = SimpleNamespace(piece_layers=0, set_piece_layers=lambda n: None, drop=lambda: None)
    engine.runner = SimpleNamespace(graphs=graphs, mixed=None, stack="stack")

    def stepping(result):
        def run(engine, n, *rest):
            for _ in range(n):
                engine.step()
            return result
        return run

    monkeypatch.setattr(lb, "timed", stepping((0.01, 0.001, 0.001, 0.001)))
    monkeypatch.setattr(lb, "busy_wait", stepping((0.01, 0)))
    args = SimpleNamespace(warmup_steps=12, timed_steps=5, steps=3, piece_layers=4, linear_ab=True,
                           stack_ab=True, moe_ab={"split_k": 8}, dense_ab={"block_n": 128}, skinny_ab=True, running=16,
                           prompt=1600, budget=4096)  # (warm-ups weigh enough that leaving them out fails)
    lb._timed_run(engine, args, ["a0"])
    assert len(steps) + args.warmup_steps < lb.decode_tokens(args)
    none = SimpleNamespace(**{**vars(args), "piece_layers": 0, "linear_ab": False, "stack_ab": False,
                              "moe_ab": None, "dense_ab": None, "skinny_ab": False})
    assert lb.decode_tokens(none) < len(steps)  # fewer A-B-As, fewer tokens
