"""Drive an `Engine` step by step for `benchmarks/serve.py`: closed-loop or all-at-once submission,
timestamps per request, and one row of cost-model terms per engine step.

Timestamps are ``time.perf_counter()`` seconds from the first submission,
taken when ``Engine.step()`` returns (on CUDA it returns after sampling has
synchronised the tokens to the host).  A closed loop of concurrency ``C``
submits ``C`` requests, then one more each time one finishes, right after the
step that finished it.

Step rows hold the simulator's cost terms (see `unipage.sim.profile`), taken
from the step's `SchedulerOutput` and the scheduler's requests just after
``schedule()`` (the engine's ``schedule`` is wrapped for the run), so a fit
of measured step times gives the coefficients of a `CostProfile`.  They hold
the step's launch time too: seconds from the step's start until the engine
submits its file reads (then performs its adapter effects and polls its
reads), once the forward pass is launched (the storage's ``start_reads`` is
wrapped for the run); a fit of those gives the profile's ``launch_*`` terms
(when in a step its reads start, and a finished read's copy).  And the seconds the
step spent in the storage's ``start_reads``, ``apply`` and ``poll`` (the step loop's
share of adapter loading), of which reading files on the step loop's thread and
finishing reads (copies launched, host copies kept; `storage.LoopTimes`): diagnostics
no fit uses.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from serve_models import DecodeFloor, experts_touched
from typing_extensions import Self
from unipage.scheduler import Request, SamplingParams

GREEDY = SamplingParams(temperature=0)
# One row per step: the cost model's terms (without its constant), loads, wall seconds, the floor's bytes.
COLUMNS = ("prefill", "decode", "kv_read", "adapters", "adapter_ranks", "token_ranks", "experts", "lora_experts",
           "loads", "loads_disk", "seconds", "floor_weights", "floor_lora", "floor_kv", "launch", "storage",
           "storage_read", "storage_finish")
TERMS = ("prefill", "decode", "kv_read", "adapters", "adapter_ranks", "token_ranks", "experts", "lora_experts",
         "loads")  # the fitted terms, in `CostProfile` coefficient order after step_base_s


def log(message: str) -> None:
    print(f"[serve] {message}", file=sys.stderr, flush=True)


@dataclass
class Workload:
    """Requests of one run, in submission order."""

    name: str  # request ids are "<name>-<i>"
    prompts: list[list[int]]
    adapters: list[str | None]  # per request; None = base model
    outputs: list[int]  # exact output lengths (no stop tokens)
    concurrency: int  # requests kept in flight; >= len(prompts) submits all at once

    def __post_init__(self) -> None:
        n = len(self.prompts)
        if n < 1 or len(self.adapters) != n or len(self.outputs) != n:
            raise ValueError(f"workload {self.name!r}: {n} prompts, {len(self.adapters)} adapters, "
                             f"{len(self.outputs)} outputs; need the same number >= 1")
        if self.concurrency < 1:
            raise ValueError(f"workload {self.name!r}: concurrency must be >= 1, got {self.concurrency}")


def make_workload(name: str, n: int, prompt_len: int, output_len: int, adapters: list[str | None],
                  concurrency: int, vocab: int, seed: int) -> Workload:
    """Random prompts (no shared prefixes), fixed lengths, ``adapters[i]`` for request ``i``."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, vocab, size=(n, prompt_len)).tolist()
    return Workload(name, prompts, list(adapters), [output_len] * n, concurrency)


