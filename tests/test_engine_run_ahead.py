"""The decode run-ahead's protocol end to end on the CPU: an eager stand-in plays `DecodeGraphs` (its
`run_ahead` computes the next step at once from the fed tokens, writing its KV as the graph would), so that
the runner, the engine and the scheduler's room ahead run as on CUDA.  Against an engine without it, over
requests joining, finishing, stopping, aborted, seeded and preempted in a small pool: the same tokens, and
steps run ahead both taken and thrown away."""

from __future__ import annotations

from types import SimpleNamespace

import engine_support as es
import torch
from unipage.scheduler import SchedulerConfig

from unipage.config import PoolConfig
from unipage.engine import Engine
from unipage.graphs import DecodeGraphs, RunAhead
from unipage.step_inputs import host_batch, upload

class EagerGraphs:
    """`DecodeGraphs`' decode protocol, eagerly."""

    take_ahead = DecodeGraphs.take_ahead

    def __init__(self, runner) -> None:
        self.runner, self.device, self.epoch, self.generation = runner, torch.device("cpu"), 0, 0
        self.lora = SimpleNamespace(generation=0)
        self.padded = 0

    def accepts(self, num_scheduled, tables, slots=()) -> bool:
        return all(n == 1 for n in num_scheduled)

    def run(self, seqs) -> torch.Tensor:
        r = self.runner
        batch = upload(host_batch(seqs, [1] * len(seqs), r.block_tokens), r.upload)
        return r.model.hidden_states(batch, r.pool, r.lora, r.block_tokens)

    def run_ahead(self, seqs, tokens: torch.Tensor) -> RunAhead:
        bt, fed = self.runner.block_tokens, tokens.tolist()
        rows = [i for i, s in enumerate(seqs) if s.num_computed // bt < len(s.block_table)
                and (s.window_table is None or s.num_computed // bt < len(s.window_table))]
        self.padded += len(seqs) - len(rows)
        ahead = [SimpleNamespace(token_ids=[*seqs[i].token_ids, fed[i]], num_computed=seqs[i].num_computed,
                                 slot=seqs[i].slot, block_table=seqs[i].block_table,
                                 window_table=seqs[i].window_table) for i in rows]
        hidden = torch.full((len(seqs), self.runner.model.model.hidden_size), float("nan"))
        if ahead:
            hidden[rows] = self.run(ahead)
        return RunAhead(seqs, {id(seqs[i]): i for i in rows}, [s.num_computed for s in seqs], hidden, self.epoch)


family = es.family_fixture(["qwen3_moe", "gpt_oss"])


def _engine(family, run_ahead: bool) -> Engine:
    engine = Engine(family.model_dir, device="cpu", pool=PoolConfig(num_pages=60),
                    scheduler=SchedulerConfig(max_model_len=256, max_num_seqs=16, decode_kv_ahead=int(run_ahead)))
    for name, path in family.adapters.items():
        engine.add_adapter(name, path)
    if run_ahead:
        runner = engine.runner
        runner.graphs, runner.run_ahead = EagerGraphs(runner), True
        runner._tokens_copied = SimpleNamespace(record=lambda: None, synchronize=lambda: None)
    return engine


def _drive(engine: Engine, names: list) -> dict:
    """`es.drive_comings_and_goings` (four joining at step 8, r0 aborted at step 14): request id -> tokens."""
    outs, _ = es.drive_comings_and_goings(engine, names, es.Comings(3, 12, 8, 14, (20, 80), (8, 40), 6))
    return {rid: tokens for rid, (tokens, _) in outs.items()}


def test_run_ahead_gives_the_tokens_of_a_run_without_it(family):
    runs, engines = [], []
    for run_ahead in (False, True):
        engine = _engine(family, run_ahead)
        runs.append(_drive(engine, list(family.adapters)))
        engine.memory.check()
        engines.append(engine)
    assert runs[1] == runs[0]
    runner, plain = engines[1].runner, engines[0].runner
    assert runner.ahead_taken > 20 and runner.ahead_dropped > 0 and (plain.ahead_taken, plain.ahead_dropped) == (0, 0)
    assert engines[1].scheduler.stats.preemptions > 0  # the pool was short: rows of preempted requests went unused
    assert runner.graphs.padded > 0  # and some requests had no room ahead: padding rows
    for engine in engines:
        engine.close()
