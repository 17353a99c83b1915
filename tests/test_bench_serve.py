"""benchmarks/serve.py end to end at toy widths on the CPU: every setup's records, the run logs, the fitted
cost profiles and their replay in unipage-sim; and the pieces with exact answers (the HBM floor's bytes,
the non-negative fit, the replayed closed loop)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import serve
import serve_calib
import serve_models
import serve_variants
from unipage.sim import CostProfile

from unipage.config import ModelConfig

SMALL = ["--tiny", "--prompt", "12", "--output", "4", "--warmup-tokens", "2", "--device", "cpu"]
COUNTS = (2, 6)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every setup once at toy size; the records by row, and where the logs and profiles went."""
    root = tmp_path_factory.mktemp("serve")
    out, logs, profiles = root / "out.jsonl", root / "logs", root / "profiles"
    common = SMALL + ["--out", str(out), "--log-dir", str(logs), "--workdir", str(root / "work")]
    serve.main(["--setup", "a", "--requests", "6", "--concurrency", "3", "--adapters", "2", "--rank", "4",
                "--max-running", "3", *common])
    serve.main(["--setup", "b", "--models", "llama3-8b", "--requests", "4", "--adapters", "2", "--rank", "2",
                "--max-running", "4", *common])
    serve.main(["--setup", "c", "--counts", *map(str, COUNTS), "--requests", "8", "--concurrency", "2",
                "--max-running", "2", "--pool-pages", "10", "--repeats", "2", *common])
    serve.main(["--setup", "d", "--requests", "4", "--adapters", "2", "--rank", "2", "--hf-batch", "2", *common])
    log_files = sorted(str(p) for p in logs.glob("*.json"))
    serve.main(["--setup", "calibrate", "--logs", *log_files, "--profile-dir", str(profiles), "--out", str(out)])
    records: dict[str, list[dict]] = {}
    for line in out.read_text().splitlines():
        record = json.loads(line)
        records.setdefault(record["row"], []).append(record)
    return records, log_files, profiles


def test_setup_a_reports_throughput_ttft_and_the_decode_floor(runs):
    (a,) = runs[0]["a"]
    assert a["model"] == "gpt-oss-20b-tiny" and a["adapters"] == 2 and a["concurrency"] == 3
    assert a["requests"] == 6 and a["output_tokens"] == 6 * 4  # exact lengths: no stop tokens
    assert 0 < a["ttft_p50_s"] <= a["ttft_p99_s"] and a["output_tokens_per_s"] > 0
    assert a["per_request_output_tokens_per_s"] > 0
    assert a["decode_steps"] >= 1 and a["decode_batch"] == 3
    assert a["floor_bytes"] == a["floor_weights_bytes"] + a["floor_lora_bytes"] + a["floor_kv_bytes"]
    assert min(a["floor_lora_bytes"], a["floor_kv_bytes"]) > 0 and a["step_over_floor"] > 0
    assert a["floor_s"] == pytest.approx(a["floor_bytes"] / a["memory_bytes_per_s"], rel=1e-3, abs=1e-6)
    assert a["run_ahead"] is False and a["ahead_taken"] == a["ahead_dropped"] == 0  # CPU: no decode graphs


def test_setup_a_counts_the_experts_its_decode_steps_touch(runs):
    (a,) = runs[0]["a"]
    (probe,) = runs[0]["a-experts"]
    assert probe["label"] == a["label"] and probe["decode_batch"] == a["decode_batch"] == 3
    assert probe["layer_calls"] == 3 * 2  # 4 tokens a request: a prefill step, then 3 decode steps; 2 MoE layers
    assert probe["top_k"] <= probe["experts_touched"] <= min(probe["experts"], 3 * probe["top_k"])
    e, k = probe["experts"], probe["top_k"]
    assert probe["experts_touched_uniform"] == pytest.approx(e * (1 - (1 - k / e) ** 3), abs=0.01)
    config = serve_models.hf_config("gpt-oss-20b", tiny=True)  # one expert's gate/up and down, fp32
    assert probe["expert_bytes"] == 2 * 3 * config.hidden_size * config.intermediate_size * 4
    extra = (probe["experts_touched"] - probe["experts_touched_uniform"]) * probe["expert_bytes"]
    assert probe["floor_bytes_measured"] == pytest.approx(probe["floor_bytes"] + extra,
                                                          abs=0.01 * probe["expert_bytes"])
    ratio = a["decode_step_s"] * a["memory_bytes_per_s"] / probe["floor_bytes_measured"]
    assert probe["step_over_measured_floor"] == pytest.approx(ratio, rel=1e-2)


