"""unipage-sim: determinism, conservation, Little's law, the Belady bound, exact event times, the CLI.

Every run here uses the ``tiny`` model preset (16 KiB pages, rank-8 adapters of 4 pages) so that a
simulation takes well under a second.
"""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from unipage.sim import (
    CostProfile,
    SimInputError,
    Simulation,
    build_config,
    make_record,
    simulate,
)
from unipage.sim.cli import main
from unipage.sim.config import read_toml, to_toml
from unipage.sim.engine import FINISHED, ClosedLoop
from unipage.sim.metrics import dumps
from unipage.sim.workload import Trace, choose_adapters, gamma_arrivals, sample_lengths

from unipage.eviction import POLICIES as EVICTION_POLICIES

TINY = {"model": {"preset": "tiny"}, "pool": {"num_pages": 512},
        "workload": {"rate": 20.0, "duration_s": 10.0, "num_adapters": 20, "ranks": [8, 16],
                     "input": {"dist": "uniform", "low": 16, "high": 96},
                     "output": {"dist": "uniform", "low": 4, "high": 48}}}


def tiny(**sections) -> dict:
    raw = json.loads(json.dumps(TINY))
    for name, table in sections.items():
        if isinstance(table, dict):
            raw.setdefault(name, {}).update(table)
        else:
            raw[name] = table
    return raw


# -- properties of a run ---------------------------------------------------------
def test_same_seed_gives_byte_identical_records():
    raw = tiny(seed=7, lora={"eviction_policy": "belady"}, scheduler={"policy": "vtc"})
    first = dumps(make_record(simulate(build_config(raw))))
    second = dumps(make_record(simulate(build_config(raw))))
    assert first == second
    other = dumps(make_record(simulate(build_config(tiny(seed=8)))))
    assert json.loads(other)["ttft_p50_s"] != json.loads(first)["ttft_p50_s"]


@pytest.mark.parametrize("policy,admission,eviction", [("fcfs", "optimistic", "lru"), ("slo", "optimistic", "idle"),
                                                       ("vtc", "reserve", "belady"), ("affinity", "optimistic", "cost")])
def test_every_request_finishes_or_is_aborted_and_the_pool_drains(policy, admission, eviction):
    raw = tiny(pool={"num_pages": 160}, scheduler={"policy": policy, "admission": admission, "slo_ttft_s": 0.2},
               lora={"eviction_policy": eviction, "max_adapters_per_batch": 4}, sim={"check_every": 7})
    sim = Simulation(build_config(raw))
    result = sim.run()
    n = len(result.trace)
    assert n > 150 and not sim.sched.has_unfinished() and not sim.live
    assert set(np.unique(result.status)) <= {0, 1, 2, 3}  # nothing UNFINISHED
    record = make_record(result)
    assert record["finished"] + record["aborted_slo"] + record["aborted_load_failed"] == n
    assert 0 <= record["slo_attainment_cold"] <= 1 and 0 <= record["slo_attainment_hot"] <= 1
    done = result.status == FINISHED
    assert (result.num_output[done] == result.trace.output_tokens[done]).all()  # finished by length, in full
    assert (result.finish[done] >= result.first_token[done]).all()
    assert (result.first_token[done] > result.trace.arrival[done]).all()
    sim.sched.check()
    memory = sim.memory
    assert memory.pool.count(1) == 0  # no KV page held: only cached KV and idle adapters remain
    assert memory.reclaimer.reclaim(memory.reclaimer.evictable_pages)
    assert memory.pool.num_free == memory.pool.num_pages
    if policy == "slo":
        assert record["aborted_slo"] > 0


@pytest.mark.parametrize("step_gap_s", [0.0, 0.003])
def test_littles_law_on_a_steady_workload(tmp_path, step_gap_s):
    """Also with a serving-loop gap between steps (half a step's base time): the requests in the system
    during the gaps count too."""
    raw = tiny(seed=3, workload={"rate": 15.0, "duration_s": 240.0}, pool={"num_pages": 2048})
    if step_gap_s:
        profile = {**build_config(raw).profile.to_dict(), "name": "gap", "step_gap_s": step_gap_s}
        (tmp_path / "gap.json").write_text(json.dumps(profile))
        raw["sim"] = {"profile": "gap.json"}
    record = make_record(simulate(build_config(raw, tmp_path)))
    assert record["aborted_slo"] == 0 and record["little_L"] > 1.0
    assert abs(record["little_L"] - record["little_lambda_W"]) <= 0.05 * record["little_lambda_W"]


