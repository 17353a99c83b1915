"""Workloads: seeded synthetic request streams, and trace replay.  numpy, no torch.

A `Trace` is the whole request stream up front, as arrays (the simulator adds
each request when its arrival time comes; Belady's policy reads the future
from it).  Length legend: N = requests, A = adapters.

Synthetic (`synthesize`): independent random streams per aspect, all derived
from the seed, so changing the rate keeps the adapters and lengths of the
requests and only rescales their arrival times (common random numbers across a
sweep):

- arrivals: Gamma inter-arrival times of mean ``1/rate`` and coefficient of
  variation ``cv`` (shape ``1/cv**2``; ``cv = 1`` is a Poisson process);
- adapters: ``uniform``; ``zipf`` (adapter ``i`` with probability
  proportional to ``1/(i+1)**s``); ``power`` (S-LoRA's
  ``int(np.random.power(alpha) * n)``: small alpha = skewed); a share
  ``base_fraction`` of requests uses the base model;
- each adapter's rank drawn from the rank mix;
- lengths: fixed, uniform, lognormal or a histogram, clipped to ``max`` and
  so that prompt + output fits ``max_model_len`` (clipped requests are
  counted);
- tenants: uniform or zipf.

Replay (`read_trace`): a CSV with a header, either
``timestamp,adapter,input_tokens,output_tokens[,tenant]`` (seconds; an empty
adapter is the base model) or the Azure LLM inference trace
``TIMESTAMP,ContextTokens,GeneratedTokens`` (ISO date-times or seconds;
adapters drawn from the popularity model).  A malformed row is a
`SimInputError` naming its line.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
from unipage.sim.config import LengthSpec, SimConfig, WorkloadConfig
from unipage.sim.errors import SimInputError

UNIPAGE_HEADER = ("timestamp", "adapter", "input_tokens", "output_tokens")
AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass
class Trace:
    """A request stream, sorted by arrival."""

    arrival: np.ndarray  # [N] float64 seconds from 0, non-decreasing
    adapter: np.ndarray  # [N] int32 index into adapter_names; -1 = base model
    input_tokens: np.ndarray  # [N] int32 >= 1
    output_tokens: np.ndarray  # [N] int32 >= 1
    tenant: np.ndarray  # [N] int32 index into tenant_names
    adapter_names: list[str]  # [A]
    adapter_ranks: list[int]  # [A]
    tenant_names: list[str]
    clipped: int = 0  # requests whose lengths were clipped to fit max_model_len / the length caps

    def __len__(self) -> int:
        return len(self.arrival)

    def arrivals_by_adapter(self) -> dict[str, list[float]]:
        """Adapter name -> its requests' arrival times, sorted (what Belady's policy looks ahead in)."""
        out: dict[str, list[float]] = {name: [] for name in self.adapter_names}
        for t, a in zip(self.arrival.tolist(), self.adapter.tolist()):
            if a >= 0:
                out[self.adapter_names[a]].append(t)
        return out


def _streams(seed: int) -> dict[str, np.random.Generator]:
    children = np.random.SeedSequence(seed).spawn(6)
    return {name: np.random.default_rng(s) for name, s in
            zip(("arrival", "adapter", "rank", "input", "output", "tenant"), children)}


def gamma_arrivals(rng: np.random.Generator, n: int, rate: float, cv: float) -> np.ndarray:
    """``n`` arrival times of a renewal process with Gamma gaps of mean ``1/rate`` and CV ``cv``."""
    shape = 1.0 / (cv * cv)
    gaps = rng.gamma(shape, 1.0 / shape, size=n)  # mean 1, CV cv: rescaled per rate below
    return np.cumsum(gaps) / rate


def choose_adapters(rng: np.random.Generator, n: int, w: WorkloadConfig) -> np.ndarray:
    """Adapter index per request (0 is the most popular under zipf and power); -1 = base model."""
    a = w.num_adapters
    if a == 0:
        return np.full(n, -1, dtype=np.int32)
    if w.popularity == "uniform":
        idx = rng.integers(0, a, size=n)
    elif w.popularity == "zipf":
        cdf = np.cumsum(1.0 / np.arange(1, a + 1) ** w.zipf_s)
        idx = np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right")
    else:  # S-LoRA: (np.random.power(alpha, n) * num_adapters).astype(int)
        idx = (rng.power(w.power_alpha, size=n) * a).astype(np.int64)
    idx = np.minimum(idx, a - 1).astype(np.int32)
    if w.base_fraction > 0:
        idx[rng.random(n) < w.base_fraction] = -1
    return idx


def sample_lengths(rng: np.random.Generator, n: int, spec: LengthSpec) -> np.ndarray:
    if spec.dist == "fixed":
        out = np.full(n, spec.value, dtype=np.int64)
    elif spec.dist == "uniform":
        out = rng.integers(spec.low, spec.high + 1, size=n)
    elif spec.dist == "lognormal":
        out = np.rint(rng.lognormal(np.log(spec.median), spec.sigma, size=n)).astype(np.int64)
    else:
        edges = np.asarray(spec.edges, dtype=np.int64)
        p = np.asarray(spec.weights, dtype=np.float64)
        bins = rng.choice(len(p), size=n, p=p / p.sum())
        out = rng.integers(edges[bins], edges[bins + 1])
    out = np.maximum(out, 1)
    return np.minimum(out, spec.max) if spec.max else out


def adapter_ranks(rng: np.random.Generator, a: int, w: WorkloadConfig) -> list[int]:
    weights = np.asarray(w.rank_weights or [1.0] * len(w.ranks), dtype=np.float64)
    return [int(r) for r in rng.choice(np.asarray(w.ranks), size=a, p=weights / weights.sum())]


def _tenants(rng: np.random.Generator, n: int, w: WorkloadConfig) -> np.ndarray:
    if w.tenants == 1:
        return np.zeros(n, dtype=np.int32)
    if w.tenant_popularity == "uniform":
        return rng.integers(0, w.tenants, size=n).astype(np.int32)
    cdf = np.cumsum(1.0 / np.arange(1, w.tenants + 1) ** w.zipf_s)
    return np.minimum(np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right"), w.tenants - 1).astype(np.int32)


def _fit(inputs: np.ndarray, outputs: np.ndarray, max_model_len: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Clip so that prompt < max_model_len and prompt + output <= max_model_len."""
    fit_in = np.minimum(inputs, max_model_len - 1)
    fit_out = np.clip(outputs, 1, max_model_len - fit_in)
    clipped = int(np.count_nonzero((fit_in != inputs) | (fit_out != outputs)))
    return fit_in.astype(np.int32), fit_out.astype(np.int32), clipped