def test_a_probe_too_short_for_a_decode_step_reports_no_measured_floor():
    import serve_experts

    floor = serve_models.DecodeFloor({"vocab_size": 10}, ModelConfig(
        num_layers=1, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, num_experts=4, top_k=1,
        expert_intermediate_size=4, dtype="float32"), "all", rank=1)
    record = {"row": "a", "label": "a-x", "model": "x", "decode_batch": 2, "floor_bytes": 1000,
              "step_over_floor": 2.0, "decode_step_s": 0.01, "commit": "c"}
    row = serve_experts.row(record, [], floor, 1e5)
    assert row["layer_calls"] == 0 and "experts_touched" not in row and "step_over_measured_floor" not in row
    row = serve_experts.row(record, [1, 2], floor, 1e5)  # 1.5 experts against 1.75 uniform: a smaller floor
    assert row["floor_bytes_measured"] == round(1000 - 0.25 * 3 * 8 * 4 * 4)


def test_the_expert_probe_watches_routing_of_the_batch_only_and_restores_the_engine(monkeypatch):
    """`serve_experts.probe` on a stand-in engine: graphs off and ops swapped while it drives, both back after."""
    import serve_experts
    from unipage.models.ops import TORCH

    seen = {}
    runner = type("Runner", (), {"graphs": "graphs", "mixed": "mixed", "model": type("M", (), {"ops": TORCH})()})()
    engine = type("Engine", (), {"runner": runner, "vocab_size": 50})()

    def drive(eng, work, progress_s):
        seen["graphs"] = (runner.graphs, runner.mixed)
        route = runner.model.ops.route
        for tokens in (5, 2, 2):  # a prefill of 5 tokens, then two decode steps of the batch
            route(torch.randn(tokens, 8), 2, True)
        seen["work"] = work

    monkeypatch.setattr(serve_experts.drv, "drive", drive)
    work = serve_experts.drv.Workload("w", [[1, 2, 3]] * 4, ["x", "y", "x", "y"], [4] * 4, 2)
    counts = serve_experts.probe(engine, work, batch=2, tokens=3, seed=0)
    assert len(counts) == 2 and all(2 <= c <= 4 for c in counts)
    assert seen["graphs"] == (None, None) and seen["work"].outputs == [3, 3] and seen["work"].concurrency == 2
    assert (runner.graphs, runner.mixed, runner.model.ops) == ("graphs", "mixed", TORCH)


def test_setup_b_compares_lora_with_the_base_model(runs):
    records = runs[0]
    assert [r["label"] for r in records["b"]] == ["b-llama3-8b-tiny-base", "b-llama3-8b-tiny-lora"]
    base, lora = records["b"]
    assert (base["adapters"], lora["adapters"]) == (0, 2)
    (ratio,) = records["b-ratio"]
    assert ratio["lora_over_base"] == pytest.approx(lora["output_tokens_per_s"] / base["output_tokens_per_s"],
                                                    rel=1e-3)


def test_setup_b_runs_one_of_the_pair_under_the_policy_and_ring_asked(tmp_path):
    out, logs = tmp_path / "out.jsonl", tmp_path / "logs"
    serve.main(["--setup", "b", "--models", "llama3-8b", "--requests", "2", "--adapters", "2", "--rank", "2",
                "--max-running", "2", "--b-runs", "lora", "--policy", "affinity", "--affinity-wait", "600", *SMALL,
                "--staging-ring-mib", "3", "--out", str(out), "--workdir", str(tmp_path), "--log-dir", str(logs)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["row"], r["label"]) for r in records] == [("b", "b-llama3-8b-tiny-lora")]  # no ratio row
    assert (records[0]["policy"], records[0]["affinity_max_wait_s"]) == ("affinity", 600.0)
    assert records[0]["staging_ring_bytes"] == 3 << 20
    log = json.loads((logs / "b-llama3-8b-tiny-lora.json").read_text())
    assert (log["scheduler"]["policy"], log["scheduler"]["affinity_max_wait_s"]) == ("affinity", 600.0)


