"""The decode graphs' host inputs (`unipage.graphs.DecodeInputs`) on CPU: after every step of a random
run (sequences joining, leaving, growing by one token or by several between fills, sitting out steps,
resuming as new objects, reordered, buckets changing), the buffers must hold every value the step's
graph reads, although the block tables are written incrementally."""

from __future__ import annotations

import copy
import gc
import random
import weakref
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
def test_incremental_fill_holds_what_the_graph_reads(groups, seed):
    rng = random.Random(seed)
    inputs = DecodeInputs(ROWS, groups, MAX_BLOCKS, BT, pin=False)
    seqs, resting = [_new(rng, groups) for _ in range(6)], []
    moved = 0
    for _ in range(300):
        for seq in seqs:
            for _ in range(1 if rng.random() < 0.9 else rng.randrange(2, 12)):  # an eager step between fills
                _grow(rng, seq)
        event = rng.random()
        if event < 0.12 and seqs:  # one finishes: the rows after it move up
            seqs.pop(rng.randrange(len(seqs)))
        elif event < 0.24 and len(seqs) < ROWS:  # one joins
            seqs.insert(rng.randrange(len(seqs) + 1), _new(rng, groups))
        elif event < 0.3 and seqs:  # one sits out some steps (a mixed step ran it), then comes back
            resting.append(seqs.pop(rng.randrange(len(seqs))))
        elif event < 0.36 and resting and len(seqs) < ROWS:
            seqs.insert(rng.randrange(len(seqs) + 1), resting.pop())
        elif event < 0.4 and seqs:  # preempted and resumed: a new state with the same contents
            i = rng.randrange(len(seqs))
            seqs[i] = copy.deepcopy(seqs[i])
        elif event < 0.44:
            rng.shuffle(seqs)
        seqs = [s for s in seqs if len(s.block_table) <= MAX_BLOCKS] or [_new(rng, groups)]
        bucket = rng.randrange(len(seqs), ROWS + 1)
        holders = [h() if h is not None else None for h in inputs._held[:len(seqs)]]
        moved += sum(h is not s for h, s in zip(holders, seqs))
        inputs.fill(seqs, bucket)
        _check(inputs, seqs, bucket, groups)
    assert moved > 100  # rows did change hands, not only grow


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


def test_a_finished_sequence_is_not_kept_alive():
    """Row 1 still holds the finished sequence (outside the next bucket, so not padded), but weakly."""
    inputs = DecodeInputs(4, 1, 8, BT, pin=False)
    first, done = Seq(list(range(3)), 2, 1, [1], None), Seq(list(range(9)), 8, 0, [5, 6, 7], None)
    inputs.fill([first, done], 4)
    _grow(random.Random(0), first)
    inputs.fill([first], 1)
    probe = weakref.ref(done)
    del done
    gc.collect()
    assert probe() is None


def _check_fed(inputs: DecodeInputs, seqs: list[Seq], bucket: int, groups: int, room: list[bool]) -> None:
    """A fill run ahead: rows of sequences with a page for their position take their token from the device
    (id -1); the others are padding."""
    for i, (seq, ok) in enumerate(zip(seqs, room)):
        pos = seq.num_computed
        tables = (seq.block_table, seq.window_table)[:groups]
        assert ok == all(pos // BT < len(t) for t in tables)
        if not ok:
            assert (inputs.np64[:2, i] == 0).all() and (inputs.np64[2:, i] == -1).all()
            assert inputs.lens[i] == 1 and inputs.slots[i] == -1 and (inputs.tables[i, :, 0] == 0).all()
            continue
        assert inputs.np64[0, i] == -1 and inputs.np64[1, i] == pos
        assert inputs.lens[i] == pos + 1 and inputs.slots[i] == seq.slot
        for g, table in enumerate(tables):
            assert inputs.np64[2 + g, i] == table[pos // BT] * BT + pos % BT
            assert np.array_equal(inputs.tables[i, g, :len(table)], table), f"row {i} group {g}"
    n = len(seqs)
    assert (inputs.np64[:2, n:bucket] == 0).all() and (inputs.np64[2:, n:bucket] == -1).all()
    assert (inputs.lens[n:bucket] == 1).all() and (inputs.slots[n:bucket] == -1).all()


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("seed", range(3))
def test_fills_run_ahead_feed_tokens_and_pad_sequences_without_a_page(groups, seed):
    """Between plain fills, fills of the step after (`DecodeGraphs.run_ahead`): each sequence one position
    on before its token is known, its page for it there or not yet; the plain fill after is still whole."""
    rng = random.Random(seed)
    inputs = DecodeInputs(ROWS, groups, MAX_BLOCKS, BT, pin=False)
    seqs = [_new(rng, groups) for _ in range(8)]
    padded = fed = 0
    for _ in range(150):
        bucket = rng.randrange(len(seqs), ROWS + 1)
        inputs.fill(seqs, bucket)
        _check(inputs, seqs, bucket, groups)
        for seq in seqs:  # the step ran: its token is on the device only
            seq.num_computed += 1
            if rng.random() < 0.7:  # the scheduler kept room ahead
                while len(seq.block_table) * BT < seq.num_computed + 1:
                    seq.block_table.append(rng.randrange(0, 500))
                    if seq.window_table is not None:
                        seq.window_table.append(rng.randrange(0, 500))
        seqs = [s for s in seqs if len(s.block_table) <= MAX_BLOCKS] or [_new(rng, groups)]  # (as `accepts`)
        room = inputs.fill(seqs, bucket, fed=True)
        _check_fed(inputs, seqs, bucket, groups, room)
        padded, fed = padded + room.count(False), fed + room.count(True)
        for seq in seqs:  # the token reaches the host; the next step's pages come
            seq.token_ids.append(rng.randrange(1, 100))
            while len(seq.block_table) * BT < seq.num_computed + 1:
                seq.block_table.append(rng.randrange(0, 500))
                if seq.window_table is not None:
                    seq.window_table.append(rng.randrange(0, 500))
        if rng.random() < 0.2:
            seqs.insert(rng.randrange(len(seqs) + 1), _new(rng, groups))
        if rng.random() < 0.2 or len(seqs) > ROWS:
            seqs.pop(rng.randrange(len(seqs)))
        seqs = [s for s in seqs if len(s.block_table) <= MAX_BLOCKS] or [_new(rng, groups)]
    assert padded > 20 and fed > 500


def test_a_plain_fill_returns_none():
    inputs = DecodeInputs(4, 1, 8, BT, pin=False)
    assert inputs.fill([Seq(list(range(3)), 2, 1, [1], None)], 2) is None
