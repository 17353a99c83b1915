"""Drive `unipage.scheduler` with a fake executor: ``python docs/scheduler_example.py``.

A small pool (40 pages of 16-token blocks) shared by KV and rank-8 adapters
(8 pages each), five adapters registered, four requests per step arriving at
first.  The fake executor does what a real one would with a `SchedulerOutput`
— keeps each request's tokens and block table from the full first message
and the diffs after it, performs adapter loads (each takes two steps) — and
"samples" the next token as the last one plus one.  Every step prints the
batch (request:tokens@adapter), the adapter loads and evictions, and the
requests preempted or finished, then checks every pool invariant.

Options: ``--policy fcfs|affinity|vtc|slo``, ``--admission optimistic|reserve``.
"""

from __future__ import annotations

import argparse

from unipage.adapter_info import synthetic_info
from unipage.adapters import EvictAdapter, LoadAdapter
from unipage.config import LoRAConfig, ModelConfig, PoolConfig, UnipageConfig
from unipage.memory import UnifiedMemory
from unipage.scheduler import Request, Scheduler, SchedulerConfig, SchedulerOutput, StepResult

MODEL = ModelConfig(num_layers=2, hidden_size=128, num_heads=2, num_kv_heads=1, head_dim=64,
                    intermediate_size=256, dtype="float32")
ADAPTERS = ("sql", "chat", "math", "code", "poem")
EOS = 0


class FakeExecutor:
    """Keeps what an executor must keep per request; loads finish ``load_steps`` steps after they start."""

    def __init__(self, load_steps: int = 2) -> None:
        self.load_steps = load_steps
        self.tokens: dict[str, list[int]] = {}  # request id -> its tokens (prompt + generated)
        self.computed: dict[str, int] = {}  # request id -> tokens with KV
        self.tables: dict[str, list[int]] = {}  # request id -> block table
        self.slots: dict[str, int] = {}  # resident adapter -> slot
        self.loading: dict[str, int] = {}  # adapter -> steps until its copy completes

    def run(self, out: SchedulerOutput) -> StepResult:
        for rid in out.finished_ids + out.aborted_ids + out.preempted_ids:
            for table in (self.tokens, self.computed, self.tables):
                table.pop(rid, None)
        for effect in out.adapter_effects:
            if isinstance(effect, LoadAdapter):
                self.loading[effect.name] = self.load_steps
                self.slots[effect.name] = effect.slot
            elif isinstance(effect, EvictAdapter):
                self.slots.pop(effect.name)
        for new in out.new_requests:
            self.tokens[new.request_id] = list(new.token_ids)
            self.computed[new.request_id] = new.num_computed_tokens
            self.tables[new.request_id] = list(new.block_table)
        for rid, blocks in out.new_block_ids.items():
            self.tables[rid] += blocks
        sampled = [self._forward(rid, n) for rid, n in zip(out.req_ids, out.num_scheduled_tokens)]
        done = [name for name, left in self.loading.items() if left <= 1]
        self.loading = {name: left - 1 for name, left in self.loading.items() if left > 1}
        return StepResult(sampled, loads_done=done)

    def _forward(self, rid: str, n: int) -> list[int]:
        self.computed[rid] += n
        assert len(self.tables[rid]) * 16 >= self.computed[rid], "KV written past the block table"
        if self.computed[rid] < len(self.tokens[rid]):
            return []  # a prefill chunk: nothing sampled yet
        token = (self.tokens[rid][-1] + 1) % 50 or EOS
        self.tokens[rid].append(token)
        return [token]


def build(policy: str, admission: str) -> Scheduler:
    config = UnipageConfig(MODEL, PoolConfig(block_tokens=16, num_pages=40), LoRAConfig(max_rank=16))
    memory = UnifiedMemory(config)
    for name in ADAPTERS:
        memory.adapters.register(name, synthetic_info(MODEL, 8, digest=f"digest-{name}"))
    sched_config = SchedulerConfig(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=6,
                                   policy=policy, admission=admission, slo_ttft_s=0.5, step_time_s=0.02)
    clock = Clock()
    return Scheduler(memory, sched_config, clock=clock)


class Clock:
    """A simulated clock: 20 ms per step."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def describe(out: SchedulerOutput, sched: Scheduler) -> str:
    batch = " ".join(f"{rid}:{n}@{sched.get(rid).adapter or '-'}"
                     for rid, n in zip(out.req_ids, out.num_scheduled_tokens))
    extra = [f"load {e.name}->slot {e.slot}" if isinstance(e, LoadAdapter) else f"evict {e.name}"
             for e in out.adapter_effects if isinstance(e, (LoadAdapter, EvictAdapter))]
    extra += [f"preempt {rid}" for rid in out.preempted_ids]
    return f"step {out.step:>3} [{out.total_num_scheduled_tokens:>2} tok] {batch or '(idle)'}" + \
        (f"   | {', '.join(extra)}" if extra else "")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="fcfs")
    parser.add_argument("--admission", default="optimistic")
    parser.add_argument("--requests", type=int, default=16)
    args = parser.parse_args(argv)
    sched = build(args.policy, args.admission)
    executor = FakeExecutor()
    pending = [Request(f"r{i}", [i + 1] * (20 + 7 * i % 60), adapter=ADAPTERS[i * 3 % 5] if i % 4 else None,
                       max_tokens=12 + 5 * i % 30, stop_token_ids=(EOS,)) for i in range(args.requests)]
    finished: dict[str, str] = {}
    while pending or sched.has_unfinished():
        for req in pending[:4]:
            sched.add(req)
        del pending[:4]
        out = sched.schedule()
        print(describe(out, sched))
        for output in sched.update(executor.run(out)):
            if output.finished:
                finished[output.request_id] = output.finish_reason.value + (f" ({output.detail})"
                                                                            if output.detail else "")
        sched.check()
        sched.clock.now += 0.02
    occupancy = sched.memory.occupancy()
    print(f"\n{len(finished)} requests done: " + ", ".join(f"{k}={v}" for k, v in finished.items()))
    print(f"stats: {sched.stats}")
    print(f"pool after the last request: {occupancy} (cached KV and idle adapters stay until reclaimed)")
    assert occupancy["kv"] == 0


if __name__ == "__main__":
    main()