def test_setup_c_scales_the_adapter_count_past_the_pool(runs):
    records = runs[0]
    counts = records["c-count"]
    order = [(0, c) for c in COUNTS] + [(1, c) for c in reversed(COUNTS)]  # interleaved, reversed every other
    assert [(r["repeat"], r["adapters"]) for r in counts] == order
    labels = [r["label"] for r in records["c"]]
    assert len(set(labels)) == len(labels) == 2 * len(COUNTS)  # one run log each
    assert all(r["pool_holds_adapters"] < max(COUNTS) for r in counts)  # the pool cannot hold them all
    assert all(1 <= r["distinct_adapters_used"] <= r["adapters"] for r in counts)
    (scaling,) = records["c-scaling"]
    assert scaling["counts"] == list(COUNTS) and scaling["repeats"] == 2
    runs_by_count = [[r["output_tokens_per_s"] for r in sorted(counts, key=lambda r: r["repeat"])
                      if r["adapters"] == c] for c in COUNTS]
    assert scaling["runs_output_tokens_per_s"] == runs_by_count
    assert scaling["output_tokens_per_s"] == [min(r) for r in runs_by_count]  # the lower middle of two runs
    low, high = scaling["output_tokens_per_s"][0], scaling["output_tokens_per_s"][-1]
    assert scaling["largest_over_smallest"] == pytest.approx(high / low, rel=1e-3)


def test_the_median_run_is_the_lower_middle_one():
    runs = [{"output_tokens_per_s": v} for v in (5.0, 1.0, 9.0, 3.0)]
    assert serve.median_run(runs)["output_tokens_per_s"] == 3.0
    assert serve.median_run(runs[:3])["output_tokens_per_s"] == 5.0


def test_setup_d_measures_the_peft_baseline_on_the_same_requests(runs):
    records = runs[0]
    (ours,), (theirs,), (speedup,) = records["d"], records["d-baseline"], records["d-speedup"]
    assert ours["output_tokens"] == theirs["output_tokens"] == 4 * 4
    assert theirs["generate_calls"] == 2  # two adapters, two requests each, batches of two
    assert speedup["speedup"] == pytest.approx(ours["output_tokens_per_s"] / theirs["output_tokens_per_s"],
                                               rel=1e-3, abs=5e-4)  # (rounded to 3 decimals)


def test_calibration_writes_profiles_and_replays_every_run(runs):
    records, log_files, profiles = runs
    names = sorted(p.stem for p in profiles.glob("*.json"))
    assert names == ["gpt-oss-20b-tiny-cpu", "llama-1b-tiny-cpu", "llama3-8b-tiny-cpu"]
    for name in names:
        profile = CostProfile.from_json(profiles / f"{name}.json")  # what unipage-sim reads
        assert profile.name == name and "measured by benchmarks/serve.py" in profile.source
    labels = sorted(r["label"] for r in records["calibration"])
    assert labels == sorted(os.path.basename(f)[:-5] for f in log_files)
    for row in records["calibration"]:
        assert row["throughput_ratio"] > 0 and row["ttft_p50_ratio"] > 0 and row["fit_on_this_run"]
        assert row["sim_output_tokens_per_s"] == pytest.approx(
            row["throughput_ratio"] * row["measured_output_tokens_per_s"], rel=1e-3)


def test_what_if_replays_a_run_under_other_scheduler_settings(runs, tmp_path):
    """``--policy`` with ``--setup calibrate --profile``: each log replayed under its own settings (as the
    calibration replays it) and under the new ones; one running request at a time runs one adapter a step."""
    records, log_files, profiles = runs
    (log_file,) = [f for f in log_files if "b-llama3-8b-tiny-lora" in f]
    profile = profiles / "llama3-8b-tiny-cpu.json"
    out = tmp_path / "out.jsonl"
    serve.main(["--setup", "calibrate", "--logs", log_file, "--profile", str(profile), "--policy", "affinity",
                "--affinity-wait", "600", "--out", str(out)])
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    (calibration,) = [r for r in records["calibration"] if r["label"] == "b-llama3-8b-tiny-lora"]
    assert row["row"] == "what-if" and row["scheduler"] == {"policy": "affinity", "affinity_max_wait_s": 600.0}
    assert (row["own_policy"], row["new_policy"], row["new_affinity_max_wait_s"]) == ("fcfs", "affinity", 600.0)
    assert row["own_output_tokens_per_s"] == calibration["sim_output_tokens_per_s"]
    assert row["throughput_change"] == pytest.approx(
        row["new_output_tokens_per_s"] / row["own_output_tokens_per_s"], rel=1e-3)
    with open(log_file) as f:
        log = json.load(f)
    one = serve_calib.what_if(log, CostProfile.from_json(profile), profile, {"max_num_seqs": 1})
    assert 0 < one["new_mean_batch_adapters"] <= 1 < one["own_mean_batch_adapters"] <= 2
    assert one["new_output_tokens_per_s"] < one["own_output_tokens_per_s"]


