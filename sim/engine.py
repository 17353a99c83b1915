"""`Simulation`: the real scheduler and pool, driven by a simulated executor on a simulated clock.

    arrivals (Trace) ─► Scheduler.add ─┐
                                       ▼
    loop:  schedule() ─► SchedulerOutput ─► step time from the cost model ─► clock += step
             ▲            adapter loads ─► load queue (disk, then host-to-device; overlap compute;
             │                             polled at the step's launch point and at its end)
             └──────── update(StepResult: a token for each request that caught up, loads done by now)

Only time is simulated: `Scheduler`, `UnifiedMemory` (pool, reclaimer, KV
manager, adapter manager) and the eviction and scheduling policies are the
library's own objects.  Events are the arrivals, the end of each step and the
completion of each adapter load.  While the engine runs a step, arrivals and
load completions wait for the step's end (as in a real engine loop); a step's
loads start once its forward pass is launched (file reads, or copies from the
host tier); a read that finishes before a step's forward pass is launched
starts its copy then (the engine polls there), so that copy can end within the
step; one that finishes later starts its copy at the step's end, and the same
poll reports it done if it ends within that poll's host work (``load_s`` a
copy; the step then ends when the copy does); when a step has nothing to
compute, the clock jumps to the next arrival or load completion instead of
spinning.

Per step the simulator does O(scheduled requests) work (the context length
each reads, and whether it samples); tokens are not generated one by one
beyond what the scheduler itself does.  Requests finish by length: prompt
tokens are filler with one token unique to the request (no accidental prefix
sharing; ``prefix_tokens`` adds a per-adapter shared prefix), and every
sampled token is the same non-stop token.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections import Counter
from dataclasses import dataclass, field
from operator import attrgetter, mul

import numpy as np
from unipage.scheduler import (
    FinishReason,
    Request,
    RequestError,
    Scheduler,
    SchedulerOutput,
    StepResult,
)
from unipage.sim.belady import Belady, BeladyOracle
from unipage.sim.config import SimConfig
from unipage.sim.errors import SimInputError, SimulationError
from unipage.sim.profile import CostProfile
from unipage.sim.workload import Trace, load_trace

from unipage.adapter_info import synthetic_info
from unipage.adapters import LoadAdapter
from unipage.config import ATTENTION_TARGETS, DENSE_TARGETS
from unipage.errors import AdapterError
from unipage.memory import UnifiedMemory

INF = float("inf")
FILL, SAMPLED, FIRST_UNIQUE = 1, 1, 2  # prompt filler, the sampled token, first request-unique token
_ONE, _NONE = [SAMPLED], []
_computed = attrgetter("num_computed_tokens")
MAX_STALLS = 8  # consecutive empty steps with no event to wait for: the scheduler is stuck

# Request outcome codes in SimResult.status.
FINISHED, ABORTED_SLO, ABORTED_LOAD, ABORTED_OTHER, UNFINISHED = 0, 1, 2, 3, 4
_ABORT_CODE = {FinishReason.SLO: ABORTED_SLO, FinishReason.LOAD_FAILED: ABORTED_LOAD}


class SimClock:
    """The scheduler's clock: seconds of simulated time."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class StepCost:
    """Seconds of one step from its `SchedulerOutput` (see `unipage.sim.profile` for the model)."""

    def __init__(self, profile: CostProfile, config: SimConfig, ranks: dict[str, int]) -> None:
        self.p = profile
        self.ranks = ranks  # adapter name -> rank
        self.slot_rank: dict[int, int] = {-1: 0}  # adapter slot -> rank of the adapter loaded there
        model = config.model
        self.moe_layers = sum(map(model.is_moe_layer, range(model.num_layers)))
        self.experts, self.top_k = model.num_experts, model.top_k

    def touched(self, tokens: int) -> float:
        """Expected distinct experts hit by ``tokens`` tokens routed top-k of E uniformly."""
        e = self.experts
        return e * (1.0 - (1.0 - self.top_k / e) ** tokens)

    def step_s(self, out: SchedulerOutput, decode: int, kv_read: int, adapter_tokens: dict | None) -> float:
        """``adapter_tokens``: adapter -> its tokens in the step when the caller knows them (else counted)."""
        p = self.p
        total = out.total_num_scheduled_tokens
        t = (p.step_base_s + p.prefill_token_s * (total - decode) + p.decode_token_s * decode
             + p.kv_token_read_s * kv_read + (p.eager_step_s if total > decode else 0.0))
        if out.adapters:
            t += self._lora_s(out, adapter_tokens)
        if self.moe_layers:
            t += p.expert_s * self.moe_layers * self.touched(total)
        return t

    def launch_s(self, out: SchedulerOutput) -> float:
        """Seconds from the step's start until its forward pass is launched (when the engine submits and polls
        its reads)."""
        p = self.p
        return p.launch_base_s + p.launch_token_s * out.total_num_scheduled_tokens

    def _lora_s(self, out: SchedulerOutput, adapter_tokens: dict | None) -> float:
        p = self.p
        if adapter_tokens is not None:
            rank_of = self.ranks
        else:  # tokens per adapter slot, from the per-token slot map
            adapter_tokens, rank_of = Counter(out.token_slots), self.slot_rank
            adapter_tokens.pop(-1, None)
        ranks = list(map(rank_of.__getitem__, adapter_tokens))
        tokens_x_rank = sum(map(mul, ranks, adapter_tokens.values()))
        t = (p.lora_step_s + p.adapter_s * len(ranks) + p.adapter_rank_s * sum(ranks)
             + p.lora_token_rank_s * tokens_x_rank)
        if self.moe_layers and p.lora_expert_rank_s:
            touched = self.touched
            t += p.lora_expert_rank_s * self.moe_layers * sum(rank_of[k] * touched(n) for k, n in adapter_tokens.items())
        return t


