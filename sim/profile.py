"""The cost model: how long a step and an adapter load take on the simulated GPU.

Shape of one step's time (every coefficient in seconds, from a `CostProfile`)::

    step_s = step_base_s                                  weights read once, launches, sampling
           + prefill_token_s   * prefill tokens           scheduled tokens of requests with > 1 token
           + decode_token_s    * decode tokens            requests with exactly 1 token this step
           + kv_token_read_s   * KV tokens read           sum over scheduled requests of their context
           + adapter_s         * distinct adapters        per-adapter segment of the LoRA kernels
           + adapter_rank_s    * sum of their ranks       LoRA weights read (proportional to rank)
           + lora_token_rank_s * sum over tokens of rank  LoRA FLOPs
           + MoE only, per MoE layer:
             expert_s           * experts touched by the batch                 base expert weights read
           + lora_expert_rank_s * sum over adapters of rank * experts touched  expert LoRA weights read
           + load_s            * adapter loads started    the step loop's host work for each
           + eager_step_s      if a request is given > 1 token  the step runs eagerly: its launches' host
                                                              time (decode-only steps replay CUDA graphs)
           + lora_step_s       if a token has an adapter    the LoRA kernels' fixed time: at decode they
                                                              are latency-bound, their time set by launches
                                                              and waves more than by tokens or weights

Between two steps that ran a batch, the serving loop's own host time (handing out outputs,
submitting the requests that arrive)::

    gap = step_gap_s                                      added after each such step

When in the step the engine submits and polls its file reads (host time, not added to the step)::

    launch_s = launch_base_s + launch_token_s * scheduled tokens   from the step's start until its
                                                                   forward pass is launched (capped at step_s)

"Experts touched" by ``t`` tokens routed top-``k`` of ``E`` is the expectation
``E * (1 - (1 - k/E) ** t)`` (uniform routing): no per-token work in the
simulator.

Adapter loads overlap compute (a side stream).  A load from the host tier
takes ``bytes / h2d_bytes_per_s``; one that misses the host cache first reads
the adapter file, ``file_bytes / disk_bytes_per_s``, in one of ``read_workers``
parallel readers (the engine's reader processes).  Host-to-device copies are
one FIFO queue.  As in the engine, the copy of a file read starts only when the
step loop polls: right after it launches a step's forward pass (``launch_s``
into the step), at the end of a step, and at once when nothing runs; a load is
reported done at the end of the step in which its copy completed.

A profile is a JSON object of these fields (`CostProfile.from_json`).  The
built-in profiles (`BUILTIN_PROFILES`) are the *estimates* below, from public
roofline numbers (see each one's ``source``), plus every measured profile
committed under ``sim/profiles/`` (``<model>-<gpu>.json``, written by
``benchmarks/serve.py --setup calibrate``: a fit of the engine's step times
on that GPU).  A measured profile named like an estimate without its
``-estimate`` suffix replaces it as the default (`preferred`).  See
docs/sim.md.  Pure Python.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from unipage.sim.errors import SimInputError

_COEFFICIENTS = ("step_base_s", "prefill_token_s", "decode_token_s", "kv_token_read_s", "adapter_s",
                 "adapter_rank_s", "lora_token_rank_s", "expert_s", "lora_expert_rank_s", "load_s", "eager_step_s",
                 "lora_step_s")
_LAUNCH_COEFFICIENTS = ("launch_base_s", "launch_token_s")  # when in a step the engine submits and polls its reads
_GAP_COEFFICIENTS = ("step_gap_s",)  # the serving loop's host time between steps


@dataclass(frozen=True)
class CostProfile:
    """Coefficients of the step-time model and the load bandwidths of one (model, GPU) pair."""

    name: str  # how records name the simulated device: "sim:<name>"
    step_base_s: float  # fixed time of a step: weights read once, kernel launches, sampling, >= 0
    prefill_token_s: float  # per prefill token (a request given more than one token in the step), >= 0
    decode_token_s: float  # per decode token (a request given exactly one token), >= 0
    kv_token_read_s: float  # per KV token attention reads: each scheduled request's context, >= 0
    adapter_s: float = 0.0  # per distinct adapter in the step, >= 0
    adapter_rank_s: float = 0.0  # per distinct adapter per unit of rank (its weights read), >= 0
    lora_token_rank_s: float = 0.0  # per scheduled token per unit of its adapter's rank, >= 0
    expert_s: float = 0.0  # MoE: per expert touched per MoE layer, >= 0
    lora_expert_rank_s: float = 0.0  # MoE: per (adapter, expert touched, MoE layer) per unit of rank, >= 0
    load_s: float = 0.0  # per adapter load the step starts: the step loop's host work for it, >= 0
    eager_step_s: float = 0.0  # per step with a prefill (run eagerly, not a graph replay): host launch time, >= 0
    lora_step_s: float = 0.0  # per step with a token that has an adapter: the LoRA kernels' fixed time, >= 0
    launch_base_s: float = 0.0  # host seconds from a step's start until its forward pass is launched, >= 0
    launch_token_s: float = 0.0  # ... plus this per scheduled token (building the batch's inputs), >= 0
    step_gap_s: float = 0.0  # host seconds of the serving loop after each step that ran a batch, >= 0
    h2d_bytes_per_s: float = 25e9  # host-to-device copy bandwidth for adapter loads, > 0
    disk_bytes_per_s: float = 2e9  # adapter file read bandwidth of one reader (host-cache misses), > 0
    read_workers: int = 1  # adapter files read in parallel (the engine's reader processes), >= 1
    source: str = ""  # where the numbers come from (measured by which benchmark, or how estimated)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise SimInputError(f"profile: name must be a non-empty string, got {self.name!r}")
        for key in _COEFFICIENTS + _LAUNCH_COEFFICIENTS + _GAP_COEFFICIENTS:
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise SimInputError(f"profile {self.name!r}: {key} must be a number >= 0, got {value!r}")
        for key in ("h2d_bytes_per_s", "disk_bytes_per_s"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise SimInputError(f"profile {self.name!r}: {key} must be a number > 0, got {value!r}")
        if not isinstance(self.read_workers, int) or isinstance(self.read_workers, bool) or self.read_workers < 1:
            raise SimInputError(f"profile {self.name!r}: read_workers must be an integer >= 1, got "
                                f"{self.read_workers!r}")

    @classmethod
    def from_dict(cls, data: dict, where: str = "profile") -> CostProfile:
        if not isinstance(data, dict):
            raise SimInputError(f"{where}: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SimInputError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name not in data and f.default is dataclasses.MISSING]
        if missing:
            raise SimInputError(f"{where}: missing field(s) {missing}")
        return cls(**data)

    @classmethod
    def from_json(cls, path: str | Path) -> CostProfile:
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise SimInputError(f"profile {str(path)!r}: cannot read it: {err.strerror}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise SimInputError(f"profile {str(path)!r}: not JSON: line {err.lineno}: {err.msg}") from None
        return cls.from_dict(data, f"profile {str(path)!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


ESTIMATE_SUFFIX = "-estimate"
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"  # measured profiles, shipped as package data

ESTIMATES = {
    p.name: p for p in (
        CostProfile(
            name="llama3-8b-h100-estimate",
            step_base_s=6.5e-3, prefill_token_s=2.8e-5, decode_token_s=2.5e-5, kv_token_read_s=4.4e-8,
            adapter_s=2.0e-5, adapter_rank_s=1.5e-6, lora_token_rank_s=4.5e-8,
            h2d_bytes_per_s=25e9, disk_bytes_per_s=2e9,
            source="estimate, not measured: Llama-3.1-8B bf16 on one H100 SXM. base = 16 GB of weights at "
                   "~3 TB/s plus ~1 ms of launches and sampling; prefill = 16 GFLOP/token at ~570 TFLOP/s; "
                   "decode = marginal cost of a token in the memory-bound regime; KV = 128 KiB/token at "
                   "~3 TB/s; LoRA terms scaled from the H200 paged-LoRA kernel rows (qkv, 16 adapters, "
                   "rank 16: ~11 us/layer); PCIe 5 pinned copies ~25 GB/s; NVMe ~2 GB/s"),
        CostProfile(
            name="qwen3-30b-a3b-h100-estimate",
            step_base_s=4.0e-3, prefill_token_s=1.2e-5, decode_token_s=2.0e-5, kv_token_read_s=3.3e-8,
            adapter_s=3.0e-5, adapter_rank_s=1.0e-6, lora_token_rank_s=3.0e-8,
            expert_s=3.1e-6, lora_expert_rank_s=4.3e-9,
            h2d_bytes_per_s=25e9, disk_bytes_per_s=2e9,
            source="estimate, not measured: Qwen3-30B-A3B bf16 on one H100 SXM. base = non-expert weights "
                   "and launches; prefill = 6 GFLOP/token (3B active) at ~500 TFLOP/s; KV = 96 KiB/token; "
                   "one expert of one layer = 9.4 MB at ~3 TB/s; expert LoRA = 12.8 KB per rank"),
    )
}


def measured_profiles(directory: Path = PROFILE_DIR) -> dict[str, CostProfile]:
    """The measured profiles in ``directory`` by name (each file's name is its profile's name + ``.json``)."""
    out = {}
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else ():
        profile = CostProfile.from_json(path)
        if profile.name != path.stem:
            raise SimInputError(f"profile {str(path)!r}: name {profile.name!r} must match the file name")
        if profile.name in ESTIMATES:
            raise SimInputError(f"profile {str(path)!r}: {profile.name!r} is a built-in estimate's name")
        out[profile.name] = profile
    return out


MEASURED_PROFILES = measured_profiles()
BUILTIN_PROFILES = {**ESTIMATES, **MEASURED_PROFILES}


def preferred(name: str, measured: dict[str, CostProfile] | None = None) -> str:
    """``name``, or the measured profile that replaces it: ``X`` for the estimate ``X-estimate``."""
    measured = MEASURED_PROFILES if measured is None else measured
    if name.endswith(ESTIMATE_SUFFIX) and name[:-len(ESTIMATE_SUFFIX)] in measured:
        return name[:-len(ESTIMATE_SUFFIX)]
    return name


DEFAULT_PROFILE = preferred("llama3-8b-h100-estimate")  # llama3-8b-h100 once measured and committed


def load_profile(spec: str, base_dir: Path | None = None) -> CostProfile:
    """A built-in profile by name, or a JSON file (relative paths from ``base_dir``)."""
    if spec in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[spec]
    path = Path(spec)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if path.suffix != ".json" and not path.exists():
        raise SimInputError(f"profile {spec!r} is neither a built-in profile {sorted(BUILTIN_PROFILES)} "
                            f"nor a JSON file")
    return CostProfile.from_json(path)