def test_profile_source_names_a_runs_policy_when_not_fcfs(runs):
    """Two logs of one label, one served under affinity: the fit's source tells them apart, and each
    calibration row says which queue order its run had (logs without the field count as FCFS)."""
    _, log_files, profiles = runs
    with open(next(f for f in log_files if "b-llama3-8b-tiny-lora" in f)) as f:
        fcfs = json.load(f)
    affinity = {**fcfs, "scheduler": {**fcfs["scheduler"], "policy": "affinity"}}
    old = {key: value for key, value in fcfs.items() if key != "scheduler"}
    assert [serve_calib.run_policy(lg) for lg in (fcfs, affinity, old)] == ["fcfs", "affinity", "fcfs"]
    profile, _ = serve_calib.fit_profile([fcfs, affinity], "abc1234")
    assert "(runs: b-llama3-8b-tiny-lora, b-llama3-8b-tiny-lora (affinity));" in profile.source
    path = profiles / "llama3-8b-tiny-cpu.json"
    row = serve_calib.compare(affinity, CostProfile.from_json(path), path, in_sample=False)
    assert row["policy"] == "affinity" and row["label"] == "b-llama3-8b-tiny-lora"


def test_closed_loop_replay_releases_a_request_at_each_finish(runs):
    _, log_files, profiles = runs
    with open(next(f for f in log_files if "c-llama-1b-tiny-6" in f)) as f:
        log = json.load(f)
    timeline, _ = serve_calib.replay(log, profiles / "llama-1b-tiny-cpu.json")
    c = log["concurrency"]
    assert np.array_equal(timeline.submit[c:], np.sort(timeline.finish)[:-c])  # each finish releases one
    assert (timeline.first > timeline.submit).all() and (timeline.tokens == 4).all()


def test_decode_floor_counts_the_bytes_by_hand():
    model = ModelConfig(num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                        intermediate_size=16, dtype="bfloat16")
    hf = {"vocab_size": 10, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3}
    floor = serve_models.DecodeFloor(hf, model, "attention", rank=2)
    got = floor.bytes(contexts=[5, 2], adapter_tokens=[1, 1])
    per_layer = 8 * 8 + 8 * 4 + 8 * 4 + 8 * 8 + 3 * 8 * 16  # q, k, v, o, gate/up/down
    assert got["weights"] == 2 * (2 * per_layer + (10 + 2) * 8)  # + lm_head and two embedding rows
    lora_per_layer = 2 * ((8 + 8) + (8 + 4) + (8 + 4) + (8 + 8))
    assert got["lora"] == 2 * 2 * (2 * lora_per_layer)  # two adapters, two layers
    kv_reads = (5 + 2) + (3 + 2)  # the full layer reads the whole context, the sliding one its window
    assert got["kv"] == 2 * kv_reads * 2 * 1 * 4


def test_decode_floor_reads_only_the_experts_touched():
    model = ModelConfig(num_layers=1, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, num_experts=4,
                        top_k=1, expert_intermediate_size=4, dtype="float32")
    floor = serve_models.DecodeFloor({"vocab_size": 10}, model, "all", rank=1)
    one, two = floor.weights(1), floor.weights(2)
    assert two - one == pytest.approx(8 + (4 * (1 - 0.75**2) - 1) * 3 * 8 * 4)  # an embedding row + 0.75 expert


