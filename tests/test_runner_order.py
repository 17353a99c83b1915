"""The decode rows in adapter order (`ModelRunner.decode_order`): the tokens sampled, and each request's, are
those of the scheduler's order.  CPU: the decode graphs' contract played by an eager stand-in that runs
the rows in the order it is given."""

from __future__ import annotations

import engine_support as es
import pytest
import torch

from unipage import LLM, SamplingParams
from unipage.config import LoRAConfig, PoolConfig
from unipage.runner import ModelRunner, SeqState, sampler_rows
from unipage.scheduler import SchedulerConfig
from unipage.step_inputs import host_batch, upload

GREEDY = SamplingParams(temperature=0)


class EagerDecode:
    """`DecodeGraphs.accepts` / `run` eagerly: the final norm's output of the rows as given."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.slot_rows = runner, []

    def accepts(self, num_scheduled, tables) -> bool:
        return all(n == 1 for n in num_scheduled)

    def run(self, seqs) -> torch.Tensor:
        r = self.runner
        self.slot_rows.append([seq.slot for seq in seqs])
        batch = upload(host_batch(seqs, [1] * len(seqs), r.block_tokens), r.upload)
        return r.model.hidden_states(batch, r.pool, r.lora, r.block_tokens)


def _seq(slot: int) -> SeqState:
    return SeqState([1], [0], slot, 0, GREEDY, None)


def test_decode_order_is_by_slot_and_stable():
    runner = ModelRunner.__new__(ModelRunner)
    runner.sort_rows = True
    seqs = [_seq(s) for s in (3, -1, 0, 3, 0)]
    assert runner.decode_order(seqs) == [1, 2, 4, 0, 3]
    runner.sort_rows = False
    assert runner.decode_order(seqs) == [0, 1, 2, 3, 4]


def test_sampler_rows_follow_the_order():
    assert sampler_rows([2, 0, 1], [0, 2]) == ([0, 1], [2, 0])
    assert sampler_rows([1, 0], [0, 1]) == ([0, 1], [1, 0])
    assert sampler_rows([0, 1, 2], [1]) == ([1], [1])


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return es.qwen3_moe(tmp_path_factory.mktemp("moe"))


def _generate(moe, decode: bool, sort_rows: bool = True):
    llm = LLM(moe.model_dir, moe.adapters, device="cpu", pool=PoolConfig(num_pages=512),
              lora=LoRAConfig(max_rank=32), scheduler=SchedulerConfig(max_model_len=64))
    runner = llm.engine.runner
    runner.sort_rows = sort_rows
    if decode:
        runner.graphs = EagerDecode(runner)
    names = ["fused-r4", None, "expert-r8", "fused-r4", None, "attn-r16", "expert-r8"]
    prompts = [[(7 * i + j) % 100 + 1 for j in range(3 + i)] for i in range(len(names))]
    sampling = [GREEDY, SamplingParams(temperature=1.0, seed=5)] * 3 + [GREEDY]
    out = llm.generate(prompts, sampling, adapters=names, max_tokens=6, return_logits=True)
    return out, runner.graphs


def test_rows_by_adapter_sample_what_the_scheduler_order_samples(moe):
    want, _ = _generate(moe, decode=False)
    got, graphs = _generate(moe, decode=True)
    unsorted, _ = _generate(moe, decode=True, sort_rows=False)
    assert graphs.slot_rows and all(rows == sorted(rows) for rows in graphs.slot_rows)
    assert any(len(set(rows)) > 2 for rows in graphs.slot_rows)  # several adapters and the base in one step
    for a, b, c in zip(want, got, unsorted):
        assert a.token_ids == b.token_ids == c.token_ids
        for la, lb in zip(a.logits, b.logits):
            torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