class LoadQueue:
    """Adapter loads in flight: file reads on ``workers`` parallel readers, then a FIFO host-to-device queue.

    As in the engine's step loop, a finished read's copy starts only at a poll (`poll`: once a step's forward
    pass is launched, at the end of the step, or at once when nothing runs), and `end_step` reports the
    copies complete by the end of the step's last poll.
    """

    def __init__(self, page_bytes: int, h2d_bytes_per_s: float, disk_bytes_per_s: float, workers: int = 1) -> None:
        self.page_bytes, self.h2d, self.disk = page_bytes, h2d_bytes_per_s, disk_bytes_per_s
        self.readers = [0.0] * workers  # heap: when each reader is next idle
        self.h2d_free = 0.0  # when the copy queue is next idle
        self.reads: list[tuple[float, int, LoadAdapter]] = []  # heap: (read done, seq, load), copy not started
        self.heap: list[tuple[float, int, str]] = []  # heap: (copy done, seq, adapter)
        self.seq = 0
        self.bytes_h2d = self.bytes_disk = 0
        self.loads = self.from_host = 0

    def start(self, load: LoadAdapter, now: float) -> None:
        """Queue ``load`` at ``now`` (the engine performs a step's loads once its forward pass is launched):
        its file read, or (from the host tier) its copy."""
        self.loads += 1
        self.from_host += load.from_host
        self.seq += 1
        if load.from_host:
            self._copy(load, now)
            return
        done = max(heapq.heappop(self.readers), now) + load.info.file_bytes / self.disk
        heapq.heappush(self.readers, done)
        heapq.heappush(self.reads, (done, self.seq, load))
        self.bytes_disk += load.info.file_bytes

    def _copy(self, load: LoadAdapter, now: float) -> None:
        nbytes = len(load.pages) * self.page_bytes
        self.h2d_free = max(self.h2d_free, now) + nbytes / self.h2d
        self.bytes_h2d += nbytes
        heapq.heappush(self.heap, (self.h2d_free, self.seq, load.name))

    def poll(self, now: float) -> int:
        """Start the copies of the reads finished by ``now``; returns how many."""
        reads, started = self.reads, 0
        while reads and reads[0][0] <= now:
            self._copy(heapq.heappop(reads)[2], now)
            started += 1
        return started

    def next_done(self) -> float:
        """The next read or copy to finish (what an idle engine waits for)."""
        return min(self.heap[0][0] if self.heap else INF, self.reads[0][0] if self.reads else INF)

    @property
    def in_flight(self) -> bool:
        return bool(self.heap or self.reads)

    def end_step(self, now: float, host_s: float) -> tuple[list[str], float]:
        """The engine's end-of-step poll at ``now``: it starts the copies of the reads finished by then, then
        queries every copy's event after that host work (``host_s`` a copy it starts).  A copy that ended by
        then, one of its own too (a small adapter's pages cross in microseconds), is reported: returns those
        adapters and when the step ends — when the last one reported did, if that is after ``now``."""
        copies = self.poll(now) if self.reads else 0
        heap, done, horizon = self.heap, [], now + host_s * copies
        while heap and heap[0][0] <= horizon:
            ended, _, name = heapq.heappop(heap)
            done.append(name)
            now = max(now, ended)
        return done, now