def test_belady_hit_ratio_bounds_every_online_policy():
    trace_config = build_config(tiny(seed=11, pool={"num_pages": 96, "prefix_caching": False},
                                     workload={"num_adapters": 40, "ranks": [8], "rate": 6.0, "duration_s": 60.0,
                                               "zipf_s": 0.8}))
    from unipage.sim.workload import synthesize

    trace = synthesize(trace_config)
    hits = {}
    for name in sorted(EVICTION_POLICIES):
        raw = tiny(seed=11, pool={"num_pages": 96, "prefix_caching": False}, lora={"eviction_policy": name},
                   workload={"num_adapters": 40, "ranks": [8], "rate": 6.0, "duration_s": 60.0, "zipf_s": 0.8})
        hits[name] = make_record(simulate(build_config(raw), trace))["adapter_hit_ratio"]
    assert set(hits) >= {"lru", "lfu", "fifo", "size", "cost", "idle", "belady"}
    assert all(hits["belady"] >= h for h in hits.values()), hits
    assert hits["belady"] > hits["lru"] > hits["idle"]


def test_belady_refuses_to_run_without_the_future():
    from unipage.sim.belady import Belady

    from unipage.eviction import Candidate

    with pytest.raises(RuntimeError, match="needs the future"):
        Belady().priority(Candidate("adapter", "a", 4, 0, 0, 0, 0.0))


# -- a scenario checked by hand ----------------------------------------------------
HAND_PROFILE = {"name": "hand", "step_base_s": 0.010, "prefill_token_s": 0.001, "decode_token_s": 0.002,
                "kv_token_read_s": 0.0, "h2d_bytes_per_s": 65536 / 0.02, "disk_bytes_per_s": 57344 / 0.05}


def test_exact_event_times_of_a_hand_checked_scenario(tmp_path):
    """One rank-8 adapter (4 pages = 65,536 bytes; file 57,344 bytes): disk 50 ms + copy 20 ms.

    t=0     r0 (adapter a0, 8 prompt tokens, 3 out) arrives: a0 not resident, its load starts (done 0.07)
    t=0.05  r1 (base model, 4 prompt, 1 out) arrives while idle: prefill 0.010 + 4 * 0.001 -> done 0.064
    t=0.07  a0 loaded: r0 prefill 0.010 + 8 * 0.001 -> first token 0.088; decodes of 0.012 -> 0.100, 0.112
    t=0.2   r2 (a0, 8 prompt, 2 out): a0 resident (a hit): prefill -> 0.218, decode -> 0.230
    """
    (tmp_path / "hand.json").write_text(json.dumps(HAND_PROFILE))
    raw = {"model": {"preset": "tiny"}, "pool": {"num_pages": 64}, "sim": {"profile": "hand.json"},
           "workload": {"num_adapters": 1, "ranks": [8]}}
    config = build_config(raw, tmp_path)
    trace = Trace(np.array([0.0, 0.05, 0.2]), np.array([0, -1, 0], dtype=np.int32),
                  np.array([8, 4, 8], dtype=np.int32), np.array([3, 1, 2], dtype=np.int32),
                  np.zeros(3, dtype=np.int32), ["a0"], [8], ["t0"])
    result = simulate(config, trace)
    assert result.first_token.tolist() == pytest.approx([0.088, 0.064, 0.218], abs=1e-12)
    assert result.finish.tolist() == pytest.approx([0.112, 0.064, 0.230], abs=1e-12)
    assert result.hit.tolist() == [False, False, True]
    assert result.steps == 6 and result.busy_s == pytest.approx(0.014 + 0.018 + 0.024 + 0.018 + 0.012)
    assert result.scheduled_adapters == 5  # every step but r1's (the base model) runs a0
    record = make_record(result)
    assert record["mean_batch_adapters"] == pytest.approx(5 / 6, abs=1e-6)
    assert (record["adapter_loads"], record["bytes_h2d"], record["bytes_disk"]) == (1, 65536, 57344)
    assert record["ttft_p50_s"] == pytest.approx(0.018)  # TTFTs 0.088, 0.014, 0.018
    assert record["duration_s"] == pytest.approx(0.23)