def test_nnls_matches_the_constrained_optimum():
    rng = np.random.default_rng(0)
    a = rng.random((40, 4))
    truth = np.array([2.0, 0.0, 1.0, 0.5])
    assert np.allclose(serve_calib.nnls(a, a @ truth), truth, atol=1e-9)
    b = a @ np.array([1.0, -3.0, 0.0, 2.0])  # unconstrained optimum has a negative entry
    x = serve_calib.nnls(a, b)
    grad = a.T @ (b - a @ x)
    assert (x >= 0).all() and np.allclose(grad[x > 0], 0, atol=1e-8) and (grad[x == 0] <= 1e-8).all()  # KKT


def test_fit_recovers_planted_coefficients_by_name():
    """Step rows made from known coefficients (one per fitted term, the per-load host time among them) come
    back under the profile's field names."""
    rng = np.random.default_rng(0)
    col = {name: i for i, name in enumerate(serve.drv.COLUMNS)}
    truth = dict(zip(serve_calib.COEFFICIENTS, rng.uniform(1e-4, 1e-3, len(serve_calib.COEFFICIENTS))))
    runs = []
    for _ in range(2):
        rows = np.zeros((300, len(serve.drv.COLUMNS)))
        for term in serve.drv.TERMS:
            rows[:, col[term]] = rng.integers(0, 50, len(rows))
        rows[rng.random(len(rows)) < 0.3, col["prefill"]] = 0  # decode-only steps: no eager cost
        rows[:, col["seconds"]] = serve_calib.design_matrix(rows) @ np.array(list(truth.values()))
        runs.append(rows)
    got, quality = serve_calib.fit_coefficients(runs)
    assert got.keys() == truth.keys() and got["load_s"] == pytest.approx(truth["load_s"], rel=1e-6)
    assert got["eager_step_s"] == pytest.approx(truth["eager_step_s"], rel=1e-6)
    assert all(got[k] == pytest.approx(v, rel=1e-6) for k, v in truth.items()), got
    assert quality["total_ratio"] == pytest.approx(1.0)


def test_a_term_the_fit_cannot_tell_from_an_earlier_one_is_left_at_zero():
    """Every step has LoRA tokens: the LoRA step term is the constant, so ``step_base_s`` takes it all (not
    an arbitrary split: on the committed setup-(c) logs the solver gave it all to ``lora_step_s``, which
    `test_calibration_logs` catches); with base steps among them the two come apart."""
    design = np.array([[1.0, 2.0, 1.0, 2.0, 3.0], [1.0, 5.0, 1.0, 5.0, 3.0]])
    assert serve_calib._distinct(design).tolist() == [True, True, False, False, True]
    col = {name: i for i, name in enumerate(serve.drv.COLUMNS)}
    rows = np.zeros((100, len(serve.drv.COLUMNS)))
    rows[:, col["decode"]] = np.arange(100) % 7 + 1
    rows[:, col["adapters"]] = np.arange(100) % 3 + 1
    rows[:, col["seconds"]] = 0.003 + 0.001 + 1e-4 * rows[:, col["decode"]]
    got, _ = serve_calib.fit_coefficients([rows])
    assert got["lora_step_s"] == 0 and got["step_base_s"] == pytest.approx(0.004, rel=1e-9)
    rows[::2, col["adapters"]] = 0
    rows[::2, col["seconds"]] -= 0.001
    got, _ = serve_calib.fit_coefficients([rows])
    assert got["lora_step_s"] == pytest.approx(0.001, rel=1e-9) and got["step_base_s"] == pytest.approx(0.003)


def test_run_logs_record_each_steps_launch_time_and_the_fit_uses_them(runs):
    _, log_files, profiles = runs
    col = serve.drv.COLUMNS.index("launch")
    for path in log_files:
        with open(path) as f:
            log = json.load(f)
        rows = serve_calib.step_rows(log)
        assert log["columns"] == list(serve.drv.COLUMNS) and len(rows)
        assert (rows[:, col] > 0).all() and (rows[:, col] <= rows[:, serve.drv.COLUMNS.index("seconds")]).all()
    profile = CostProfile.from_json(profiles / "llama-1b-tiny-cpu.json")
    assert "launch terms: a fit of" in profile.source and profile.launch_base_s + profile.launch_token_s > 0
    assert "step gap" in profile.source and profile.step_gap_s > 0  # the driver's work between steps