def synthesize(config: SimConfig) -> Trace:
    """The seeded synthetic request stream of ``config.workload``."""
    w, rng = config.workload, _streams(config.seed)
    n = w.num_requests
    if n:
        arrival = gamma_arrivals(rng["arrival"], n, w.rate, w.cv)
    else:  # enough unit-rate gaps to cover duration_s, then cut
        arrival = np.empty(0)
        size = int(w.rate * w.duration_s * 1.2 + 10 * np.sqrt(w.rate * w.duration_s) + 16)
        while arrival.size == 0 or arrival[-1] < w.duration_s:
            rng["arrival"] = _streams(config.seed)["arrival"]  # same stream, longer draw
            arrival = gamma_arrivals(rng["arrival"], size, w.rate, w.cv)
            size *= 2
        arrival = arrival[arrival < w.duration_s]
        n = arrival.size
    adapters = choose_adapters(rng["adapter"], n, w)
    inputs, outputs, clipped = _fit(sample_lengths(rng["input"], n, w.input),
                                    sample_lengths(rng["output"], n, w.output), config.scheduler.max_model_len)
    return Trace(arrival.astype(np.float64), adapters, inputs, outputs, _tenants(rng["tenant"], n, w),
                 [f"a{i}" for i in range(w.num_adapters)], adapter_ranks(rng["rank"], w.num_adapters, w),
                 [f"t{i}" for i in range(w.tenants)], clipped)


def load_trace(config: SimConfig) -> Trace:
    """The request stream of ``config``: its trace file if it names one, else the synthetic workload."""
    path = config.trace_path
    return read_trace(path, config) if path is not None else synthesize(config)


