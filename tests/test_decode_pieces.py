"""The decode graphs' pieces (`unipage.graphs.decode_pieces`) on CPU, run eagerly in order.

A CUDA graph is captured per piece, so the pieces must be the forward pass
cut at layer bounds with nothing lost between them: run in place of the
model's whole pass, the logits must still be transformers + PEFT's for each
sequence's adapter.
"""

from __future__ import annotations

import engine_support as es
import pytest
from test_engine_parity import GREEDY, TOL, mixed_batch

from unipage import LLM
from unipage.config import LoRAConfig, PoolConfig
from unipage.graphs import PIECE_LAYERS, decode_pieces, piece_bounds
from unipage.scheduler import SchedulerConfig


family = es.family_fixture(["qwen3_moe", "gpt_oss"])


def test_piece_bounds():
    assert piece_bounds(48, 4) == [(0, 1), (1, 5), (5, 9), (9, 13), (13, 17), (17, 21), (21, 25), (25, 29),
                                   (29, 33), (33, 37), (37, 41), (41, 45), (45, 48)]
    assert piece_bounds(24, 4)[-1] == (21, 24) and len(piece_bounds(24, 4)) == 7
    assert piece_bounds(3, 1) == [(0, 1), (1, 2), (2, 3)]
    assert piece_bounds(5, 0) == [(0, 5)] and piece_bounds(1, 4) == [(0, 1)]
    assert PIECE_LAYERS == 0 and piece_bounds(7) == [(0, 7)]  # one graph a step unless asked


@pytest.mark.parametrize("size", [1, 0])
def test_pieces_match_transformers(family, size, monkeypatch):
    """size 1: a piece per layer (the context and embedding in the first); 0: one piece."""
    llm = LLM(family.model_dir, family.adapters, device="cpu", pool=PoolConfig(num_pages=512),
              lora=LoRAConfig(max_rank=32, max_adapters_per_batch=8),
              scheduler=SchedulerConfig(max_model_len=256))
    model, oracle, runs = llm.engine.runner.model, es.Oracle(family), []
    bounds = piece_bounds(len(model.layers), size)

    def pieced(batch, pool, lora, block_tokens):
        steps, state = decode_pieces(model, batch, pool, lora, block_tokens, bounds)
        for step in steps:
            step()
        runs.append(len(steps))
        return state["hidden"]

    monkeypatch.setattr(model, "hidden_states", pieced)
    prompts, names = mixed_batch(family, seed=5, count=6)
    outs = llm.generate(prompts, GREEDY, adapters=names, max_tokens=5, return_logits=True)
    for out in outs:
        assert len(out.token_ids) == 5
        err = es.generated_logits_error(oracle, out)
        assert err <= TOL, f"{out.adapter}: logits differ by {err}"
    assert len(runs) >= 5 and set(runs) == {len(bounds)} and len(bounds) == (1 if size == 0 else len(model.layers))