def _hand_run(tmp_path, profile: dict, trace: Trace, closed_loop: ClosedLoop | None = None):
    (tmp_path / "hand.json").write_text(json.dumps({**HAND_PROFILE, **profile}))
    raw = {"model": {"preset": "tiny"}, "pool": {"num_pages": 64}, "sim": {"profile": "hand.json"},
           "workload": {"num_adapters": 2, "ranks": [8, 8]}}
    return simulate(build_config(raw, tmp_path), trace, closed_loop)


@pytest.mark.parametrize("workers, second", [(1, 0.138), (2, 0.108)])
def test_file_reads_run_on_parallel_readers(tmp_path, workers, second):
    """Two cold adapters at t=0, nothing else: reads of 50 ms on ``workers`` readers, then 20 ms copies in
    one queue.  2 readers: both reads end at 0.05, copies 0.05-0.07 and 0.07-0.09, prefills (18 ms) at
    0.07 and 0.09.  1 reader: the second read ends at 0.10, its copy at 0.12."""
    trace = Trace(np.array([0.0, 0.0]), np.array([0, 1], dtype=np.int32), np.array([8, 8], dtype=np.int32),
                  np.array([1, 1], dtype=np.int32), np.zeros(2, dtype=np.int32), ["a0", "a1"], [8, 8], ["t0"])
    result = _hand_run(tmp_path, {"read_workers": workers}, trace)
    assert result.first_token.tolist() == pytest.approx([0.088, second], abs=1e-12)


def test_a_read_done_mid_step_is_copied_after_the_step(tmp_path):
    """r0 (base model, 80 prompt tokens) runs from t=0 while a0's load starts: the step takes 0.010 + 0.080
    + load_s 0.001 = 0.091.  The read ends at 0.05, mid-step: its copy starts at the step's end (the
    engine polls there), 0.091-0.111, and r1's prefill follows, first token at 0.129."""
    trace = Trace(np.array([0.0, 0.0]), np.array([-1, 0], dtype=np.int32), np.array([80, 8], dtype=np.int32),
                  np.array([1, 1], dtype=np.int32), np.zeros(2, dtype=np.int32), ["a0", "a1"], [8, 8], ["t0"])
    result = _hand_run(tmp_path, {"load_s": 0.001}, trace)
    assert result.first_token.tolist() == pytest.approx([0.091, 0.129], abs=1e-12)


@pytest.mark.parametrize("copy_s", [0.0005, 0.001, 0.0015, 0.02])
def test_a_copy_shorter_than_the_polls_host_work_is_reported_by_that_poll(tmp_path, copy_s):
    """The scenario above with a copy of ``copy_s`` from 0.091.  The engine's end-of-step poll starts the
    copy, then reports the copies complete after its host work (load_s 1 ms): its own too when it takes at
    most that, and r1's prefill (18 ms) starts when it ends; a longer one is reported when it ends, the
    engine having nothing else to run.  Either way: 0.091 + copy_s + 0.018, never before the copy ends.  r0's
    token comes with the update after the poll: at 0.091 + copy_s when the poll reported the copy."""
    trace = Trace(np.array([0.0, 0.0]), np.array([-1, 0], dtype=np.int32), np.array([80, 8], dtype=np.int32),
                  np.array([1, 1], dtype=np.int32), np.zeros(2, dtype=np.int32), ["a0", "a1"], [8, 8], ["t0"])
    result = _hand_run(tmp_path, {"load_s": 0.001, "h2d_bytes_per_s": 65536 / copy_s}, trace)
    first = 0.091 + (copy_s if copy_s <= 0.001 else 0.0)
    assert result.first_token.tolist() == pytest.approx([first, 0.091 + copy_s + 0.018], abs=1e-12)


