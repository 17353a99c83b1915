"""`SimConfig`: one simulation, read from TOML (standard-library ``tomllib``) and validated up front.

Sections and their fields (every field optional; unknown ones are an error)::

    name = "study"            # free text, copied into every record
    seed = 0                  # the workload's random streams (arrivals, adapters, lengths, tenants)
    [model]    preset = "llama3-8b" | "qwen3-30b-a3b" | "tiny", or the fields of unipage.config.ModelConfig
    [pool]     num_pages, block_tokens, prefix_caching               (unipage.config.PoolConfig)
    [lora]     max_rank, max_adapters_per_batch, host_cache_bytes, eviction_policy (any registered one,
               "belady" included), h2d_bytes_per_s, disk_bytes_per_s  (unipage.config.LoRAConfig;
               the bandwidths default to the profile's)
    [scheduler] the fields of unipage.scheduler.SchedulerConfig; slo_ttft_s defaults to [slo] ttft_s and
               step_time_s to the profile's time of a step at the full token budget
    [workload] see WorkloadConfig (synthetic) or trace = "file.csv" (replay)
    [slo]      ttft_s, tpot_s: a request meets its SLO if both hold
    [sim]      profile (a built-in name or a JSON file), sample_interval_s, check_every

Bad input raises `SimInputError` naming the file, the section and the field.
Relative paths (trace, profile) are read from the config file's directory.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import tomllib
from unipage.scheduler import SchedulerConfig
from unipage.sim.errors import SimInputError
from unipage.sim.profile import DEFAULT_PROFILE, CostProfile, load_profile

from unipage.config import LoRAConfig, ModelConfig, PoolConfig, UnipageConfig

MODEL_PRESETS = {
    "llama3-8b": ModelConfig(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                             intermediate_size=14336),
    "qwen3-30b-a3b": ModelConfig(num_layers=48, hidden_size=2048, num_heads=32, num_kv_heads=4, head_dim=128,
                                 num_experts=128, top_k=8, expert_intermediate_size=768),
    "tiny": ModelConfig(num_layers=2, hidden_size=128, num_heads=2, num_kv_heads=1, head_dim=64,
                        intermediate_size=256, dtype="float32"),
}
PRESET_PROFILES = {"llama3-8b": DEFAULT_PROFILE, "qwen3-30b-a3b": "qwen3-30b-a3b-h100-estimate",
                   "tiny": DEFAULT_PROFILE}
LENGTH_DISTS = ("fixed", "uniform", "lognormal", "histogram")
POPULARITIES = ("uniform", "zipf", "power")
TARGETS = ("attention", "all")
TRACE_FORMATS = ("auto", "unipage", "azure")

# CLI flag -> (section, field) it overrides; None = top level.
OVERRIDES = {
    "seed": (None, "seed"), "rate": ("workload", "rate"), "cv": ("workload", "cv"),
    "policy": ("scheduler", "policy"), "admission": ("scheduler", "admission"),
    "eviction": ("lora", "eviction_policy"), "pool_pages": ("pool", "num_pages"),
    "duration": ("workload", "duration_s"), "requests": ("workload", "num_requests"),
    "adapters": ("workload", "num_adapters"), "popularity": ("workload", "popularity"),
    "trace": ("workload", "trace"), "profile": ("sim", "profile"),
}


def _check(cond: bool, where: str, allowed: str, value: object) -> None:
    if not cond:
        raise SimInputError(f"{where} must be {allowed}, got {value!r}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class LengthSpec:
    """A token-length distribution: fixed, uniform [low, high], lognormal (median, sigma) or a histogram."""

    dist: str = "fixed"  # fixed, uniform, lognormal or histogram
    value: int = 128  # fixed: the length, >= 1
    low: int = 1  # uniform: smallest length, >= 1
    high: int = 256  # uniform: largest length, >= low
    median: float = 128.0  # lognormal: median length, > 0
    sigma: float = 1.0  # lognormal: sigma of the underlying normal, >= 0
    edges: tuple[int, ...] = ()  # histogram: bin edges, increasing, >= 1; a length is uniform within its bin
    weights: tuple[float, ...] = ()  # histogram: one weight per bin (len(edges) - 1), >= 0, sum > 0
    max: int = 0  # clip lengths to this (0: only max_model_len clips)

    def validate(self, where: str) -> None:
        _check(self.dist in LENGTH_DISTS, f"{where}.dist", f"one of {list(LENGTH_DISTS)}", self.dist)
        _check(_is_int(self.max) and self.max >= 0, f"{where}.max", "an integer >= 0", self.max)
        if self.dist == "fixed":
            _check(_is_int(self.value) and self.value >= 1, f"{where}.value", "an integer >= 1", self.value)
        elif self.dist == "uniform":
            _check(_is_int(self.low) and self.low >= 1, f"{where}.low", "an integer >= 1", self.low)
            _check(_is_int(self.high) and self.high >= self.low, f"{where}.high", f"an integer >= low={self.low}",
                   self.high)
        elif self.dist == "lognormal":
            _check(_is_num(self.median) and self.median > 0, f"{where}.median", "> 0", self.median)
            _check(_is_num(self.sigma) and self.sigma >= 0, f"{where}.sigma", ">= 0", self.sigma)
        else:
            e, w = self.edges, self.weights
            _check(len(e) >= 2 and all(_is_int(x) and x >= 1 for x in e) and all(a < b for a, b in itertools.pairwise(e)),
                   f"{where}.edges", "at least two increasing integers >= 1", list(e))
            _check(len(w) == len(e) - 1 and all(_is_num(x) and x >= 0 for x in w) and sum(w) > 0,
                   f"{where}.weights", f"{len(e) - 1} numbers >= 0 with a positive sum", list(w))

    def to_dict(self) -> dict:
        keys = {"fixed": ("value",), "uniform": ("low", "high"), "lognormal": ("median", "sigma"),
                "histogram": ("edges", "weights")}[self.dist]
        out = {"dist": self.dist, **{k: getattr(self, k) for k in keys}}
        out.update({k: list(v) for k, v in out.items() if isinstance(v, tuple)})
        if self.max:
            out["max"] = self.max
        return out


@dataclass(frozen=True)
class WorkloadConfig:
    """Synthetic workload (or a trace to replay, with adapters from the popularity model where it has none)."""

    num_requests: int = 0  # requests to generate; 0: as many as arrive within duration_s
    duration_s: float = 60.0  # seconds of arrivals (when num_requests is 0), > 0
    rate: float = 5.0  # mean arrival rate, requests/s, > 0
    cv: float = 1.0  # coefficient of variation of Gamma inter-arrival times (1 = Poisson), > 0
    num_adapters: int = 100  # adapters registered; 0 = base model only
    popularity: str = "zipf"  # adapter choice: uniform, zipf (p_i ~ 1/i^zipf_s) or power (S-LoRA)
    zipf_s: float = 1.0  # zipf exponent, > 0
    power_alpha: float = 0.3  # S-LoRA's power law: adapter = floor(np.random.power(alpha) * n), > 0
    base_fraction: float = 0.0  # share of requests for the base model (no adapter), in [0, 1]
    ranks: tuple[int, ...] = (8, 16, 32, 64)  # LoRA ranks of the adapters
    rank_weights: tuple[float, ...] = ()  # probability of each rank (normalised); empty = equal
    targets: str = "attention"  # LoRA targets: attention (q, k, v, o) or all (+ MLP, or experts for MoE)
    input: LengthSpec = LengthSpec("lognormal", median=256.0, sigma=0.8, max=2048)  # prompt tokens
    output: LengthSpec = LengthSpec("lognormal", median=128.0, sigma=0.8, max=1024)  # generated tokens
    tenants: int = 1  # tenants (the VTC policy can count per tenant), >= 1
    tenant_popularity: str = "uniform"  # tenant of a request: uniform or zipf (zipf_s)
    prefix_tokens: int = 0  # prompt tokens shared by all requests of one adapter (a system prompt), >= 0
    trace: str = ""  # CSV to replay: "timestamp,adapter,input_tokens,output_tokens" or the Azure format
    trace_format: str = "auto"  # auto (from the header), unipage or azure
    speedup: float = 1.0  # replay: divide the trace's timestamps by this, > 0
    max_requests: int = 0  # replay: the first this many rows only; 0 = all

    def validate(self) -> None:
        w = "[workload]"
        _check(_is_int(self.num_requests) and self.num_requests >= 0, f"{w} num_requests", "an integer >= 0",
               self.num_requests)
        for key in ("duration_s", "rate", "cv", "zipf_s", "power_alpha", "speedup"):
            value = getattr(self, key)
            _check(_is_num(value) and value > 0, f"{w} {key}", "a number > 0", value)
        _check(_is_int(self.num_adapters) and self.num_adapters >= 0, f"{w} num_adapters", "an integer >= 0",
               self.num_adapters)
        _check(self.popularity in POPULARITIES, f"{w} popularity", f"one of {list(POPULARITIES)}", self.popularity)
        _check(self.tenant_popularity in ("uniform", "zipf"), f"{w} tenant_popularity", "uniform or zipf",
               self.tenant_popularity)
        _check(_is_num(self.base_fraction) and 0 <= self.base_fraction <= 1, f"{w} base_fraction", "in [0, 1]",
               self.base_fraction)
        _check(len(self.ranks) >= 1 and all(_is_int(r) and r >= 1 for r in self.ranks), f"{w} ranks",
               "a non-empty list of integers >= 1", list(self.ranks))
        _check(not self.rank_weights or (len(self.rank_weights) == len(self.ranks)
                                         and all(_is_num(x) and x >= 0 for x in self.rank_weights)
                                         and sum(self.rank_weights) > 0),
               f"{w} rank_weights", f"empty or {len(self.ranks)} numbers >= 0 with a positive sum",
               list(self.rank_weights))
        _check(self.targets in TARGETS, f"{w} targets", f"one of {list(TARGETS)}", self.targets)
        _check(_is_int(self.tenants) and self.tenants >= 1, f"{w} tenants", "an integer >= 1", self.tenants)
        for key in ("prefix_tokens", "max_requests"):
            value = getattr(self, key)
            _check(_is_int(value) and value >= 0, f"{w} {key}", "an integer >= 0", value)
        _check(self.trace_format in TRACE_FORMATS, f"{w} trace_format", f"one of {list(TRACE_FORMATS)}",
               self.trace_format)
        _check(isinstance(self.trace, str), f"{w} trace", "a path", self.trace)
        self.input.validate(f"{w} input")
        self.output.validate(f"{w} output")

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, LengthSpec) else (
                list(value) if isinstance(value, tuple) else value)
        if not self.trace:
            for key in ("trace", "trace_format", "speedup", "max_requests"):
                del out[key]
        return out


@dataclass(frozen=True)
class SLOConfig:
    """Service-level objectives: a request attains its SLO if both hold (aborted requests never do)."""

    ttft_s: float = 2.0  # time to first token, > 0
    tpot_s: float = 0.2  # time per output token after the first, > 0


@dataclass(frozen=True)
class SimConfig:
    """Everything one simulation needs, validated."""

    name: str
    seed: int
    model_preset: str  # "" when the model was given field by field
    model: ModelConfig
    pool: PoolConfig
    lora: LoRAConfig
    scheduler: SchedulerConfig
    workload: WorkloadConfig
    slo: SLOConfig
    profile: CostProfile
    sample_interval_s: float = 0.0  # occupancy sampling period; 0 = about 400 samples over the run
    check_every: int = 0  # run every invariant check of the pool and scheduler every this many steps (0 = never)
    base_dir: Path = field(default=Path("."), compare=False)  # where relative paths are read from

    @property
    def unipage_config(self) -> UnipageConfig:
        return UnipageConfig(self.model, self.pool, self.lora)

    @property
    def trace_path(self) -> Path | None:
        if not self.workload.trace:
            return None
        path = Path(self.workload.trace)
        return path if path.is_absolute() else self.base_dir / path

    def to_dict(self) -> dict:
        """The resolved configuration, as a record carries it (JSON-ready, deterministic)."""
        lora = dataclasses.asdict(self.lora)
        del lora["adapter_roots"]
        model = {"preset": self.model_preset} if self.model_preset else dataclasses.asdict(self.model)
        if not self.model_preset:
            model["mlp_only_layers"] = list(model["mlp_only_layers"])
        return {"name": self.name, "seed": self.seed, "model": model,
                "pool": {"num_pages": self.unipage_config.num_pages, "block_tokens": self.pool.block_tokens,
                         "prefix_caching": self.pool.prefix_caching},
                "lora": lora, "scheduler": dataclasses.asdict(self.scheduler), "workload": self.workload.to_dict(),
                "slo": dataclasses.asdict(self.slo),
                "sim": {"profile": self.profile.name, "sample_interval_s": self.sample_interval_s,
                        "cost": {k: v for k, v in self.profile.to_dict().items() if k not in ("name", "source")}}}


# -- parsing ------------------------------------------------------------------
_SECTIONS = ("model", "pool", "lora", "scheduler", "workload", "slo", "sim")
_TOP = ("name", "seed")
_SIM_KEYS = ("profile", "sample_interval_s", "check_every")


def read_toml(path: str | Path) -> dict:
    """The raw TOML table of a config file."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as err:
        raise SimInputError(f"{path}: cannot read the config: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise SimInputError(f"{path}: not valid TOML: {err}") from None


def to_toml(raw: dict) -> str:
    """A raw config table as TOML text (scalars, lists and inline tables: what configs hold)."""
    def value(v) -> str:
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + "}"
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(map(value, v)) + "]"
        return json.dumps(v)

    lines = [f"{k} = {value(v)}" for k, v in raw.items() if not isinstance(v, dict)]
    for section, table in raw.items():
        if isinstance(table, dict):
            lines += ["", f"[{section}]"] + [f"{k} = {value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def apply_overrides(raw: dict, overrides: dict) -> dict:
    """A copy of ``raw`` with CLI values set (keys of `OVERRIDES`; None values are ignored)."""
    raw = copy.deepcopy(raw)
    for key, value in overrides.items():
        if value is None:
            continue
        section, name = OVERRIDES[key]
        table = raw if section is None else raw.setdefault(section, {})
        if not isinstance(table, dict):
            raise SimInputError(f"[{section}] must be a table, got {table!r}")
        table[name] = value
    return raw


def load_config(path: str | Path, overrides: dict | None = None) -> SimConfig:
    """Read, override and validate a config file."""
    path = Path(path)
    raw = apply_overrides(read_toml(path), overrides or {})
    return build_config(raw, path.resolve().parent, str(path))


def build_config(raw: dict, base_dir: Path = Path("."), where: str = "config") -> SimConfig:
    """Validate a raw config table (as read from TOML) into a `SimConfig`."""
    try:
        return _build(raw, Path(base_dir))
    except SimInputError as err:
        raise SimInputError(f"{where}: {err}") from None


def _table(raw: dict, name: str, allowed) -> dict:
    table = raw.get(name, {})
    if not isinstance(table, dict):
        raise SimInputError(f"[{name}] must be a table, got {table!r}")
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise SimInputError(f"[{name}]: unknown field(s) {unknown}; known: {sorted(allowed)}")
    return dict(table)


def _fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _make(cls, section: str, values: dict):
    """``cls(**values)``, turning the real configs' ValueError into a SimInputError naming the section."""
    try:
        return cls(**values)
    except SimInputError:
        raise
    except (ValueError, TypeError) as err:
        raise SimInputError(f"[{section}] {err}") from None


def _build(raw: dict, base_dir: Path) -> SimConfig:
    unknown = sorted(set(raw) - set(_SECTIONS) - set(_TOP))
    if unknown:
        raise SimInputError(f"unknown top-level key(s) {unknown}; known: {sorted(_SECTIONS + _TOP)}")
    name, seed = raw.get("name", ""), raw.get("seed", 0)
    _check(isinstance(name, str), "name", "a string", name)
    _check(_is_int(seed) and seed >= 0, "seed", "an integer >= 0", seed)
    preset, model = _model(raw)
    sim = _table(raw, "sim", _SIM_KEYS)
    profile = load_profile(sim.get("profile") or PRESET_PROFILES.get(preset, DEFAULT_PROFILE), base_dir)
    sample = sim.get("sample_interval_s", 0.0)
    _check(_is_num(sample) and sample >= 0, "[sim] sample_interval_s", "a number >= 0", sample)
    check_every = sim.get("check_every", 0)
    _check(_is_int(check_every) and check_every >= 0, "[sim] check_every", "an integer >= 0", check_every)
    pool = _make(PoolConfig, "pool", {"num_pages": 4096, **_table(raw, "pool", _fields(PoolConfig))})
    lora_raw = _table(raw, "lora", [f for f in _fields(LoRAConfig) if f != "adapter_roots"])
    lora_raw.setdefault("max_adapters_per_batch", 32)
    lora_raw.setdefault("host_cache_bytes", 4 << 30)
    lora_raw.setdefault("h2d_bytes_per_s", profile.h2d_bytes_per_s)
    lora_raw.setdefault("disk_bytes_per_s", profile.disk_bytes_per_s)
    lora_raw.setdefault("recompute_s_per_token", profile.prefill_token_s or 20e-6)
    lora = _make(LoRAConfig, "lora", lora_raw)
    slo = _make(SLOConfig, "slo", _table(raw, "slo", _fields(SLOConfig)))
    _check(_is_num(slo.ttft_s) and slo.ttft_s > 0, "[slo] ttft_s", "a number > 0", slo.ttft_s)
    _check(_is_num(slo.tpot_s) and slo.tpot_s > 0, "[slo] tpot_s", "a number > 0", slo.tpot_s)
    sched_raw = _table(raw, "scheduler", _fields(SchedulerConfig))
    sched_raw.setdefault("slo_ttft_s", slo.ttft_s)
    budget = sched_raw.get("max_num_batched_tokens", SchedulerConfig.max_num_batched_tokens)
    if _is_num(budget):
        sched_raw.setdefault("step_time_s", profile.step_base_s + budget * profile.prefill_token_s or 0.03)
    scheduler = _make(SchedulerConfig, "scheduler", sched_raw)
    workload = _workload(_table(raw, "workload", _fields(WorkloadConfig)))
    config = SimConfig(name, seed, preset, model, pool, lora, scheduler, workload, slo, profile,
                       float(sample), check_every, base_dir)
    try:
        config.unipage_config  # noqa: B018 - validates the pool against the model
    except ValueError as err:
        raise SimInputError(f"[pool] {err}") from None
    return config


def _model(raw: dict) -> tuple[str, ModelConfig]:
    table = _table(raw, "model", ["preset"] + _fields(ModelConfig))
    preset = table.pop("preset", "" if table else "llama3-8b")
    if preset:
        _check(preset in MODEL_PRESETS, "[model] preset", f"one of {sorted(MODEL_PRESETS)}", preset)
        if table:
            raise SimInputError(f"[model]: give a preset or the model's fields, not both (got {sorted(table)})")
        return preset, MODEL_PRESETS[preset]
    return "", _make(ModelConfig, "model", table)


def _length(value: object, where: str, default: LengthSpec) -> LengthSpec:
    if isinstance(value, LengthSpec):
        return value
    if not isinstance(value, dict):
        raise SimInputError(f"{where} must be a table like {{dist = \"fixed\", value = 128}}, got {value!r}")
    unknown = sorted(set(value) - set(_fields(LengthSpec)))
    if unknown:
        raise SimInputError(f"{where}: unknown field(s) {unknown}; known: {sorted(_fields(LengthSpec))}")
    value = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
    base = default if value.get("dist", default.dist) == default.dist else LengthSpec()
    spec = dataclasses.replace(base, **value)
    spec.validate(where)
    return spec


def _workload(table: dict) -> WorkloadConfig:
    defaults = WorkloadConfig()
    for key in ("input", "output"):
        if key in table:
            table[key] = _length(table[key], f"[workload] {key}", getattr(defaults, key))
    for key in ("ranks", "rank_weights"):
        if key in table:
            _check(isinstance(table[key], list), f"[workload] {key}", "a list", table[key])
            table[key] = tuple(table[key])
    for key in ("duration_s", "rate", "cv", "zipf_s", "power_alpha", "speedup", "base_fraction"):
        if _is_int(table.get(key)):
            table[key] = float(table[key])
    workload = _make(WorkloadConfig, "workload", table)
    workload.validate()
    return workload