class StepLog:
    """Rows of `COLUMNS`, one per engine step that ran a batch, while attached to an engine."""

    def __init__(self, engine, ranks: dict[str, int], floor: DecodeFloor) -> None:
        self.engine, self.ranks, self.floor = engine, ranks, floor
        model = engine.config.model
        self.model = model
        self.moe_layers = sum(map(model.is_moe_layer, range(model.num_layers)))
        self.rows: list[list[float]] = []  # filled when the block ends (`__exit__`)
        self._taken: list[tuple] = []  # per step that ran a batch: what its row is made of
        self.loads: dict[str, list] = {"adapter": [], "issued": [], "ready": [], "from_host": [], "failed": []}
        self._issued: dict[str, int] = {}  # adapter -> its entry in `loads` while its load is in flight
        self.start = time.perf_counter()  # `drive` sets it to its first submission: the times' origin
        self._seen = None  # (counts, total, loads, contexts, adapters) of the step in flight
        self._launched: float | None = None  # when the step in flight submitted its file reads
        self._storage_s = 0.0  # seconds the step in flight spent in the storage's start_reads / apply / poll

    def __enter__(self) -> Self:
        sched, engine = self.engine.scheduler, self.engine
        schedule, start_reads, update = sched.schedule, engine.storage.start_reads, sched.update

        def schedule_and_note():
            out = schedule()
            loads = out.adapter_loads
            self._note_loads(loads)
            reqs = sched.requests
            self._seen = (out.num_scheduled_tokens, out.total_num_scheduled_tokens, loads,
                          [reqs[r].num_computed_tokens for r in out.req_ids], [reqs[r].adapter for r in out.req_ids])
            return out

        def start_reads_and_note(effects):  # once the forward pass is launched, first of the step's effects
            if self._launched is None:
                self._launched = time.perf_counter()
            return self._timed(start_reads, effects)

        def update_and_note(result):
            now = time.perf_counter() - self.start
            for name in result.loads_done:
                if name in self._issued:
                    self.loads["ready"][self._issued.pop(name)] = now
            for name in result.loads_failed:  # its ready time stays NaN
                if name in self._issued:
                    self.loads["failed"][self._issued.pop(name)] = True
            return update(result)

        sched.schedule, sched.update = schedule_and_note, update_and_note
        storage = engine.storage
        apply, poll = storage.apply, storage.poll
        storage.start_reads = start_reads_and_note
        storage.apply = lambda effects: self._timed(apply, effects)
        storage.poll = lambda: self._timed(poll)
        return self

    def _timed(self, fn, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._storage_s += time.perf_counter() - start

    def __exit__(self, exc_type, *exc) -> None:
        del self.engine.scheduler.schedule, self.engine.scheduler.update  # back to the classes' methods
        del self.engine.storage.start_reads, self.engine.storage.apply, self.engine.storage.poll
        if exc_type is None:  # (a run that raised keeps no rows: its error is what matters)
            self.rows += [self._row(*taken) for taken in self._taken]
        self._taken.clear()

    def _note_loads(self, loads) -> None:
        """Each load the scheduler starts (in any schedule, one that runs no batch too): when, and from where;
        its ready time (NaN until the engine reports it done; NaN for good if it failed) comes with the
        update that reports it."""
        now = time.perf_counter() - self.start
        for effect in loads:
            self._issued[effect.name] = len(self.loads["adapter"])
            for key, value in (("adapter", effect.name), ("issued", now), ("ready", float("nan")),
                               ("from_host", bool(effect.from_host)), ("failed", False)):
                self.loads[key].append(value)

    def step(self) -> list:
        """``engine.step()``, timed; a row is kept when the step ran a batch (made when the block ends, so
        that making it adds nothing to the serving loop's time between steps)."""
        self._launched, self._storage_s = None, 0.0
        loop = self.engine.storage.loop
        read, finish = loop.read, loop.finish
        start = time.perf_counter()
        outputs = self.engine.step()
        seconds = time.perf_counter() - start
        counts, total, loads, contexts, adapters = self._seen
        if counts:
            launch = self._launched - start if self._launched is not None else float("nan")
            storage = (self._storage_s, loop.read - read, loop.finish - finish)
            self._taken.append((counts, total, loads, contexts, adapters, seconds, launch, storage))
        return outputs

    def _row(self, counts: list[int], total: int, loads: list, contexts: list[int], adapters: list,
             seconds: float, launch: float, storage: tuple[float, float, float]) -> list[float]:
        """The step's row of `COLUMNS`."""
        decode = counts.count(1)
        per_adapter: dict[str, int] = {}
        for name, n in zip(adapters, counts):
            if name is not None:
                per_adapter[name] = per_adapter.get(name, 0) + n
        ranks = self.ranks
        moe, touched = self.moe_layers, experts_touched
        row = [total - decode, decode, sum(contexts), len(per_adapter), sum(ranks[a] for a in per_adapter),
               sum(ranks[a] * n for a, n in per_adapter.items()), moe * touched(self.model, total),
               moe * sum(ranks[a] * touched(self.model, n) for a, n in per_adapter.items()),
               len(loads), sum(1 for e in loads if not e.from_host), seconds]
        if decode == len(counts):
            floor = self.floor.bytes(contexts, list(per_adapter.values()))
            return row + [floor["weights"], floor["lora"], floor["kv"], launch, *storage]
        return row + [0.0, 0.0, 0.0, launch, *storage]


class DiskLog:
    """Bytes and seconds of the engine's adapter file reads (``PoolStorage.reads``) while inside the block."""

    def __init__(self, engine) -> None:
        self.engine, self.bytes, self.seconds = engine, 0, 0.0

    def __enter__(self) -> Self:
        reads = self.engine.storage.reads
        self._start = (reads.bytes, reads.seconds)
        return self

    def __exit__(self, *exc) -> None:
        reads = self.engine.storage.reads
        self.bytes, self.seconds = reads.bytes - self._start[0], reads.seconds - self._start[1]


@dataclass
class Timeline:
    """Per-request times (seconds from the first submission) and generated tokens."""

    submit: np.ndarray
    first: np.ndarray
    finish: np.ndarray
    tokens: np.ndarray


def drive(engine, work: Workload, steps: StepLog | None = None, progress_s: float = 10.0) -> Timeline:
    """Run ``work`` to completion on ``engine`` (nothing else may be in flight)."""
    if engine.has_unfinished():
        raise RuntimeError("the engine has unfinished requests; drive() needs it idle")
    n = len(work.prompts)
    submit, first, finish = (np.full(n, np.nan) for _ in range(3))
    tokens = np.zeros(n, dtype=np.int64)
    index = {f"{work.name}-{i}": i for i in range(n)}
    t0 = time.perf_counter()
    nxt, done, last_note = 0, 0, t0
    if steps is not None:
        steps.start = t0

    def add(i: int, now: float) -> None:
        engine.add_request(Request(f"{work.name}-{i}", work.prompts[i], work.adapters[i], GREEDY,
                                   max_tokens=work.outputs[i]))
        submit[i] = now - t0

    for nxt in range(min(work.concurrency, n)):
        add(nxt, time.perf_counter())
    nxt += 1
    step = steps.step if steps is not None else engine.step
    while done < n:
        outputs = step()
        now = time.perf_counter()
        for out in outputs:
            i = index[out.request_id]
            if out.new_token_ids and np.isnan(first[i]):
                first[i] = now - t0
            tokens[i] += len(out.new_token_ids)
            if out.finished:
                if out.finish_reason.value != "length":
                    raise RuntimeError(f"request {out.request_id} ended by {out.finish_reason.value}: "
                                       f"{out.detail}")
                finish[i], done = now - t0, done + 1
                if nxt < n:
                    add(nxt, now)
                    nxt += 1
        if now - last_note > progress_s:
            log(f"{work.name}: {done}/{n} requests done, {now - t0:.0f} s")
            last_note = now
    return Timeline(submit, first, finish, tokens)


def warm_up(engine, work: Workload, tokens: int) -> list[str]:
    """Run ``concurrency`` requests like the first ones (the same lengths and adapters, reversed tokens, so
    the measured run finds no cached prefix) with ``tokens`` output tokens — kernels compile, adapters
    load — then capture the decode CUDA graphs; returns the adapters used, in first-use order."""
    count = min(work.concurrency, len(work.prompts))
    prompts = [p[::-1] for p in work.prompts[:count]]  # random tokens reversed: no shared first block
    warm = Workload(f"{work.name}-warm", prompts, work.adapters[:count], [tokens] * count, count)
    drive(engine, warm)
    engine.capture_graphs()
    return [a for a in dict.fromkeys(work.adapters[:count]) if a is not None]


def serving_metrics(timeline: Timeline, prompt_tokens: np.ndarray) -> dict:
    """Throughput over the whole run and per request; TTFT and TPOT percentiles."""
    t = timeline
    span = float(np.nanmax(t.finish) - np.nanmin(t.submit))
    ttft = t.first - t.submit
    multi = t.tokens > 1
    tpot = (t.finish[multi] - t.first[multi]) / (t.tokens[multi] - 1)
    out = int(t.tokens.sum())
    return {"requests": len(t.tokens), "output_tokens": out, "duration_s": round(span, 4),
            "output_tokens_per_s": round(out / span, 2),
            "total_tokens_per_s": round((out + int(prompt_tokens.sum())) / span, 2),
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
            "per_request_output_tokens_per_s": round(float(np.median(1.0 / tpot)), 2) if tpot.size else None}


def _pct(values: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(values, q)), 6) if values.size else None