@dataclass(frozen=True)
class ClosedLoop:
    """Requests ``first`` onwards as a closed loop of ``concurrency`` (a benchmark client's): the first
    ``concurrency`` of them arrive at their trace times, each later one, in trace order, when one of them
    finishes (at the end of that step, as a client submits once it sees the finish).  Requests before
    ``first`` arrive at their trace times and release none."""

    first: int
    concurrency: int

    def __post_init__(self) -> None:
        if self.first < 0 or self.concurrency < 1:
            raise SimInputError(f"closed loop: first must be >= 0 and concurrency >= 1, got {self.first} "
                                f"and {self.concurrency}")


@dataclass
class SimResult:
    """Everything measured in one run (per-request arrays are indexed like the trace)."""

    config: SimConfig
    trace: Trace  # as run: with a closed loop, its arrivals are the release times
    first_token: np.ndarray  # [N] seconds; nan if it never produced one
    finish: np.ndarray  # [N] seconds at which it finished or was dropped
    num_output: np.ndarray  # [N] tokens generated
    status: np.ndarray  # [N] FINISHED, ABORTED_SLO, ABORTED_LOAD, ABORTED_OTHER
    hit: np.ndarray  # [N] its adapter was loaded when it arrived (False for base-model requests)
    preemptions: np.ndarray  # [N] times it was preempted
    end_time: float  # simulated seconds when the last request finished
    steps: int
    busy_s: float  # simulated seconds spent computing steps
    scheduled_requests: int  # sum over steps of requests in the batch
    scheduled_tokens: int
    scheduled_adapters: int  # sum over steps of the distinct adapters in the batch
    loads: LoadQueue
    adapter_stats: dict  # AdapterManager.stats
    scheduler_stats: dict  # Scheduler.stats
    evictions: dict  # reclaimer evictions by kind
    samples: dict  # occupancy over time: t, free, kv, cached_kv, adapter, running, waiting
    little: dict  # window, area (request-seconds in system, seen by the scheduler)
    wall_s: float = field(default=0.0, compare=False)  # host seconds the run took (not in records)


