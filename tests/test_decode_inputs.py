"""The decode graphs' host inputs (`unipage.graphs.DecodeInputs`) on CPU: after every step of a random
run (sequences joining, leaving, growing, reordered, buckets changing), the buffers must hold exactly
what a fresh fill of that step writes, although the block tables are written incrementally."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest

from unipage.graphs import DecodeInputs

BT, MAX_BLOCKS, ROWS = 4, 24, 16


@dataclass
class Seq:
    token_ids: list[int]
    num_computed: int
    slot: int
    block_table: list[int]
    window_table: list[int] | None


def _new(rng: random.Random, groups: int) -> Seq:
    n = rng.randrange(1, 40)
    pages = -(-(n + 1) // BT)
    window = [rng.randrange(-1, 500) for _ in range(pages)] if groups == 2 else None
    return Seq([rng.randrange(1, 100) for _ in range(n + 1)], n, rng.randrange(-1, 5),
               [rng.randrange(0, 500) for _ in range(pages)], window)


def _grow(rng: random.Random, seq: Seq) -> None:
    seq.token_ids.append(rng.randrange(1, 100))
    seq.num_computed += 1
    while len(seq.block_table) * BT < seq.num_computed + 1:
        seq.block_table.append(rng.randrange(0, 500))
        if seq.window_table is not None:
            seq.window_table.append(rng.randrange(-1, 500))


def _check(inputs: DecodeInputs, seqs: list[Seq], bucket: int, groups: int) -> None:
    n = len(seqs)
    for i, seq in enumerate(seqs):
        pos = seq.num_computed
        tables = (seq.block_table, seq.window_table)[:groups]
        assert inputs.np64[0, i] == seq.token_ids[pos] and inputs.np64[1, i] == pos
        assert inputs.lens[i] == pos + 1 and inputs.slots[i] == seq.slot
        for g, table in enumerate(tables):
            assert inputs.np64[2 + g, i] == table[pos // BT] * BT + pos % BT
            assert np.array_equal(inputs.tables[i, g, :len(table)], table), f"row {i} group {g}"
    assert (inputs.np64[:2, n:bucket] == 0).all() and (inputs.np64[2:, n:bucket] == -1).all()
    assert (inputs.lens[n:bucket] == 1).all() and (inputs.slots[n:bucket] == -1).all()
    assert (inputs.tables[n:bucket, :, 0] == 0).all()


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("seed", range(4))
def test_incremental_fill_matches_a_fresh_one(groups, seed):
    rng = random.Random(seed)
    inputs = DecodeInputs(ROWS, groups, MAX_BLOCKS, BT, pin=False)
    seqs = [_new(rng, groups) for _ in range(6)]
    rewrites = 0
    for _ in range(200):
        for seq in seqs:
            _grow(rng, seq)
        event = rng.random()
        if event < 0.15 and seqs:  # one finishes: the rows after it move up
            seqs.pop(rng.randrange(len(seqs)))
        elif event < 0.3 and len(seqs) < ROWS:  # one joins (or a preempted one resumes as a new state)
            seqs.insert(rng.randrange(len(seqs) + 1), _new(rng, groups))
        elif event < 0.35:
            rng.shuffle(seqs)
        seqs = [s for s in seqs if len(s.block_table) <= MAX_BLOCKS] or [_new(rng, groups)]
        bucket = rng.randrange(len(seqs), ROWS + 1)
        before = inputs.tables.copy()
        inputs.fill(seqs, bucket)
        _check(inputs, seqs, bucket, groups)
        rewrites += int((inputs.tables != before).any())
    assert rewrites > 50  # the run did move tables around


def test_a_row_keeps_its_pages_until_it_changes_hands():
    """The same sequence at the same row: only its new pages are written, the old ones are not read
    again (here: corrupted on purpose in the buffer, and left so); padding or another sequence
    rewrites the row whole."""
    inputs = DecodeInputs(4, 1, 8, BT, pin=False)
    seq = Seq(list(range(9)), 8, 0, [5, 6, 7], None)
    inputs.fill([seq], 1)
    inputs.tables[0, 0, 0] = 99  # not a page any sequence holds
    _grow(random.Random(0), seq)
    inputs.fill([seq], 1)
    assert inputs.tables[0, 0, 0] == 99  # the row was not rewritten
    inputs.fill([Seq(list(range(3)), 2, 1, [1], None), seq], 2)  # seq moves to row 1: written whole
    assert list(inputs.tables[1, 0, :len(seq.block_table)]) == seq.block_table
    assert inputs.tables[0, 0, 0] == 1
    inputs.pad(0, 2)
    inputs.fill([Seq(list(range(3)), 2, 1, [1], None), seq], 2)
    assert list(inputs.tables[1, 0, :len(seq.block_table)]) == seq.block_table