def decode_summary(rows: np.ndarray, batch: int, bandwidth: float) -> dict:
    """Median decode step time against its HBM floor, over all-decode steps of ``batch`` requests."""
    col = {name: i for i, name in enumerate(COLUMNS)}
    full = rows[(rows[:, col["prefill"]] == 0) & (rows[:, col["decode"]] == batch)
                & (rows[:, col["loads"]] == 0)] if rows.size else rows
    if not full.size:
        return {"decode_steps": 0}
    parts = {k: float(np.median(full[:, col[f"floor_{k}"]])) for k in ("weights", "lora", "kv")}
    floor_bytes = sum(parts.values())
    step = float(np.median(full[:, col["seconds"]]))
    return {"decode_steps": len(full), "decode_batch": batch, "decode_step_s": round(step, 6),
            "floor_bytes": round(floor_bytes), **{f"floor_{k}_bytes": round(v) for k, v in parts.items()},
            "floor_s": round(floor_bytes / bandwidth, 6), "step_over_floor": round(step * bandwidth / floor_bytes, 3)}


# -- bandwidths ------------------------------------------------------------------
def bandwidth_kind(device: torch.device) -> str:
    """What `memory_bandwidth` measures on ``device``: ``"read"`` (CUDA) or ``"copy"`` (read + written)."""
    return "read" if device.type == "cuda" else "copy"


def memory_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large read-only stream on CUDA (benchmarks/timing.py's `read_bandwidth`: a decode step
    mostly reads), of a host copy (read + written) elsewhere (`bandwidth_kind`)."""
    if bandwidth_kind(device) == "read":
        from timing import read_bandwidth

        bandwidth = read_bandwidth()
        torch.cuda.empty_cache()  # the engine sizes its pool from the memory left free
        return bandwidth
    return _best_copy(torch.empty(64 << 20, dtype=torch.uint8), torch.empty(64 << 20, dtype=torch.uint8), 2)


def h2d_bandwidth(device: torch.device) -> float:
    """Bytes/s of a pinned host-to-device copy (on CPU: a host copy)."""
    if device.type != "cuda":
        return _best_copy(torch.empty(64 << 20, dtype=torch.uint8), torch.empty(64 << 20, dtype=torch.uint8), 1)
    src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    bandwidth = _best_copy(torch.empty(256 << 20, dtype=torch.uint8, device=device), src, 1)
    torch.cuda.empty_cache()
    return bandwidth


def _best_copy(dst: torch.Tensor, src: torch.Tensor, sides: int) -> float:
    best = float("inf")
    for _ in range(5):
        if dst.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if dst.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return sides * src.numel() * src.element_size() / best
