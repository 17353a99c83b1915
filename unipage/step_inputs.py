"""A step's inputs on the host (`HostBatch`, numpy) and their upload as a `StepBatch`.

The runner builds one `HostBatch` per eager or mixed step from its per-request
state; `upload` sends it in one copy per dtype (`StagedUpload`).  The CUDA
graphs of mixed steps (`unipage.mixed_graphs`) copy the per-token arrays into
their own static buffers instead and upload only what the attention reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from unipage.models.decoder import StepBatch
from unipage.staging import StagedUpload


@dataclass
class HostBatch:
    ids: np.ndarray  # [T] int64 token ids
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64 KV slot of each token (page * block_tokens + row)
    token_slots: np.ndarray  # [T] int32 adapter slot per token, -1 = none
    tables: np.ndarray  # [B, W] int32 block tables
    seq_lens: np.ndarray  # [B] int32 context after the step
    cu: np.ndarray  # [B + 1] int32 each sequence's rows in the step's tokens
    rows: np.ndarray  # [R] int64 token rows to sample
    max_q_len: int
    group_tokens: int  # tokens of the largest adapter group (0: no adapter)
    active_slots: int  # distinct adapters among the tokens
    window_slots: np.ndarray | None = None  # hybrid models: slots in the sliding layers' tables
    window_tables: np.ndarray | None = None
    num_decodes: int = 0  # leading sequences with one token this step (the decode attention kernel's)

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]

    def attention_arrays(self) -> list[np.ndarray]:
        """What only the attention (and the sampled rows' gather) reads: tables, lengths, cu, rows[, window]."""
        extra = [self.window_tables] if self.window_tables is not None else []
        return [self.tables, self.seq_lens, self.cu, self.rows, *extra]


def host_batch(seqs, num_scheduled: list[int], block_tokens: int) -> HostBatch:
    """The step's arrays for ``seqs`` (the runner's `SeqState`s) given ``num_scheduled`` tokens each."""
    counts = np.asarray(num_scheduled, dtype=np.int64)
    starts = np.fromiter((seq.num_computed for seq in seqs), np.int64, len(seqs))
    ends = starts + counts
    cu = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(counts, out=cu[1:])
    ids: list[int] = []
    per_slot: dict[int, int] = {}
    for seq, start, end, n in zip(seqs, starts.tolist(), ends.tolist(), num_scheduled):
        ids += seq.token_ids[start:end]
        if seq.slot >= 0:
            per_slot[seq.slot] = per_slot.get(seq.slot, 0) + n
    # each token's position: its row in the step, shifted by where its sequence's new tokens start
    seq_of = np.repeat(np.arange(len(seqs)), counts)
    positions = np.arange(int(cu[-1]), dtype=np.int64) + np.repeat(starts - cu[:-1], counts)
    lengths = np.fromiter((len(seq.token_ids) for seq in seqs), np.int64, len(seqs))
    tables = _table_matrix([seq.block_table for seq in seqs])
    batch = HostBatch(
        ids=np.asarray(ids, dtype=np.int64), positions=positions,
        slots=_slots(tables, seq_of, positions, block_tokens),
        token_slots=np.repeat(np.fromiter((seq.slot for seq in seqs), np.int32, len(seqs)), counts),
        tables=tables, seq_lens=ends.astype(np.int32), cu=cu, rows=(cu[1:] - 1)[ends == lengths].astype(np.int64),
        max_q_len=max(num_scheduled), group_tokens=max(per_slot.values(), default=0), active_slots=len(per_slot),
        num_decodes=next((i for i, n in enumerate(num_scheduled) if n != 1), len(num_scheduled)))
    if seqs[0].window_table is not None:
        batch.window_tables = _table_matrix([seq.window_table for seq in seqs])
        batch.window_slots = _slots(batch.window_tables, seq_of, positions, block_tokens)
    return batch


def upload(host: HostBatch, staged: StagedUpload) -> StepBatch:
    """``host`` on the device as a `StepBatch` (one copy per dtype)."""
    arrays = [host.ids, host.positions, host.slots, host.tables, host.seq_lens, host.cu, host.token_slots,
              host.rows]
    if host.window_tables is not None:
        arrays += [host.window_slots, host.window_tables]
    sent = staged.send(arrays)
    window_slots, window_tables = sent[8:] if len(sent) > 8 else (None, None)
    return StepBatch(
        input_ids=sent[0], positions=sent[1], slot_mapping=sent[2], block_tables=sent[3], seq_lens=sent[4],
        cu_seqlens_q=sent[5], max_q_len=host.max_q_len, token_slots=sent[6], logits_rows=sent[7],
        any_lora=host.active_slots > 0, group_tokens=host.group_tokens, active_slots=host.active_slots,
        window_slot_mapping=window_slots, window_block_tables=window_tables, num_decodes=host.num_decodes)


def _slots(tables: np.ndarray, seq_of: np.ndarray, positions: np.ndarray, block_tokens: int) -> np.ndarray:
    """Each scheduled token's KV slot (page * block_tokens + row) through its sequence's row of ``tables``."""
    bt = block_tokens
    return tables[seq_of, positions // bt].astype(np.int64) * bt + positions % bt


def _table_matrix(tables: list[list[int]]) -> np.ndarray:
    """Block tables padded with 0 to the longest: ``[B, W]`` int32."""
    out = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int32)
    for row, table in zip(out, tables):
        row[:len(table)] = table
    return out