def test_run_logs_record_each_adapter_load_from_start_to_ready(runs):
    """Setup c at 6 adapters in a 10-page pool loads adapters during the run: each load's start, ready time
    (after it), adapter and tier; at least the loads of the steps that ran a batch."""
    _, log_files, _ = runs
    path = next(p for p in log_files if p.endswith(f"-{COUNTS[1]}.json"))
    with open(path) as f:
        log = json.load(f)
    loads, rows = log["loads"], serve_calib.step_rows(log)
    n = len(loads["adapter"])
    assert n >= rows[:, serve.drv.COLUMNS.index("loads")].sum() > 0
    assert all(len(loads[k]) == n for k in ("issued", "ready", "from_host", "failed"))
    issued, ready = np.asarray(loads["issued"]), np.asarray(loads["ready"])
    assert not any(loads["failed"])  # (a failed load keeps a NaN ready time)
    assert np.isfinite(ready).all() and (ready >= issued).all() and (issued >= 0).all()
    assert set(loads["adapter"]) <= set(range(len(log["adapter_names"])))
    storage, read, finish, seconds = (rows[:, serve.drv.COLUMNS.index(c)]
                                      for c in ("storage", "storage_read", "storage_finish", "seconds"))
    with_loads = rows[:, serve.drv.COLUMNS.index("loads")] > 0
    from_disk = rows[:, serve.drv.COLUMNS.index("loads_disk")] > 0
    assert (storage >= 0).all() and (storage <= seconds).all()  # the step's share in the storage's calls
    assert (read >= 0).all() and (finish >= 0).all() and (read + finish <= storage + 1e-9).all()
    # on the CPU the storage reads and packs the files in apply (a host-tier load reads none), then copies
    assert from_disk.any() and storage[with_loads].min() > 0 and finish[with_loads].min() > 0
    assert read[from_disk].min() > 0


def test_fit_launch_recovers_planted_terms_and_skips_rows_without_one():
    rng = np.random.default_rng(1)
    col = {name: i for i, name in enumerate(serve.drv.COLUMNS)}
    rows = np.zeros((200, len(serve.drv.COLUMNS)))
    rows[:, col["prefill"]], rows[:, col["decode"]] = rng.integers(0, 4096, 200), rng.integers(0, 64, 200)
    rows[:, col["launch"]] = 5e-4 + 2e-6 * (rows[:, col["prefill"]] + rows[:, col["decode"]])
    old = rows.copy()
    old[:, col["launch"]] = np.nan  # an older log's rows: no launch times
    got, quality = serve_calib.fit_launch([rows, old])
    assert got["launch_base_s"] == pytest.approx(5e-4, rel=1e-6) and got["launch_token_s"] == pytest.approx(2e-6)
    assert quality["launch_steps"] == 200
    assert serve_calib.fit_launch([old]) == ({"launch_base_s": 0.0, "launch_token_s": 0.0}, {"launch_steps": 0})


def test_fit_gap_is_the_wall_time_outside_the_steps_per_step():
    columns = list(serve.drv.COLUMNS)
    seconds = columns.index("seconds")

    def log(step_seconds: list[float], duration: float | None) -> dict:
        steps = [[s if i == seconds else 0.0 for i in range(len(columns))] for s in step_seconds]
        return {"columns": columns, "steps": steps, "measured": {} if duration is None else {"duration_s": duration}}

    # 4 steps of 10 ms in 46 ms: 1.5 ms a step; 2 steps of 5 ms in 12 ms: 1 ms a step; a log without a duration
    # is left out; a run shorter than its steps (clock skew) counts 0
    assert serve_calib.fit_gap([log([0.01] * 4, 0.046), log([0.005] * 2, 0.012), log([0.01], None)]) == \
        pytest.approx(1.25e-3)
    assert serve_calib.fit_gap([log([0.01] * 2, 0.019)]) == 0.0
    assert serve_calib.fit_gap([]) == 0.0


def test_step_rows_of_a_log_without_launch_times():
    columns = [c for c in serve.drv.COLUMNS if c != "launch"]
    rows = serve_calib.step_rows({"columns": columns, "steps": [list(range(len(columns)))]})
    assert rows.shape == (1, len(serve.drv.COLUMNS)) and np.isnan(rows[0, serve.drv.COLUMNS.index("launch")])
    assert rows[0, serve.drv.COLUMNS.index("seconds")] == columns.index("seconds")


