"""benchmarks/host_steps.py's timers on the CPU: an eager stand-in plays the decode graphs, so that every
phase of a decode step runs and is timed (the figures themselves need CUDA)."""

from __future__ import annotations

import os
import sys

import engine_support as es
import pytest
from unipage.scheduler import Request, SamplingParams

from unipage.config import PoolConfig
from unipage.engine import Engine
from unipage.step_inputs import host_batch, upload

import unipage.runner as runner_module

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import host_steps  # noqa: E402


class EagerInputs:
    def __init__(self) -> None:
        self.filled = 0

    def fill(self, seqs, bucket: int) -> None:
        self.filled += 1


class EagerDecode:
    """`DecodeGraphs.accepts` / `run` run eagerly, its `inputs.fill` counted."""

    def __init__(self, runner) -> None:
        self.runner, self.inputs = runner, EagerInputs()

    def accepts(self, num_scheduled, tables, slots=()) -> bool:
        return all(n == 1 for n in num_scheduled)

    def run(self, seqs):
        self.inputs.fill(seqs, len(seqs))
        r = self.runner
        batch = upload(host_batch(seqs, [1] * len(seqs), r.block_tokens), r.upload)
        return r.model.hidden_states(batch, r.pool, r.lora, r.block_tokens)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return es.qwen3_moe(tmp_path_factory.mktemp("moe"))


def test_every_phase_of_a_decode_step_is_timed(moe, monkeypatch):
    monkeypatch.setattr(runner_module, "sample_tokens", runner_module.sample_tokens)  # HostClock wraps it: restored after
    engine = Engine(moe.model_dir, device="cpu", pool=PoolConfig(num_pages=512))
    engine.add_adapter("a", moe.adapters["fused-r4"])
    engine.runner.graphs = EagerDecode(engine.runner)
    clock = host_steps.HostClock(engine)
    for i, adapter in enumerate(["a", None, "a"]):
        engine.add_request(Request(f"r{i}", [1 + i, 2, 3], adapter, SamplingParams(temperature=0), max_tokens=12))
    for _ in range(3):  # the load, then the prefill
        engine.step()
    row = host_steps.measure(engine, clock, 5)
    assert row["steps"] == 4 and engine.runner.graphs.inputs.filled >= 5
    phases = row["phases_us"]
    assert set(phases) == set(host_steps.PHASES)
    for phase in ("schedule", "update", "drop", "admit", "refresh", "accepts", "fill_rows", "graph_run", "logits",
                  "sample", "poll", "watch"):
        assert phases[phase] > 0, phase
    assert phases["mark_step"] == 0  # no load in flight: no fence
    assert 0 < row["exposed_us"] and row["pre_launch_us"] < row["step_us"]
    assert phases["graph_run"] >= phases["fill_rows"]


def test_it_needs_decode_graphs(moe):
    engine = Engine(moe.model_dir, device="cpu", pool=PoolConfig(num_pages=512))
    with pytest.raises(SystemExit, match="decode graphs"):
        host_steps.HostClock(engine)