class Simulation:
    """One run of ``config`` over ``trace`` (default: the config's workload), open loop unless
    ``closed_loop`` says otherwise."""

    def __init__(self, config: SimConfig, trace: Trace | None = None, closed_loop: ClosedLoop | None = None) -> None:
        self.config = config
        self.trace = trace if trace is not None else load_trace(config)
        if closed_loop is not None and closed_loop.first > len(self.trace):
            raise SimInputError(f"closed loop: first {closed_loop.first} is past the trace's "
                                f"{len(self.trace)} requests")
        self.closed_loop = closed_loop
        self.clock = SimClock()
        self.memory = UnifiedMemory(config.unipage_config)
        self.ranks = self._register_adapters()
        self._check_sizes()
        self.sched = Scheduler(self.memory, config.scheduler, clock=self.clock)
        self.cost = StepCost(config.profile, config, self.ranks)
        ucfg = config.unipage_config
        self.loads = LoadQueue(ucfg.page_bytes, config.lora.h2d_bytes_per_s,
                               config.lora.disk_bytes_per_s, config.profile.read_workers)
        self.oracle: BeladyOracle | None = None
        policy = self.memory.reclaimer.policy
        if isinstance(policy, Belady):
            self.oracle = BeladyOracle(self.trace.arrivals_by_adapter(), self.clock)
            policy.attach(self.oracle, self.memory.reclaimer)
        self.live: dict[str, Request] = {}
        self._budget = config.scheduler.max_num_batched_tokens
        self._chunk = config.scheduler.long_prefill_token_threshold or self._budget
        n = len(self.trace)
        self.first_token = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.num_output = np.zeros(n, dtype=np.int64)
        self.status = np.full(n, UNFINISHED, dtype=np.int8)
        self.hit = np.zeros(n, dtype=bool)
        self.preempted = np.zeros(n, dtype=np.int32)
        self._prefixes = [[0] * config.workload.prefix_tokens for _ in self.trace.adapter_names]

    # -- setup -----------------------------------------------------------------
    def _register_adapters(self) -> dict[str, int]:
        cfg, trace = self.config, self.trace
        targets = ATTENTION_TARGETS if cfg.workload.targets == "attention" else DENSE_TARGETS + ("experts",)
        infos: dict[int, object] = {}
        ranks = {}
        for name, rank in zip(trace.adapter_names, trace.adapter_ranks):
            if rank not in infos:
                infos[rank] = synthetic_info(cfg.model, rank, targets)
            try:
                self.memory.adapters.register(name, dataclasses.replace(infos[rank], digest=f"sim:{name}"))
            except AdapterError as err:
                raise SimInputError(f"[workload] adapters: {err}") from None
            ranks[name] = rank
        return ranks

    def _check_sizes(self) -> None:
        """Every request must fit the pool at its full length with its adapter (else it could never run)."""
        t, cfg = self.trace, self.config
        if not len(t):
            return
        pages = np.asarray([self.memory.adapters.get(a).num_pages for a in t.adapter_names] + [0])
        longest = np.minimum(t.input_tokens.astype(np.int64) + t.output_tokens, cfg.scheduler.max_model_len) - 1
        kv_pages = -(-longest // cfg.pool.block_tokens) * self.memory.kv.num_groups  # = kv.blocks_needed
        need = kv_pages + pages[t.adapter]  # adapter -1 -> the trailing 0
        bad = np.flatnonzero(need > self.memory.pool.num_pages)
        if bad.size:
            i = int(bad[0])
            raise SimInputError(f"request {i} needs {int(need[i])} pages at full length "
                                f"({int(longest[i])} tokens of KV + its adapter) but [pool] num_pages is "
                                f"{self.memory.pool.num_pages}; {bad.size} request(s) cannot fit")

    def _request(self, i: int) -> Request:
        t = self.trace
        a, n = int(t.adapter[i]), int(t.input_tokens[i])
        unique = FIRST_UNIQUE + i
        prefix = self._prefixes[a] if a >= 0 else ()
        if not prefix:
            prompt = [unique] + [FILL] * (n - 1)
        elif n > len(prefix):
            prompt = prefix + [unique] + [FILL] * (n - len(prefix) - 1)
        else:
            prompt = prefix[:n - 1] + [unique]
        return Request(str(i), prompt, adapter=t.adapter_names[a] if a >= 0 else None,
                       max_tokens=int(t.output_tokens[i]), arrival_time=float(t.arrival[i]),
                       tenant=t.tenant_names[t.tenant[i]])

    # -- the event loop ----------------------------------------------------------
    def run(self) -> SimResult:
        wall = time.perf_counter()
        sched, clock, loads, oracle = self.sched, self.clock, self.loads, self.oracle
        arrival = self.trace.arrival.tolist()
        n = len(arrival)
        sample_dt = self.config.sample_interval_s or max((arrival[-1] if n else 1.0) / 400, 1e-3)
        samples = {k: [] for k in ("t", "free", "kv", "cached_kv", "adapter", "running", "waiting")}
        w0, w1 = (0.1 * arrival[-1], 0.9 * arrival[-1]) if n else (0.0, 0.0)
        loop, released = self.closed_loop, n
        if loop is not None:  # the later requests' times are their releases, known as the run goes
            released = min(loop.first + loop.concurrency, n)
            arrival[released:] = [INF] * (n - released)
        area = 0.0
        now = arrival[0] if n else 0.0
        next_sample, nxt, stalls = now, 0, 0
        steps = busy = batch_reqs = batch_tokens = batch_adapters = 0
        check_every = self.config.check_every
        while nxt < n or sched.has_unfinished() or loads.in_flight:
            clock.now = now
            while nxt < n and arrival[nxt] <= now:
                self._arrive(nxt)
                nxt += 1
            out = sched.schedule()
            if out.finished_ids or out.aborted_ids:  # finished in the last update, or dropped just now
                self._record_done(out)
            in_system = len(self.live)  # requests in the system during this step
            started = self._new_loads(out) if out.adapter_effects else _NONE
            if oracle is not None:
                self._tell_oracle(out)
            start = now
            if out.req_ids:
                dt, sampled = self._run_batch(out)
                dt += self.cost.p.load_s * len(started)
                # As in the engine: once the forward pass is launched, the reads and the host-tier
                # copies start, and a poll starts the copies of the reads finished by then.
                launch = now + min(self.cost.launch_s(out), dt)
                for load in started:
                    loads.start(load, launch)
                if loads.reads:
                    loads.poll(launch)
                now += dt
                steps += 1
                busy += dt
                batch_reqs += len(sampled)
                batch_tokens += out.total_num_scheduled_tokens
                batch_adapters += len(out.adapters)
                stalls = 0
            else:
                sampled = _NONE
                now, stalls = self._idle(out, started, now, arrival[nxt] if nxt < n else INF, stalls)
            done = _NONE
            if loads.in_flight:  # (load_s a copy: its host work is charged to the step that started the load)
                done, now = loads.end_step(now, self.cost.p.load_s)
            if now > w0 and start < w1:
                area += in_system * (min(now, w1) - max(start, w0))
            clock.now = now
            outputs = sched.update(StepResult(sampled, done))
            before = released
            if loop is not None and released < n:
                released = self._release(outputs, arrival, released, now)
            if out.req_ids and self.cost.p.step_gap_s:  # the serving loop's host time before the next step
                gap_end = now + self.cost.p.step_gap_s
                area += self._gap_area(outputs, released - before, now, gap_end, w0, w1)
                now = gap_end
            if now >= next_sample:
                self._sample(samples, now)
                next_sample = now + sample_dt
            if check_every and steps % check_every == 0:
                sched.check()
        self._record_remaining()
        self._sample(samples, now)
        end = float(np.nanmax(self.finish)) if n else 0.0
        trace = self.trace if loop is None else dataclasses.replace(self.trace, arrival=np.asarray(arrival))
        return SimResult(self.config, trace, self.first_token, self.finish, self.num_output, self.status,
                         self.hit, self.preempted, end, steps, busy, batch_reqs, batch_tokens, batch_adapters, loads,
                         dataclasses.asdict(self.memory.adapters.stats), dataclasses.asdict(sched.stats),
                         dict(self.memory.reclaimer.evictions), samples,
                         {"window": (w0, w1), "area": area}, time.perf_counter() - wall)

    def _idle(self, out: SchedulerOutput, started: list, now: float, next_arrival: float,
              stalls: int) -> tuple[float, int]:
        """A step with nothing to compute: its loads start at once, and the clock jumps to the next arrival
        or load completion; with nothing to wait for, the scheduler runs again at once.  Returns the clock
        and the count of such steps in a row."""
        for load in started:
            self.loads.start(load, now)
        wake = min(next_arrival, self.loads.next_done())
        if out.preempted_ids or wake == INF:
            stalls += 1
            if stalls > MAX_STALLS and not out.preempted_ids:
                raise SimulationError(f"t={now:.6f}s: the scheduler scheduled nothing {stalls} times with "
                                      f"{len(self.sched.requests)} live requests and no event to wait for")
            return now, stalls
        return max(now, wake), 0

    def _gap_area(self, outputs: list, arrived: int, start: float, end: float, w0: float, w1: float) -> float:
        """Request-seconds in the measurement window during a step gap: the live requests less those that
        finished in the step, plus the closed loop's releases (they arrived at its end)."""
        if end <= w0 or start >= w1:
            return 0.0
        staying = len(self.live) - sum(1 for o in outputs if o.finished) + arrived
        return staying * (min(end, w1) - max(start, w0))

    def _release(self, outputs: list, arrival: list[float], released: int, now: float) -> int:
        """Closed loop: one more request arrives at ``now`` for each of the loop's requests that finished."""
        first, n = self.closed_loop.first, len(arrival)
        for output in outputs:
            if output[2] is not None and int(output[0]) >= first and released < n:  # (id, tokens, finish, detail)
                arrival[released] = now
                released += 1
        return released

    def _arrive(self, i: int) -> None:
        req = self._request(i)
        try:
            self.sched.add(req)
        except RequestError as err:
            raise SimInputError(f"request {i}: {err}") from None
        self.live[req.request_id] = req
        if req.adapter is not None:
            self.hit[i] = self.memory.adapters.get(req.adapter).loaded
            if self.oracle is not None:
                self.oracle.arrived(req.adapter)

    def _new_loads(self, out: SchedulerOutput) -> list[LoadAdapter]:
        """The step's adapter loads; their slots get their adapters' ranks (the step's LoRA cost)."""
        new = [effect for effect in out.adapter_effects if type(effect) is LoadAdapter]
        for load in new:
            self.cost.slot_rank[load.slot] = self.ranks[load.name]
        return new

    def _run_batch(self, out: SchedulerOutput) -> tuple[float, list]:
        """The step's duration, and the token each request samples (none for a prefill chunk that stops short)."""
        sched = self.sched
        requests, ids, counts = sched.requests, out.req_ids, out.num_scheduled_tokens
        decode = counts.count(1)
        sampled = [_ONE] * len(ids)
        adapter_tokens = None
        if decode == len(ids) and out.total_num_scheduled_tokens < self._budget and self._chunk > 1:
            kv_read = sum(map(_computed, map(requests.__getitem__, ids)))  # one token each: all of them sample
            if len(ids) == len(sched.running):  # every running request, one token each
                adapter_tokens = sched.running_adapters
        else:
            kv_read = 0
            for i, rid in enumerate(ids):
                req = requests[rid]
                computed = req.num_computed_tokens
                kv_read += computed
                if computed < len(req.all_token_ids):
                    sampled[i] = _NONE
        return self.cost.step_s(out, decode, kv_read, adapter_tokens), sampled

    def _tell_oracle(self, out: SchedulerOutput) -> None:
        oracle, requests = self.oracle, self.sched.requests
        for new in out.new_requests:
            if new.adapter is not None:
                oracle.admitted(new.adapter)
        for rid in out.preempted_ids:
            name = requests[rid].adapter
            if name is not None:
                oracle.requeued(name)

    def _record_done(self, out: SchedulerOutput) -> None:
        for rid in out.finished_ids:
            self._record(self.live.pop(rid))
        for rid in out.aborted_ids:
            req = self.live.pop(rid)
            self._record(req)
            if self.oracle is not None and req.adapter is not None:
                self.oracle.dropped(req.adapter)

    def _record_remaining(self) -> None:
        for req in self.live.values():
            self._record(req)
        self.live.clear()

    def _record(self, req: Request) -> None:
        i = int(req.request_id)
        if req.first_token_time is not None:
            self.first_token[i] = req.first_token_time
        self.finish[i] = req.finish_time
        self.num_output[i] = req.num_output_tokens
        self.preempted[i] = req.num_preemptions
        reason = req.finish_reason
        self.status[i] = FINISHED if reason in (FinishReason.STOP, FinishReason.LENGTH) else \
            _ABORT_CODE.get(reason, ABORTED_OTHER)

    def _sample(self, samples: dict, now: float) -> None:
        pool = self.memory.pool.occupancy()
        samples["t"].append(now)
        for kind in ("free", "kv", "cached_kv", "adapter"):
            samples[kind].append(pool[kind])
        samples["running"].append(len(self.sched.running))
        samples["waiting"].append(self.sched.num_waiting)


def simulate(config: SimConfig, trace: Trace | None = None, closed_loop: ClosedLoop | None = None) -> SimResult:
    """Run one simulation of ``config`` (its workload, or ``trace``; open loop unless ``closed_loop``)."""
    return Simulation(config, trace, closed_loop).run()
