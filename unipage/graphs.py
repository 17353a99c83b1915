"""CUDA graphs of the decode step: one per batch-size bucket, serving any adapter mix.

A *decode step* gives every scheduled request exactly one token.  Its forward
pass is the same sequence of kernels whatever the requests, so `DecodeGraphs`
captures it once per bucket of batch sizes (`bucket_sizes`) and *adapter class*,
and replays it: one launch instead of hundreds, and no Python in the loop over
layers.  Class 0 runs no LoRA kernel (steps in which no request has an
adapter); where adapters are resident, class ``a`` (`adapter_classes`) serves
steps of at most ``a`` distinct adapters: the LoRA kernels' grids cover that
many, and their launch configs are the ones tuned for that many (the MoE LoRA's
mode and tiles follow the pairs expected per adapter and expert).  A step takes
the smallest class that holds its adapters, so few adapters run what is fast
for few: setup (b)'s decode under the affinity policy, about 4 adapters of a
`max_adapters_per_batch` of 16, runs the MoE LoRA in group mode rather than the
pair mode tuned for 16.

A bucket's step can be captured as *pieces*, consecutive graphs replayed in
order (`piece_bounds`: the embedding and the first layer, then `PIECE_LAYERS`
layers a piece; 0, the default, captures one graph a step).  The GPU starts a
graph's work only once its launch call returns; with pieces it waits only for
the first one while the host launches the rest.  (Under the profiler that
call's host time grew with the graph's kernels; without it a whole decode
step's replay call takes 25-29 us on an H200, so pieces have little to hide.)  On an H200 (setup (a)'s GPT-OSS-20B
decode batch, one process) pieces of 4 layers took the LoRA step from 12.34
to 11.91 ms (base 9.48 to 9.41), but runs of setup (a) end to end, each in a
process of its own, did not show it (11.93 and 12.21 ms a step with pieces,
11.72 and 11.88 with one graph: within their spread), so they stay off until
an A/B in one process (`serve.py --piece-layers 0 4 0 4`) says otherwise
(`benchmarks/results/lora-breakdown-h200.jsonl`, `serve-h200.jsonl`).
`DecodeGraphs.set_piece_layers` changes it on a running engine.  The pieces
pass the residual stream, the next layer's input and the step's context (rope
tables, the LoRA plan, the MoE LoRA's slot ranks) as tensors of the graphs'
memory pool: all of them live within one step, so the pieces of other buckets
may reuse that memory — safe because the pieces of one key are replayed back to back, never
interleaved with another key's, all on one stream, and the step consumes
``hidden`` before the next replay (as with one graph a step).

What a replay reads lives in static device buffers, refreshed from pinned
memory by two host-to-device copies that the graph itself holds: the first
nodes of a bucket's first piece, captured from the pinned rows, so a replay
copies what the host wrote there last (no copy calls on the host a step).
The host writes the rows only once the previous replay is done with them (an
event recorded after each replay):

    ids, positions, slot_mapping   [2 + G, Bmax] int64
    seq_lens, token_slots, tables  [2·Bmax + Bmax·G·W] int32 (block tables [Bmax, G, W] last),
                                   W = max_model_len / block_tokens

G is the number of KV groups: 2 for a model with full and sliding-window
layers (a slot mapping and a block table each), else 1.

Rows past the batch (up to its bucket) are padding: token 0 at position 0,
no KV write (slot -1), no adapter, a context of one token in page 0.  The LoRA tables
(`LoraTables`) keep their tensors while their *signature* is unchanged, so a
graph serves every mix of at most its class's adapters; when the signature changes (`generation`),
the graphs are dropped and captured again on next use.  The graph ends at the
final norm's output; the LM head runs outside it (a ``[B, V]`` float32 output
per bucket would pin hundreds of MB).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from unipage.models.decoder import DecoderLM, StepBatch
from unipage.models.lora_tables import LoraTables

WARMUP_RUNS = 2  # eager runs before a capture (compile every kernel variant the graph needs)
PIECE_LAYERS = 0  # layers per decode graph after the first (0: one graph for the whole step)
CLASS_STEP = 4  # adapter classes: max_adapters, then a quarter of it, and so on down to 1


def adapter_classes(max_adapters: int) -> list[int]:
    """The adapter counts decode graphs are captured for, ascending: ``max_adapters``, then each a
    `CLASS_STEP`-th of the one before, down to 1 (16 -> [1, 4, 16]; 8 -> [1, 2, 8])."""
    classes = [max(1, max_adapters)]
    while classes[-1] > 1:
        classes.append(max(1, classes[-1] // CLASS_STEP))
    return classes[::-1]


def adapter_class(classes: list[int], bucket: int, active: int) -> int:
    """The smallest of ``classes`` that holds ``active`` (>= 1) adapters, at most ``bucket`` (a step has no
    more adapters than rows); a `ValueError` past the largest (its graphs' LoRA grids are too small)."""
    if active > classes[-1]:
        raise ValueError(f"a step of {active} adapters: the graphs cover at most {classes[-1]}")
    return min(bucket, next(c for c in classes if c >= active))


def bucket_classes(classes: list[int], bucket: int) -> list[int]:
    """The adapter classes a bucket's graphs are made for, ascending, each at most the bucket."""
    return sorted({min(bucket, c) for c in classes})


def warm_up(run: Callable[[], object], device: torch.device) -> None:
    """``run`` `WARMUP_RUNS` times on a side stream, ordered after and before the current stream's work: the
    eager runs before a capture (kernels compiled, allocations made outside the graph's pool)."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            run()
    current.wait_stream(side)


def piece_bounds(num_layers: int, size: int | None = None) -> list[tuple[int, int]]:
    """The layer ranges ``[start, end)`` of a decode step's pieces: layer 0 alone, then ``size`` layers a
    piece (None: `PIECE_LAYERS`; 0: the whole step in one)."""
    size = PIECE_LAYERS if size is None else size
    if size <= 0 or num_layers <= 1:
        return [(0, num_layers)]
    return [(0, 1), *((a, min(a + size, num_layers)) for a in range(1, num_layers, size))]


def decode_pieces(model: DecoderLM, batch: StepBatch, pool: torch.Tensor, lora: LoraTables | None,
                  block_tokens: int, bounds: list[tuple[int, int]]) -> tuple[list[Callable[[], None]], dict]:
    """`DecoderLM.hidden_states` as consecutive steps, one per range of ``bounds``, and the state they
    pass on: run in order, they leave the final norm's output in ``state["hidden"]``."""
    state: dict = {}

    @torch.inference_mode()
    def piece(start: int, end: int) -> None:
        if start == 0:
            state["ctx"] = model.context(batch, lora)
            state["h"], state["x"] = model.embed(batch)
        state["h"], state["x"] = model.run_layers(start, end, state["h"], state["x"], pool, state["ctx"],
                                                  block_tokens)
        if end == len(model.layers):
            state["hidden"] = state["x"]

    return [partial(piece, a, b) for a, b in bounds], state


class DecodeInputs:
    """The host side of the decode graphs' inputs: the pinned buffers of the module docstring, one row
    per sequence, filled each step.  Block tables are written incrementally: a row that holds the same
    sequence as at its last fill gets only the pages added since (a running sequence's tables only
    grow: `runner.SeqState`); a row padded or given to another sequence is written whole.  Entries past a
    table's end are left as they were (no kernel reads them).  Rows hold their sequence by weak reference,
    so a finished one is not kept alive."""

    def __init__(self, rows: int, groups: int, max_blocks: int, block_tokens: int, pin: bool) -> None:
        host64 = torch.zeros(2 + groups, rows, dtype=torch.int64)
        host32 = torch.zeros(rows * (2 + groups * max_blocks), dtype=torch.int32)
        self.host64, self.host32 = (host64.pin_memory(), host32.pin_memory()) if pin else (host64, host32)
        self.groups, self.block_tokens = groups, block_tokens
        self.np64 = self.host64.numpy()
        self.lens, self.slots = self.host32[:rows].numpy(), self.host32[rows:2 * rows].numpy()
        self.tables = self.host32[2 * rows:].view(rows, groups, max_blocks).numpy()
        self._held: list[weakref.ref | None] = [None] * rows  # the sequence whose tables row i holds
        self._written = [[0] * groups for _ in range(rows)]  # pages of each table written in row i

    def fill(self, seqs, bucket: int, fed: bool = False) -> list[bool] | None:
        """Rows ``[0, len(seqs))`` from ``seqs`` (`SeqState`s, one token each, at ``num_computed``), padding up
        to ``bucket``.  ``fed``: the tokens are not on the host yet: each row's id is -1, which the graph
        replaces by `DecodeGraphs.fed`'s token of that row, and a sequence whose tables hold no page for
        its position yet gets a padding row; returns which rows hold their sequence (None without ``fed``)."""
        n, bt, np64 = len(seqs), self.block_tokens, self.np64
        pos = [seq.num_computed for seq in seqs]
        room = [self._has_room(seq, p // bt) for seq, p in zip(seqs, pos)] if fed else None
        if fed and not all(room):
            pos = [p if ok else 0 for p, ok in zip(pos, room)]  # (a page every table has; padded below)
        np64[0, :n] = -1 if fed else [seq.token_ids[p] for seq, p in zip(seqs, pos)]
        np64[1, :n] = pos
        self.lens[:n] = [p + 1 for p in pos]
        self.slots[:n] = [seq.slot for seq in seqs]
        for group in range(self.groups):
            tables = [seq.window_table if group else seq.block_table for seq in seqs]
            np64[2 + group, :n] = [t[p // bt] * bt + p % bt for t, p in zip(tables, pos)]
        for i, seq in enumerate(seqs):
            self._write_tables(i, seq)
        for i in () if room is None else (i for i, ok in enumerate(room) if not ok):
            self.pad(i, i + 1)
        self.pad(n, bucket)
        return room

    def _has_room(self, seq, block: int) -> bool:
        return block < len(seq.block_table) and (self.groups == 1 or block < len(seq.window_table))

    def _write_tables(self, row: int, seq) -> None:
        held, written = self._held[row], self._written[row]
        same = held is not None and held() is seq
        self._held[row] = None  # until every group is written
        for group in range(self.groups):
            table = seq.window_table if group else seq.block_table
            end = len(table)
            start = written[group] if same and written[group] <= end else 0
            if start == 0:
                self.tables[row, group, :end] = table
            elif start < end:
                self.tables[row, group, start:end] = table[start:]
            written[group] = end
        self._held[row] = held if same else weakref.ref(seq)

    def pad(self, start: int, end: int) -> None:
        """Rows ``[start, end)`` as padding: token 0 at position 0, no KV write, no adapter, one key in
        page 0."""
        self.np64[:, start:end] = 0
        self.np64[2:, start:end] = -1  # no KV write
        self.lens[start:end] = 1
        self.slots[start:end] = -1  # no adapter
        self.tables[start:end, :, 0] = 0  # the one key read: a real page (a window table may hold -1)
        self._held[start:end] = [None] * (end - start)


@dataclass
class RunAhead:
    """A decode step launched by `DecodeGraphs.run_ahead`, to be taken by `take_ahead`.  It holds its
    sequences, so their ids name them while it lives."""

    seqs: list  # `SeqState`s of the rows, in order
    rows: dict[int, int]  # id(seq) -> its row, for the sequences that got one
    positions: list[int]  # each row's position
    hidden: torch.Tensor  # [bucket, H] the graph's output
    epoch: int  # `DecodeGraphs.epoch` at the launch


def bucket_sizes(max_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64, of 16 to 128, of 32 beyond; the last is ``max_seqs``."""
    sizes, b = [], 1
    while b < max_seqs:
        sizes.append(b)
        b = b * 2 if b < 8 else b + (8 if b < 64 else 16 if b < 128 else 32)
    return [*sizes, max_seqs]


class DecodeGraphs:
    """Captured decode forward passes by bucket; `run` replays the one that fits a batch."""

    def __init__(self, model: DecoderLM, pool: torch.Tensor, lora: LoraTables, block_tokens: int,
                 max_seqs: int, max_blocks: int, max_adapters: int, device: torch.device) -> None:
        self.model, self.pool, self.lora, self.block_tokens = model, pool, lora, block_tokens
        self.buckets, self.max_adapters, self.device = bucket_sizes(max_seqs), max_adapters, device
        self.classes = adapter_classes(max_adapters)
        rows, groups = self.buckets[-1], 2 if model.model.hybrid_kv else 1
        self.inputs = DecodeInputs(rows, groups, max_blocks, block_tokens, pin=True)
        self.dev64 = torch.zeros(2 + groups, rows, dtype=torch.int64, device=device)
        self.dev32 = torch.zeros(rows * (2 + groups * max_blocks), dtype=torch.int32, device=device)
        self.max_blocks, self.groups = max_blocks, groups
        self.fed = torch.zeros(rows, dtype=torch.int64, device=device)  # tokens fed on the device (`run_ahead`)
        self.cu = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(rows, dtype=torch.int64, device=device)
        self.piece_layers = PIECE_LAYERS
        self.bounds = piece_bounds(len(model.layers), self.piece_layers)
        self.graphs: dict[tuple[int, int], tuple[list[torch.cuda.CUDAGraph], torch.Tensor]] = {}  # (bucket, class) ->
        self.generation = -1  # the LoRA tables' generation the graphs were captured with
        self.replays = self.captures = 0  # counters, for tests and benchmarks
        self.epoch = 0  # counts `drop`s: a step run ahead is stale once its graphs are gone
        self.mempool = torch.cuda.graph_pool_handle()
        self._copied = torch.cuda.Event()

    def set_piece_layers(self, layers: int) -> None:
        """Capture steps from now on in pieces of ``layers`` layers (`piece_bounds`; 0: one graph a step);
        the graphs captured so far are dropped."""
        self.piece_layers, self.bounds = layers, piece_bounds(len(self.model.layers), layers)
        self.drop()

    def accepts(self, num_scheduled: list[int], tables: list[list[int]], slots: list[int] = ()) -> bool:
        """Whether the step is a decode step these graphs cover: a token each, up to the largest bucket and
        `max_blocks` pages, and no more distinct adapters (``slots``, -1 for none) than the largest class."""
        return (len(num_scheduled) <= self.buckets[-1] and all(n == 1 for n in num_scheduled)
                and all(len(t) <= self.max_blocks for t in tables)
                and len({slot for slot in slots if slot >= 0}) <= self.classes[-1])

    def run(self, seqs) -> torch.Tensor:
        """Hidden states ``[B, H]`` (after the final norm) of one decode step of ``seqs`` (`SeqState`s)."""
        if self.lora.generation != self.generation:
            self.drop()
        key = self._key(seqs)
        bucket, count = key[0], len(seqs)
        self._fill(seqs, bucket)
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
            self.captures += 1
        self._replay(key)
        return self.graphs[key][1][:count]

    def run_ahead(self, seqs, tokens: torch.Tensor) -> RunAhead | None:
        """Launch the decode step after the one just run for the same ``seqs``, each one position further
        (their ``num_computed``), before the host has their ``tokens`` (``[len(seqs)]`` on the device, the
        step's samples): the graph takes them from `fed`.  None (nothing launched) if that step's graph is
        not captured; a sequence without a KV page for its position is left out.  The caller takes the
        result with `take_ahead` before any other replay."""
        key = self._key(seqs)
        bucket, count = key[0], len(seqs)
        if self.lora.generation != self.generation or key not in self.graphs:
            return None
        self._copied.synchronize()
        room = self.inputs.fill(seqs, bucket, fed=True)
        self.fed[:count].copy_(tokens)
        self._replay(key)
        rows = {id(seq): i for i, (seq, ok) in enumerate(zip(seqs, room)) if ok}
        return RunAhead(seqs, rows, [seq.num_computed for seq in seqs], self.graphs[key][1], self.epoch)

    def take_ahead(self, ahead: RunAhead, seqs) -> torch.Tensor | None:
        """The hidden states of ``seqs``' decode step if ``ahead`` ran it: each of them in one of its rows
        at its position now, and its graph still held; else None."""
        if ahead.epoch != self.epoch or self.lora.generation != self.generation:
            return None
        rows = []
        for seq in seqs:
            row = ahead.rows.get(id(seq))
            if row is None or ahead.positions[row] != seq.num_computed:
                return None
            rows.append(row)
        if rows == list(range(len(rows))):
            return ahead.hidden[:len(rows)]
        return ahead.hidden[torch.tensor(rows).to(self.device, non_blocking=True)]

    def _key(self, seqs) -> tuple[int, int]:
        """``(bucket, adapter class)`` of a step of ``seqs``: the smallest bucket that holds them, and the
        smallest class that holds their distinct adapters (0: none, or no LoRA tables)."""
        bucket = next(b for b in self.buckets if b >= len(seqs))
        if self.lora.page_table is None:
            return bucket, 0
        active = len({seq.slot for seq in seqs if seq.slot >= 0})
        # (`accepts` refuses a step of more adapters than the largest class)
        return bucket, adapter_class(self.classes, bucket, active) if active else 0

    def _classes(self, bucket: int) -> list[int]:
        """A bucket's adapter classes (0 first; the others only where adapters are resident), each at most
        the bucket (a step has no more adapters than requests)."""
        if self.lora.page_table is None:
            return [0]
        return [0, *bucket_classes(self.classes, bucket)]

    def _replay(self, key: tuple[int, int]) -> None:
        for graph in self.graphs[key][0]:
            graph.replay()
        self._copied.record()  # the replay's copies out of the pinned rows are done once this passes
        self.replays += 1

    def capture_all(self) -> int:
        """Capture every bucket now (largest first, so smaller graphs reuse its memory), in every adapter
        class (`_classes`); returns the graphs captured."""
        self.lora.refresh()
        if self.lora.generation != self.generation:
            self.drop()
        before = len(self.graphs)
        for bucket in reversed(self.buckets):
            self._copied.synchronize()
            self.inputs.pad(0, bucket)
            for adapters in self._classes(bucket):
                if (bucket, adapters) not in self.graphs:
                    self.graphs[bucket, adapters] = self._capture(bucket, adapters)
                    self.captures += 1
        return len(self.graphs) - before

    def drop(self) -> None:
        """Forget the graphs (the LoRA tables changed shape, or a launch setting the captures baked in did);
        their memory pool goes with them, so later captures take a new one (PyTorch does not reuse a pool
        whose graphs are all gone).  Steps capture again as they need them."""
        self.graphs.clear()
        self.epoch += 1
        self.mempool = torch.cuda.graph_pool_handle()
        self.generation = self.lora.generation

    # -- inputs ------------------------------------------------------------
    def _fill(self, seqs, bucket: int) -> None:
        self._copied.synchronize()  # the previous replay's copies have left the pinned buffers
        self.inputs.fill(seqs, bucket)

    def _copy(self, bucket: int) -> None:
        """The pinned rows to the device buffers (captured as the first nodes of a bucket's graph)."""
        used = self.buckets[-1] * 2 + bucket * self.groups * self.max_blocks  # lengths, slots, the bucket's tables
        self.dev64.copy_(self.inputs.host64, non_blocking=True)
        self.dev32[:used].copy_(self.inputs.host32[:used], non_blocking=True)
        ids = self.dev64[0, :bucket]
        torch.where(ids < 0, self.fed[:bucket], ids, out=ids)  # rows run ahead take their token from `fed`

    def _batch(self, bucket: int, adapters: int) -> StepBatch:
        """The step batch a ``(bucket, adapters)`` graph is captured with: LoRA kernels for up to ``adapters``
        distinct adapters (none for 0)."""
        lora, rows = adapters > 0, self.buckets[-1]
        tables = self.dev32[2 * rows:].view(rows, self.groups, self.max_blocks)
        hybrid = self.groups > 1
        return StepBatch(
            input_ids=self.dev64[0, :bucket], positions=self.dev64[1, :bucket], slot_mapping=self.dev64[2, :bucket],
            block_tables=tables[:bucket, 0], seq_lens=self.dev32[:bucket], cu_seqlens_q=self.cu[:bucket + 1],
            max_q_len=1, token_slots=self.dev32[rows:rows + bucket], logits_rows=self.rows[:bucket],
            any_lora=lora, group_tokens=-(-bucket // max(adapters, 1)), active_slots=adapters,
            window_slot_mapping=self.dev64[3, :bucket] if hybrid else None,
            window_block_tables=tables[:bucket, 1] if hybrid else None)

    # -- capture -----------------------------------------------------------
    def _capture(self, bucket: int, adapters: int) -> tuple[list[torch.cuda.CUDAGraph], torch.Tensor]:
        """A bucket's graphs for an adapter class, the first beginning with the input copies (`_copy`).  The
        pinned rows hold this step's inputs (or padding, from `capture_all`): the warm-up runs read them,
        copied eagerly."""
        batch = self._batch(bucket, adapters)
        lora = self.lora if batch.any_lora else None
        self._copy(bucket)
        self._copied.record()
        warm_up(lambda: self.model.hidden_states(batch, self.pool, lora, self.block_tokens), self.device)
        steps, state = decode_pieces(self.model, batch, self.pool, lora, self.block_tokens, self.bounds)
        steps[0] = partial(_then, partial(self._copy, bucket), steps[0])
        pieces = []
        for step in steps:
            pieces.append(torch.cuda.CUDAGraph())
            with torch.cuda.graph(pieces[-1], pool=self.mempool):
                step()
        return pieces, state["hidden"]


def _then(first: Callable[[], None], second: Callable[[], None]) -> None:
    first()
    second()