@pytest.mark.parametrize("launch_base_s, launch_token_s, second", [
    (0.0, 0.0, 0.129),  # no launch time: as above
    (0.04, 0.0, 0.129),  # the read runs 0.04-0.09, within the step: copied at its end, as above
    (0.06, 0.0, 0.148),  # the read runs 0.06-0.11, past the step's end: copied 0.11-0.13
    (0.0, 0.00075, 0.148),  # 80 tokens * 0.75 ms: launched at 0.06, as the row above
    (1.0, 0.0, 0.179),  # a launch time past the step's end means its end: read 0.091-0.141
])
def test_a_steps_reads_start_once_its_forward_pass_is_launched(tmp_path, launch_base_s, launch_token_s, second):
    """As in the engine, a step's file reads are submitted once its forward pass is launched, ``launch_base_s
    + launch_token_s * 80`` into the step (0.091 long, as above): the read ends 50 ms after the launch, its
    copy (20 ms) starts at the first poll after that, and r1's prefill (18 ms) follows the copy."""
    trace = Trace(np.array([0.0, 0.0]), np.array([-1, 0], dtype=np.int32), np.array([80, 8], dtype=np.int32),
                  np.array([1, 1], dtype=np.int32), np.zeros(2, dtype=np.int32), ["a0", "a1"], [8, 8], ["t0"])
    result = _hand_run(tmp_path, {"load_s": 0.001, "launch_base_s": launch_base_s,
                                  "launch_token_s": launch_token_s}, trace)
    assert result.first_token.tolist() == pytest.approx([0.091, second], abs=1e-12)


@pytest.mark.parametrize("launch_base_s, launch_token_s, second", [
    (0.005, 0.0005, 0.1345),  # polled at step 2's launch (0.0965): copy 0.0965-0.1165
    (0.0, 0.0, 0.133),  # no launch time: the read (0-0.05) is copied at step 1's end, 0.091-0.111
])
def test_a_read_done_before_a_later_steps_launch_is_copied_within_that_step(tmp_path, launch_base_s,
                                                                            launch_token_s, second):
    """r0 (base model, 80 prompt tokens, 3 out) prefills 0-0.091 and decodes 0.091-0.103, 0.103-0.115; a0's
    read is submitted at step 1's launch (0.005 + 80 * 0.0005 = 0.045) and ends at 0.095, after step 1.
    Step 2's launch (0.091 + 0.0055) polls it, so its copy ends at 0.1165, within step 3; nothing else
    runs after 0.115, so r1's prefill starts when the copy ends.  Polled only at step ends, it would
    start at step 2's end (0.103) and r1's first token come at 0.141."""
    trace = Trace(np.array([0.0, 0.0]), np.array([-1, 0], dtype=np.int32), np.array([80, 8], dtype=np.int32),
                  np.array([3, 1], dtype=np.int32), np.zeros(2, dtype=np.int32), ["a0", "a1"], [8, 8], ["t0"])
    result = _hand_run(tmp_path, {"load_s": 0.001, "launch_base_s": launch_base_s,
                                  "launch_token_s": launch_token_s}, trace)
    assert result.first_token.tolist() == pytest.approx([0.091, second], abs=1e-12)
    assert result.finish[0] == pytest.approx(0.115, abs=1e-12)


def test_a_closed_loop_releases_a_request_at_each_finish(tmp_path):
    """Base-model requests of 4 prompt tokens and 1 output (14 ms each).  r0 arrives at 0 and is not in
    the loop; r1 (trace time 0.5) is the loop's one request in flight; r2 and r3 arrive when the one
    before finishes, whatever their trace times (0.0 here)."""
    trace = Trace(np.array([0.0, 0.5, 0.0, 0.0]), np.full(4, -1, dtype=np.int32), np.full(4, 4, dtype=np.int32),
                  np.ones(4, dtype=np.int32), np.zeros(4, dtype=np.int32), ["a0"], [8], ["t0"])
    result = _hand_run(tmp_path, {}, trace, closed_loop=ClosedLoop(first=1, concurrency=1))
    assert result.trace.arrival.tolist() == pytest.approx([0.0, 0.5, 0.514, 0.528], abs=1e-12)
    assert result.finish.tolist() == pytest.approx([0.014, 0.514, 0.528, 0.542], abs=1e-12)
    with pytest.raises(SimInputError, match="concurrency"):
        ClosedLoop(first=0, concurrency=0)


