"""The simulator against measured engine runs, on the CPU: every run log committed under
``benchmarks/results/logs/<profile>/`` (gzipped ``serve.py --log-dir`` logs of GPU runs) is
replayed in unipage-sim with the profile ``sim/profiles/<profile>.json`` fitted on it, and must
come within the issue's targets (throughput 5 %, p50 TTFT 10 %); the committed profile must be
what the fit gives on those logs.  A change to the scheduler, the pool or the simulator that moves
the replay away from the measured engine fails here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import serve_calib  # noqa: E402
from unipage.sim import CostProfile  # noqa: E402
from unipage.sim.profile import _COEFFICIENTS, _LAUNCH_COEFFICIENTS  # noqa: E402

LOGS = ROOT / "benchmarks" / "results" / "logs"
PROFILES = ROOT / "sim" / "profiles"
RUNS = sorted(LOGS.glob("*/*.json.gz"))
FITTED = sorted({path.parent.name for path in RUNS})


def test_logs_are_committed():
    assert len(RUNS) >= 5 and {"llama3-8b-h200", "qwen3-30b-a3b-h200", "gpt-oss-20b-h200"} <= set(FITTED)


@pytest.mark.parametrize("path", RUNS, ids=lambda p: f"{p.parent.name}/{p.name.removesuffix('.json.gz')}")
def test_replay_matches_the_measured_run(path):
    profile_path = PROFILES / f"{path.parent.name}.json"
    profile = CostProfile.from_json(str(profile_path))
    row = serve_calib.compare(serve_calib.read_log(path), profile, profile_path, in_sample=True)
    assert row["throughput_within_target"] and row["ttft_p50_within_target"], row


@pytest.mark.parametrize("name", FITTED)
def test_committed_profile_is_the_fit_of_its_logs(name):
    logs = [serve_calib.read_log(path) for path in sorted((LOGS / name).glob("*.json.gz"))]
    fitted, _ = serve_calib.fit_profile(logs, "test")
    committed = CostProfile.from_json(str(PROFILES / f"{name}.json"))
    assert fitted.name == name
    for field in (*_COEFFICIENTS, *_LAUNCH_COEFFICIENTS, "step_gap_s", "h2d_bytes_per_s", "disk_bytes_per_s"):
        assert getattr(fitted, field) == pytest.approx(getattr(committed, field), rel=1e-4, abs=1e-12), field
    assert "runs at" in committed.source
