"""Decode graphs' adapter classes (`unipage.graphs`): which graph a step of some adapters replays (pure Python:
the key is computed on the host, no CUDA needed)."""

from types import SimpleNamespace

import pytest

from unipage.graphs import DecodeGraphs, adapter_classes, bucket_sizes


@pytest.mark.parametrize("max_adapters, classes", [(16, [1, 4, 16]), (8, [1, 2, 8]), (64, [1, 4, 16, 64]), (1, [1]),
                                                   (5, [1, 5]), (3, [1, 3]), (0, [1])])
def test_classes_step_down_by_quarters(max_adapters, classes):
    assert adapter_classes(max_adapters) == classes


def _graphs(max_adapters, tables=True):
    return SimpleNamespace(buckets=bucket_sizes(256), classes=adapter_classes(max_adapters),
                           lora=SimpleNamespace(page_table=object() if tables else None))


def _seqs(slots):
    return [SimpleNamespace(slot=s) for s in slots]


def test_a_step_takes_the_smallest_class_that_holds_its_adapters():
    graphs = _graphs(16)
    key = DecodeGraphs._key
    assert key(graphs, _seqs([0, 1, 2, 3] * 63)) == (256, 4)  # setup (b)'s affinity decode: 4 of 16
    assert key(graphs, _seqs([0, 1, 2, 3, 4] * 50)) == (256, 16)
    assert key(graphs, _seqs([7] * 100 + [-1] * 20)) == (128, 1)
    assert key(graphs, _seqs([-1] * 30)) == (32, 0)  # no adapter: no LoRA kernels
    assert key(graphs, _seqs([3, -1])) == (2, 1)
    assert key(graphs, _seqs([3, 5])) == (2, 2)  # class 4 in a bucket of 2 is class 2
    assert key(_graphs(16, tables=False), _seqs([3, 5])) == (2, 0)  # no LoRA tables yet
    with pytest.raises(ValueError, match="at most 16"):  # past max_adapters (the scheduler never does)
        key(graphs, _seqs(range(20)))


def test_a_step_past_the_largest_class_runs_eagerly():
    graphs = SimpleNamespace(**vars(_graphs(16)), max_blocks=8)
    accepts = DecodeGraphs.accepts
    assert accepts(graphs, [1] * 20, [[0]] * 20, list(range(16)) + [-1] * 4)
    assert not accepts(graphs, [1] * 20, [[0]] * 20, list(range(17)) + [-1] * 3)
    assert accepts(graphs, [1] * 20, [[0]] * 20)  # (no slots given: not checked)
    assert not accepts(graphs, [1, 2], [[0], [0]], [0, 1])  # a prompt chunk: not a decode step


def test_each_bucket_captures_its_distinct_classes():
    classes = DecodeGraphs._classes
    graphs = _graphs(16)
    assert classes(graphs, 256) == [0, 1, 4, 16]
    assert classes(graphs, 2) == [0, 1, 2]
    assert classes(graphs, 1) == [0, 1]
    assert classes(_graphs(16, tables=False), 256) == [0]