def test_the_step_gap_comes_after_each_step_that_ran(tmp_path):
    """The loop above with ``step_gap_s`` 3 ms: a request is released when the one before finishes, at the
    step's end, and runs after the gap; idle time absorbs the gap (r1 still starts at its trace time)."""
    trace = Trace(np.array([0.0, 0.5, 0.0, 0.0]), np.full(4, -1, dtype=np.int32), np.full(4, 4, dtype=np.int32),
                  np.ones(4, dtype=np.int32), np.zeros(4, dtype=np.int32), ["a0"], [8], ["t0"])
    result = _hand_run(tmp_path, {"step_gap_s": 0.003}, trace, closed_loop=ClosedLoop(first=1, concurrency=1))
    assert result.trace.arrival.tolist() == pytest.approx([0.0, 0.5, 0.514, 0.531], abs=1e-12)
    assert result.finish.tolist() == pytest.approx([0.014, 0.514, 0.531, 0.548], abs=1e-12)
    with pytest.raises(SimInputError, match="step_gap_s"):
        CostProfile.from_dict({**HAND_PROFILE, "step_gap_s": -1.0})


def test_an_eager_step_costs_its_launches_and_a_decode_step_does_not(tmp_path):
    """``eager_step_s`` 5 ms: the prefill step (4 tokens) 0.010 + 0.004 + 0.005, the decode after it 0.012."""
    trace = Trace(np.array([0.0]), np.full(1, -1, dtype=np.int32), np.full(1, 4, dtype=np.int32),
                  np.full(1, 2, dtype=np.int32), np.zeros(1, dtype=np.int32), ["a0"], [8], ["t0"])
    result = _hand_run(tmp_path, {"eager_step_s": 0.005}, trace)
    assert result.first_token.tolist() == pytest.approx([0.019], abs=1e-12)
    assert result.finish.tolist() == pytest.approx([0.031], abs=1e-12)


def test_a_step_with_lora_tokens_costs_lora_step_s(tmp_path):
    """``lora_step_s`` 4 ms: r0 (base model, 4 prompt, 2 out) is not charged it: 0.014, then 0.012; r1 (a0, 8
    prompt, 2 out, at t=1: its load 1.0-1.07) is: prefill 0.018 + 0.004 -> 1.092, decode 0.012 + 0.004."""
    trace = Trace(np.array([0.0, 1.0]), np.array([-1, 0], dtype=np.int32), np.array([4, 8], dtype=np.int32),
                  np.array([2, 2], dtype=np.int32), np.zeros(2, dtype=np.int32), ["a0", "a1"], [8, 8], ["t0"])
    result = _hand_run(tmp_path, {"lora_step_s": 0.004}, trace)
    assert result.first_token.tolist() == pytest.approx([0.014, 1.092], abs=1e-12)
    assert result.finish.tolist() == pytest.approx([0.026, 1.108], abs=1e-12)


def test_bad_read_workers(tmp_path):
    with pytest.raises(SimInputError, match="read_workers"):
        CostProfile.from_dict({**HAND_PROFILE, "read_workers": 0})


# -- workloads ----------------------------------------------------------------------
def test_gamma_arrivals_have_the_asked_rate_and_cv():
    rng = np.random.default_rng(0)
    for cv in (1.0, 4.0):
        gaps = np.diff(gamma_arrivals(rng, 200_000, rate=5.0, cv=cv))
        assert gaps.mean() == pytest.approx(0.2, rel=0.03)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_popularity_models():
    cfg = build_config(tiny(workload={"num_adapters": 100, "popularity": "zipf", "zipf_s": 1.2}))
    zipf = np.bincount(choose_adapters(np.random.default_rng(0), 100_000, cfg.workload), minlength=100)
    assert zipf[0] > zipf[1] > zipf[10] > zipf[99] and zipf[0] / zipf[1] == pytest.approx(2 ** 1.2, rel=0.05)
    cfg = build_config(tiny(workload={"num_adapters": 100, "popularity": "power", "power_alpha": 0.1}))
    power = choose_adapters(np.random.default_rng(1), 100_000, cfg.workload)
    expect = (np.random.default_rng(1).power(0.1, 100_000) * 100).astype(int)  # S-LoRA's formula
    assert (power == expect).all()
    cfg = build_config(tiny(workload={"num_adapters": 10, "popularity": "uniform", "base_fraction": 0.25}))
    uniform = choose_adapters(np.random.default_rng(2), 100_000, cfg.workload)
    assert (uniform == -1).mean() == pytest.approx(0.25, abs=0.01)