# -- trace replay ------------------------------------------------------------
def _timestamp(text: str, where: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise SimInputError(f"{where}: timestamp {text!r} is neither seconds nor an ISO date-time") from None


def _count(text: str, where: str, name: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise SimInputError(f"{where}: {name} {text!r} is not an integer") from None
    if value < low:
        raise SimInputError(f"{where}: {name} must be >= {low}, got {value}")
    return value


def _header_format(header: list[str], fmt: str, where: str) -> str:
    cols = tuple(h.strip() for h in header)
    found = "unipage" if cols[:4] == UNIPAGE_HEADER and len(cols) in (4, 5) and cols[4:] in ((), ("tenant",)) \
        else "azure" if cols == AZURE_HEADER else None
    if found is None or (fmt != "auto" and fmt != found):
        expected = {"unipage": ",".join(UNIPAGE_HEADER) + "[,tenant]", "azure": ",".join(AZURE_HEADER)}
        want = " or ".join(expected.values()) if fmt == "auto" else expected[fmt]
        raise SimInputError(f"{where} line 1: header {','.join(cols)!r} is not {want!r}")
    return found


def read_trace(path: Path, config: SimConfig) -> Trace:
    """Parse a trace CSV (every row checked; errors name the line) into a `Trace`."""
    w, where = config.workload, str(path)
    try:
        f = path.open(newline="")
    except OSError as err:
        raise SimInputError(f"trace {where}: cannot read it: {err.strerror}") from None
    with f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise SimInputError(f"trace {where}: empty file (expected a header line)")
        fmt = _header_format(header, w.trace_format, f"trace {where}")
        times, names, inputs, outputs, tenants = [], [], [], [], []
        for row in reader:
            line = reader.line_num
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            loc = f"trace {where} line {line}"
            if len(row) != len(header):
                raise SimInputError(f"{loc}: expected {len(header)} fields, got {len(row)}")
            t = _timestamp(row[0], loc)
            if times and t < times[-1]:
                raise SimInputError(f"{loc}: timestamp goes backwards ({row[0]!r})")
            times.append(t)
            if fmt == "unipage":
                names.append(row[1].strip())
                inputs.append(_count(row[2], loc, "input_tokens", 1))
                outputs.append(_count(row[3], loc, "output_tokens", 1))
                tenants.append(row[4].strip() if len(row) == 5 else "")
            else:
                inputs.append(_count(row[1], loc, "ContextTokens", 1))
                outputs.append(_count(row[2], loc, "GeneratedTokens", 0))  # 0 is clipped to 1 (counted)
            if w.max_requests and len(times) == w.max_requests:
                break
    if not times:
        raise SimInputError(f"trace {where}: no requests")
    return _from_rows(config, times, names, inputs, outputs, tenants)


def _from_rows(config: SimConfig, times, names, inputs, outputs, tenants) -> Trace:
    w, rng = config.workload, _streams(config.seed)
    arrival = (np.asarray(times, dtype=np.float64) - times[0]) / w.speedup
    n = len(times)
    if names:  # adapters named by the trace, ranks from the rank mix in order of first appearance
        adapter_names = list(dict.fromkeys(name for name in names if name))
        index = {name: i for i, name in enumerate(adapter_names)}
        adapters = np.asarray([index[name] if name else -1 for name in names], dtype=np.int32)
    else:  # Azure: adapters from the popularity model
        adapter_names = [f"a{i}" for i in range(w.num_adapters)]
        adapters = choose_adapters(rng["adapter"], n, w)
    if tenants and any(tenants):
        tenant_names = list(dict.fromkeys(tenants))
        tindex = {name: i for i, name in enumerate(tenant_names)}
        tenant = np.asarray([tindex[t] for t in tenants], dtype=np.int32)
    else:
        tenant_names = [f"t{i}" for i in range(w.tenants)]
        tenant = _tenants(rng["tenant"], n, w)
    fit_in, fit_out, clipped = _fit(np.asarray(inputs), np.asarray(outputs), config.scheduler.max_model_len)
    return Trace(arrival, adapters, fit_in, fit_out, tenant, adapter_names,
                 adapter_ranks(rng["rank"], len(adapter_names), w), tenant_names, clipped)
