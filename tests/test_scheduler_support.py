"""Shared set-up for the scheduler tests (no tests here): a tiny model, a fake clock and executor.

Geometry: ``page_elems = 4 tokens * 2 * 1 head * 64 = 512``; an attention-only
adapter of rank r takes r pages; a KV block holds 4 tokens.
"""

from __future__ import annotations

from unipage.adapter_info import synthetic_info
from unipage.adapters import LoadAdapter
from unipage.config import LoRAConfig, ModelConfig, PoolConfig, UnipageConfig
from unipage.memory import UnifiedMemory
from unipage.scheduler import Request, Scheduler, SchedulerConfig, SchedulerOutput, StepResult

MODEL = ModelConfig(num_layers=2, hidden_size=64, num_heads=1, num_kv_heads=1, head_dim=64,
                    intermediate_size=128, dtype="float32")
TOKEN = 9  # what the fake executor samples unless told otherwise


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(num_pages=64, adapters=None, loaded=(), max_adapters=8, eviction="lru", prefix_caching=True,
         **sched) -> Scheduler:
    """A scheduler over a fresh pool; ``adapters`` maps name -> rank; ``loaded`` are made resident first."""
    config = UnipageConfig(MODEL, PoolConfig(block_tokens=4, num_pages=num_pages, prefix_caching=prefix_caching),
                           LoRAConfig(max_rank=16, max_adapters_per_batch=max_adapters, eviction_policy=eviction))
    memory = UnifiedMemory(config)
    for name, rank in (adapters or {}).items():
        memory.adapters.register(name, synthetic_info(MODEL, rank, digest=f"digest-{name}"))
    for name in loaded:
        memory.adapters.request(name)
        memory.adapters.load_done(name)
    memory.adapters.take_effects()
    settings = dict(max_model_len=64, max_num_batched_tokens=16, max_num_seqs=8)
    settings.update(sched)
    return Scheduler(memory, SchedulerConfig(**settings), clock=Clock())


def req(rid, n=4, adapter=None, max_tokens=4, start=1, **kw) -> Request:
    """A request whose prompt is ``n`` tokens ``start, start + 1, ...``."""
    return Request(rid, list(range(start, start + n)), adapter=adapter, max_tokens=max_tokens, **kw)


class Executor:
    """Samples ``token(rid)`` for each request that caught up; a load completes ``load_steps`` results later.

    ``fail``: adapters whose loads fail.  Completions are reported in the ``StepResult``.
    """

    def __init__(self, sched: Scheduler, token=lambda rid: TOKEN, load_steps=0, fail=()) -> None:
        self.sched, self.token, self.load_steps, self.fail = sched, token, load_steps, set(fail)
        self.loading: dict[str, int] = {}

    def result(self, out: SchedulerOutput) -> StepResult:
        for effect in out.adapter_effects:
            if isinstance(effect, LoadAdapter):
                self.loading[effect.name] = self.load_steps
        sampled = []
        for rid in out.req_ids:
            r = self.sched.get(rid)
            sampled.append([self.token(rid)] if r is not None and r.num_computed_tokens == r.num_tokens else [])
        due = [name for name, left in self.loading.items() if left == 0]
        self.loading = {name: left - 1 for name, left in self.loading.items() if left > 0}
        return StepResult(sampled, loads_done=[n for n in due if n not in self.fail],
                          loads_failed=[n for n in due if n in self.fail])


def step(sched: Scheduler, executor: Executor | None = None):
    """One schedule/execute/update round with every invariant checked; returns (output, request outputs)."""
    out = sched.schedule()
    outputs = sched.update((executor or Executor(sched)).result(out))
    sched.check()
    return out, outputs


def batch(out: SchedulerOutput) -> list[tuple[str, int]]:
    return list(zip(out.req_ids, out.num_scheduled_tokens))