def test_length_distributions():
    cfg = build_config(tiny(workload={"input": {"dist": "histogram", "edges": [1, 10, 100], "weights": [1, 3]},
                                      "output": {"dist": "lognormal", "median": 50.0, "sigma": 0.5, "max": 80}}))
    rng = np.random.default_rng(0)
    hist = sample_lengths(rng, 40_000, cfg.workload.input)
    assert hist.min() >= 1 and hist.max() < 100 and (hist < 10).mean() == pytest.approx(0.25, abs=0.01)
    logn = sample_lengths(rng, 40_000, cfg.workload.output)
    assert logn.max() == 80 and np.median(logn) == pytest.approx(50, abs=1)


def test_replays_unipage_and_azure_traces(tmp_path):
    (tmp_path / "t.csv").write_text("timestamp,adapter,input_tokens,output_tokens\n"
                                    "10.0,sql,32,4\n10.5,,16,2\n11.0,chat,64,8\n12.0,sql,32,3\n")
    record = _run_cli_record(tmp_path, {"workload": {"trace": "t.csv"}})
    assert record["requests"] == 4 and record["finished"] == 4 and record["adapter_requests"] == 3
    (tmp_path / "azure.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                        "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n"
                                        "2023-11-16 18:15:51.2000000,100,0\n")
    record = _run_cli_record(tmp_path, {"workload": {"trace": "azure.csv", "num_adapters": 5}})
    assert record["requests"] == 3 and record["finished"] == 3 and record["clipped_requests"] == 1
    assert record["latency_p50_s"] is not None and record["config"]["workload"]["trace"] == "azure.csv"


# -- the CLI -------------------------------------------------------------------------
def _write_config(tmp_path, extra: dict | None = None, name: str = "sim.toml"):
    path = tmp_path / name
    path.write_text(to_toml(tiny(**(extra or {}))))
    return path


def _run_cli_record(tmp_path, extra) -> dict:
    config = _write_config(tmp_path, extra)
    out = tmp_path / "run.jsonl"
    assert main(["run", str(config), "--out", str(out), "--quiet"]) == 0
    return json.loads(out.read_text())


def test_cli_run_sweep_report(tmp_path, capsys):
    config = _write_config(tmp_path, {"workload": {"duration_s": 4.0}})
    run_out = tmp_path / "run.jsonl"
    assert main(["run", str(config), "--rate", "10", "--eviction", "lfu", "--out", str(run_out)]) == 0
    record = json.loads(run_out.read_text())
    assert record["bench"] == "sim" and record["seed"] == 0 and record["device"].startswith("sim:")
    assert record["config"]["workload"]["rate"] == 10.0 and record["config"]["lora"]["eviction_policy"] == "lfu"
    assert "throughput_rps" in capsys.readouterr().out
    sweep_out = tmp_path / "sweep.jsonl"
    assert main(["sweep", str(config), "--eviction", "lru", "belady", "--pool-pages", "256", "512",
                 "--rate", "5", "10", "--jobs", "2", "--out", str(sweep_out), "--quiet"]) == 0
    records = [json.loads(line) for line in sweep_out.read_text().splitlines()]
    assert [(r["config"]["lora"]["eviction_policy"], r["config"]["pool"]["num_pages"], r["config"]["workload"]["rate"])
            for r in records] == [(e, p, r) for r in (5.0, 10.0) for e in ("lru", "belady") for p in (256, 512)]
    plots = tmp_path / "plots"
    assert main(["report", str(sweep_out), str(run_out), "--csv", str(tmp_path / "all.csv"),
                 "--jsonl", str(tmp_path / "all.jsonl"), "--plots", str(plots)]) == 0
    table = capsys.readouterr().out
    assert table.count("fcfs/optimistic/") == 9
    csv_lines = (tmp_path / "all.csv").read_text().splitlines()
    assert len(csv_lines) == 10 and "config.lora.eviction_policy" in csv_lines[0] and "seed" in csv_lines[0]
    assert len((tmp_path / "all.jsonl").read_text().splitlines()) == 9
    assert sorted(p.name for p in plots.iterdir()) == ["occupancy.png", "pool.png", "rate.png"]


