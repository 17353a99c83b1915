"""`DecodeGraphs.take_ahead` on CPU (its logic only; the launch needs CUDA, `test_engine_run_ahead_gpu.py`): a
step run ahead serves the next step only for sequences it holds a row for, each at the position it ran,
while its graphs are still held."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from unipage.graphs import DecodeGraphs, RunAhead


@dataclass
class Seq:
    num_computed: int


@pytest.fixture
def setup():
    graphs = object.__new__(DecodeGraphs)  # (no __init__: it makes CUDA graph pools)
    graphs.epoch, graphs.generation, graphs.device = 3, 7, torch.device("cpu")
    graphs.lora = SimpleNamespace(generation=7)
    a, b, c, d = Seq(5), Seq(9), Seq(2), Seq(4)
    hidden = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)  # a bucket of 8 rows
    ahead = RunAhead([a, b, c, d], {id(a): 0, id(b): 1, id(d): 3}, [5, 9, 2, 4], hidden, 3)  # c had no page
    return graphs, ahead, (a, b, c, d)


def test_the_same_sequences_in_order_take_the_rows_as_they_are(setup):
    graphs, ahead, (a, b, _, _) = setup
    got = graphs.take_ahead(ahead, [a, b])
    assert torch.equal(got, ahead.hidden[:2]) and got.data_ptr() == ahead.hidden.data_ptr()


def test_a_subset_in_another_order_gathers_its_rows(setup):
    graphs, ahead, (a, b, _, d) = setup
    assert torch.equal(graphs.take_ahead(ahead, [d, a]), ahead.hidden[[3, 0]])
    assert torch.equal(graphs.take_ahead(ahead, [b]), ahead.hidden[[1]])


def test_it_is_refused_unless_every_sequence_ran_there(setup):
    graphs, ahead, (a, b, c, d) = setup
    assert graphs.take_ahead(ahead, [a, c]) is None  # c had no page for its position: a padding row
    assert graphs.take_ahead(ahead, [a, copy.copy(b)]) is None  # the same contents, another state (resumed)
    b.num_computed += 1
    assert graphs.take_ahead(ahead, [a, b]) is None  # b is at another position now
    assert graphs.take_ahead(ahead, [a, d]) is not None


@pytest.mark.parametrize("change", ["epoch", "generation"])
def test_it_is_refused_once_the_graphs_changed(setup, change):
    graphs, ahead, (a, _, _, _) = setup
    if change == "epoch":
        graphs.epoch += 1  # dropped (and maybe captured again) since the launch
    else:
        graphs.lora.generation += 1  # the LoRA tables changed shape: the graphs go at the next run
    assert graphs.take_ahead(ahead, [a]) is None