def test_calibrate_needs_the_reader_count_of_old_logs(tmp_path):
    log = tmp_path / "old.json"
    log.write_text(json.dumps({"model_key": "m", "device": "d", "label": "x"}))
    with pytest.raises(SystemExit, match="--read-workers"):
        serve.main(["--setup", "calibrate", "--logs", str(log), "--out", str(tmp_path / "out.jsonl")])


@pytest.mark.parametrize("argv, message", [
    (["--setup", "a", "--requests", "0"], "--requests must be >= 1"),
    (["--setup", "c", "--counts", "0", "5"], "--counts must be >= 1"),
    (["--setup", "c", "--repeats", "0"], "--repeats must be >= 1"),
    (["--setup", "b", "--staging-ring-mib", "0"], "--staging-ring-mib must be >= 1"),
    (["--setup", "a", "--piece-layers", "4", "-1"], "--piece-layers must be >= 0"),
    (["--setup", "a", "--expert-probe-tokens", "-1"], "--expert-probe-tokens must be >= 0"),
    (["--setup", "c", "--piece-layers", "4"], "--piece-layers is for setups a and b"),
    (["--setup", "c", "--linear-configs", "{}"], "--linear-configs is for setups a and b"),
    (["--setup", "a", "--piece-layers", "4", "--linear-configs", "{}"], "without --piece-layers"),
    (["--setup", "a", "--linear-configs", "[1]"], "invalid json_object value"),
    (["--setup", "a", "--linear-configs", '{"max_token": 16}'], "unknown settings ['max_token']"),
    (["--setup", "a", "--linear-configs", '{"max_tokens": 99}'], "max_tokens must be in"),
    (["--setup", "a", "--linear-config", "[2]"], "--linear-config: not a JSON object"),
    (["--setup", "b", "--policy", "affinity", "--affinity-wait", "-1"], "--affinity-wait needs --policy affinity"),
    (["--setup", "b", "--affinity-wait", "60"], "with --policy None"),
    (["--setup", "b", "--policy", "slo"], "invalid choice: 'slo'"),
    (["--setup", "calibrate", "--logs", "x.json", "--policy", "vtc"], "it needs --profile"),
])
def test_bad_flags_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        serve.parse(argv)
    assert message in capsys.readouterr().err


def test_calibrate_needs_logs(tmp_path):
    with pytest.raises(SystemExit, match="needs --logs"):
        serve.main(["--setup", "calibrate", "--out", str(tmp_path / "out.jsonl")])


def test_unknown_shape_is_an_error():
    with pytest.raises(ValueError, match="unknown model shape"):
        serve_models.hf_config("gpt-5")


def test_gpu_tag():
    assert serve_calib.gpu_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert serve_calib.gpu_tag("NVIDIA H200") == "h200"
    assert serve_calib.gpu_tag("x86_64") == "cpu"


def test_measured_profiles_load_from_their_folder_and_replace_the_estimate(runs, tmp_path):
    from unipage.sim import profile as prof

    _, _, profiles = runs
    measured = prof.measured_profiles(profiles)
    assert sorted(measured) == ["gpt-oss-20b-tiny-cpu", "llama-1b-tiny-cpu", "llama3-8b-tiny-cpu"]
    assert prof.preferred("llama3-8b-tiny-cpu-estimate", measured) == "llama3-8b-tiny-cpu"
    assert prof.preferred("llama3-8b-h100-estimate", measured) == "llama3-8b-h100-estimate"
    assert prof.measured_profiles(tmp_path / "absent") == {}
    (tmp_path / "other-name.json").write_text((profiles / "llama-1b-tiny-cpu.json").read_text())
    with pytest.raises(prof.SimInputError, match="must match the file name"):
        prof.measured_profiles(tmp_path)


def test_the_committed_profiles_are_valid():
    from unipage.sim import profile as prof

    for name, profile in prof.measured_profiles().items():
        assert "measured by benchmarks/serve.py" in profile.source, name
    assert prof.DEFAULT_PROFILE in prof.BUILTIN_PROFILES


class _Graphs:
    def __init__(self):
        self.calls = []
        self.drops = 0

    def set_piece_layers(self, layers):
        self.calls.append(layers)

    def drop(self):
        self.drops += 1