@pytest.mark.parametrize("extra,args,message", [
    ({}, ["--eviction", "nope"], "[lora] eviction_policy must be one of"),
    ({}, ["--rate", "-1"], "rate must be a number > 0"),
    ({}, ["--policy", "lifo"], "policy must be one of"),
    ({"workload": {"ranks": [8, 128]}}, [], "rank 128"),
    ({"pool": {"num_pages": 8}}, [], "cannot fit"),
    ({"workload": {"typo": 1}}, [], "unknown field(s) ['typo']"),
    ({"workload": {"trace": "bad.csv"}}, [], "bad.csv line 3: input_tokens 'x'"),
    ({"workload": {"trace": "missing.csv"}}, [], "cannot read"),
    ({"sim": {"profile": "nope"}}, [], "neither a built-in profile"),
])
def test_cli_bad_input_exits_2_writing_nothing(tmp_path, capsys, extra, args, message):
    (tmp_path / "bad.csv").write_text("timestamp,adapter,input_tokens,output_tokens\n0,a,4,4\n1,a,x,4\n")
    config = _write_config(tmp_path, extra)
    out = tmp_path / "out.jsonl"
    assert main(["run", str(config), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("unipage-sim: error:") and message in err, err
    assert not out.exists()


def test_cli_sweep_and_report_bad_input(tmp_path, capsys):
    config = _write_config(tmp_path)
    out = tmp_path / "sweep.jsonl"
    assert main(["sweep", str(config), "--rate", "5", "-2", "--out", str(out), "--quiet"]) == 2
    assert "rate=-2.0" in capsys.readouterr().err and not out.exists()
    assert main(["sweep", str(config), "--pool-pages", "512", "8", "--jobs", "1", "--out", str(out), "--quiet"]) == 2
    assert "pool_pages=8" in capsys.readouterr().err and not out.exists()
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"bench": "sim"}\nnot json\n')
    assert main(["report", str(broken), "--csv", str(tmp_path / "x.csv")]) == 2
    assert "broken.jsonl line 2" in capsys.readouterr().err and not (tmp_path / "x.csv").exists()


def test_console_script_and_no_torch(tmp_path):
    config = _write_config(tmp_path)
    code = textwrap.dedent(f"""
        import sys
        from unipage.sim.cli import main
        status = main(["run", {str(config)!r}, "--eviction", "nope"])
        assert "torch" not in sys.modules, "unipage.sim imported torch"
        sys.exit(status)
    """)
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert proc.returncode == 2 and "eviction_policy must be one of" in proc.stderr, proc.stderr


def test_profile_and_config_round_trips(tmp_path, capsys):
    from unipage.sim import BUILTIN_PROFILES, CostProfile

    assert main(["profile"]) == 0
    printed = CostProfile.from_dict(json.loads(capsys.readouterr().out))
    assert printed == BUILTIN_PROFILES[printed.name]
    raw = tiny(seed=4, pool={"prefix_caching": False})
    assert read_toml(_write_config(tmp_path, {"seed": 4, "pool": {"prefix_caching": False}})) == raw
    with pytest.raises(SimInputError, match="step_base_s must be a number >= 0"):
        CostProfile.from_dict({**printed.to_dict(), "step_base_s": -1.0})


def test_belady_follows_preemptions_and_drops():
    raw = tiny(pool={"num_pages": 80}, lora={"eviction_policy": "belady", "max_adapters_per_batch": 8},
               scheduler={"policy": "slo", "slo_ttft_s": 1.0}, sim={"check_every": 5},
               workload={"rate": 40.0, "duration_s": 5.0, "input": {"dist": "uniform", "low": 16, "high": 64},
                         "output": {"dist": "uniform", "low": 100, "high": 400}})
    sim = Simulation(build_config(raw))
    record = make_record(sim.run())
    assert record["preemptions"] > 0 and record["aborted_slo"] > 0
    assert sim.oracle is not None and set(sim.oracle.queued.values()) == {0}  # every re-queue and drop seen