def _engine(graphs, mixed=None):
    runner = type("Runner", (), {"graphs": graphs, "mixed": mixed})()
    return type("Engine", (), {"runner": runner, "vocab_size": 50})()


def test_piece_variants_run_the_workload_once_per_value_on_fresh_prompts():
    ctx = type("Ctx", (), {"args": serve.parse(["--setup", "a", "--piece-layers", "0", "4", "0"])})()
    work = serve.drv.make_workload("a-x", 5, 7, 3, ["p", None, "q", "p", None], 2, 50, ctx.args.seed)
    graphs = _Graphs()
    variants = []
    for variant in serve_variants.piece_variants(ctx, _engine(graphs), work):
        variants.append(variant)
        assert graphs.calls[-1] == [0, 4, 0][len(variants) - 1]  # set before the run is handed out
    assert [v.name for v in variants] == ["a-x-p0-0", "a-x-p4-1", "a-x-p0-2"]
    assert variants[0].prompts == work.prompts and variants[1].prompts != work.prompts
    assert variants[2].prompts not in (variants[0].prompts, variants[1].prompts)
    for v in variants:  # only the prompts' tokens and the name change
        assert (v.adapters, v.outputs, v.concurrency) == (work.adapters, work.outputs, work.concurrency)
        assert [len(p) for p in v.prompts] == [7] * 5


def test_piece_variants_without_the_flag_and_without_graphs():
    work = serve.drv.make_workload("a-x", 2, 3, 1, [None, None], 1, 50, 0)
    plain = type("Ctx", (), {"args": serve.parse(["--setup", "a"])})()
    assert list(serve_variants.piece_variants(plain, _engine(None), work)) == [work]
    asked = type("Ctx", (), {"args": serve.parse(["--setup", "a", "--piece-layers", "4"])})()
    with pytest.raises(SystemExit, match="needs the decode CUDA graphs"):
        list(serve_variants.piece_variants(asked, _engine(None), work))


def test_run_ahead_variants_switch_the_runner_before_each_run():
    ctx = type("Ctx", (), {"args": serve.parse(["--setup", "a", "--run-ahead", "on", "off", "on"])})()
    work = serve.drv.make_workload("a-x", 3, 5, 2, ["p", None, "q"], 2, 50, ctx.args.seed)
    engine = _engine(_Graphs())
    seen = [(v.name, engine.runner.run_ahead) for v in serve_variants.variants(ctx, engine, work)]
    assert seen == [("a-x-raon-0", True), ("a-x-raoff-1", False), ("a-x-raon-2", True)]
    with pytest.raises(SystemExit, match="needs the decode CUDA graphs"):
        list(serve_variants.variants(ctx, _engine(None), work))
    assert serve.parse(["--setup", "a"]).run_ahead == ["on"]


def test_linear_variants_set_each_entry_over_the_run_settings(monkeypatch):
    monkeypatch.setattr(serve.lora_linear, "LINEAR", {"max_tokens": 0, "block_n": 32, "block_k": 128,
                                                      "rank_chunk": 32})
    args = serve.parse(["--setup", "b", "--linear-config", '{"block_k": 256}', "--linear-configs",
                        '{"max_tokens": 16}', '{}', '{"max_tokens": 16, "block_n": 64}'])
    ctx = type("Ctx", (), {"args": args})()
    work = serve.drv.make_workload("b-x", 3, 5, 2, ["p", None, "q"], 2, 50, args.seed)
    base = {"max_tokens": 0, "block_n": 32, "block_k": 256, "rank_chunk": 32}
    graphs, mixed = _Graphs(), _Graphs()
    for _ in range(2):  # setup b asks once per label: each pass starts from the run's own settings
        seen = []
        for variant in serve_variants.variants(ctx, _engine(graphs, mixed), work):
            seen.append((variant.name, dict(serve.lora_linear.LINEAR)))
        assert seen == [("b-x-l0", base | {"max_tokens": 16}), ("b-x-l1", base),
                        ("b-x-l2", base | {"max_tokens": 16, "block_n": 64})]
        assert serve.lora_linear.LINEAR == base  # the run's own settings again after the last
    assert graphs.drops == mixed.drops == 8  # before each run and after the last, both kinds
    assert [v.name for v in serve_variants.variants(ctx, _engine(None), work)] == ["b-x-l0", "b-x-l1", "b-x-l2"]  # eager
