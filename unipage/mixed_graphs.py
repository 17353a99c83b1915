"""CUDA graphs of mixed steps (prompt chunks, with or without decodes), piecewise around the attention.

A step that is not a pure decode step has sequences of different query
lengths, so its attention launch depends on the step (grid, lengths), but
everything between two attentions is row-wise over the step's tokens: the
projections, the LoRA kernels (whose plan is made on the device), norms,
rope, the KV write, the MLP or the experts.  `MixedGraphs` captures those
pieces once per bucket of token counts (`token_buckets`) — piece 0: embedding
to layer 0's queries; piece i: layer i-1 after its attention to layer i's
queries; piece L: the last layer after its attention to the final norm — and
a step replays them with the attention launched eagerly in between::

    replay piece 0; for each layer i: attention(q) -> attended; replay piece i + 1

so a step costs L + 1 replays and L attention launches of host time instead
of a few hundred launches.  Pieces pass the residual stream, the queries and
the attention output through static buffers (`h`, `q`, `attended`); the final
norm of every row lands in `hidden`, from which the sampled rows are gathered.

Inputs: token ids, positions and KV slots (int64) and adapter slots (int32)
go to static device buffers through one pinned copy each; the block tables,
lengths and the rows to sample only feed the eager attention and the gather,
so they are uploaded as usual.  Rows past the step's tokens (up to the
bucket) are padding: token 0 at position 0, no KV write, no adapter; the
attention never reads them and they never mix with real rows.

A set of pieces is captured per ``(bucket, LoRA on, GEMV, adapter class)``: the
dense LoRA plan takes the GEMV path when no adapter has more than a couple of
tokens in the step (as an eager step's plan would, `plan_block_m`), else tiles of
the bucket's height (an eager step sizes them by its largest adapter group, and
its launch configs by its token count: only speed and summation order differ);
the class (`graphs.adapter_classes` of the adapter limit, as the decode graphs'),
the smallest that holds the step's distinct adapters, bounds the LoRA grids and
picks the MoE LoRA launch config (its expected pairs per adapter and expert), so a
step of 4 adapters under a limit of 16 runs the 4-adapter kernels.
Like the decode graphs, the sets are dropped when the LoRA tables'
generation changes.  A step runs eagerly instead (`run` returns None) when it
has more distinct adapters than the graphs' LoRA grid covers, or when its set
could not be captured for lack of device memory.  Steps are graphed up to
`MAX_TOKENS` tokens (larger ones are busy enough on the GPU to run eagerly).
With ``capture=False`` the pieces run eagerly on the same buffers (CPU tests
of the padding and the split).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import logging

import torch

from unipage.graphs import adapter_class, adapter_classes, bucket_classes, warm_up
from unipage.kernels import plan_block_m
from unipage.models.decoder import DecoderLM, StepBatch
from unipage.models.lora_tables import LoraTables
from unipage.staging import StagedUpload
from unipage.step_inputs import HostBatch

log = logging.getLogger(__name__)

MAX_TOKENS = 4096  # the largest step graphed (a budget above it leaves the larger steps eager)


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, ..., 512, then steps of 256 to 2048 and of 512 beyond; the last is ``max_tokens``."""
    sizes, t = [], 16
    while t < max_tokens:
        sizes.append(t)
        t = t * 2 if t < 512 else t + (256 if t < 2048 else 512)
    return [*sizes, max_tokens]


@dataclass
class _Pieces:
    runs: list[Callable[[], None]]  # piece k: a graph's replay, or the piece itself when not capturing
    state: dict = field(default_factory=dict)  # the decoder context made by piece 0 (read by every piece)


class MixedGraphs:
    """Piecewise CUDA graphs of mixed steps up to ``max_tokens`` tokens (at most `MAX_TOKENS`); `run`
    replays a step."""

    def __init__(self, model: DecoderLM, pool: torch.Tensor, lora: LoraTables, block_tokens: int,
                 max_tokens: int, max_adapters: int, device: torch.device, capture: bool = True) -> None:
        self.model, self.pool, self.lora, self.block_tokens = model, pool, lora, block_tokens
        self.buckets = token_buckets(min(max_tokens, MAX_TOKENS))
        self.device = device
        self.classes = adapter_classes(max_adapters)
        self.capture = capture
        m, rows, dtype = model.model, self.buckets[-1], model.embed_tokens.dtype
        self.groups = 2 if m.hybrid_kv else 1
        pin = device.type == "cuda"
        self.host64 = _zeros((2 + self.groups, rows), torch.int64, pin)  # ids, positions, KV slots per group
        self.host32 = _zeros((rows,), torch.int32, pin)  # adapter slots
        self.np64, self.np32 = self.host64.numpy(), self.host32.numpy()
        self.dev64 = torch.zeros(self.host64.shape, dtype=torch.int64, device=device)
        self.dev32 = torch.zeros(rows, dtype=torch.int32, device=device)
        self.h = torch.zeros(rows, m.hidden_size, dtype=dtype, device=device)  # residual stream between pieces
        self.q = torch.zeros(rows, m.num_heads, m.head_dim, dtype=dtype, device=device)
        self.attended = torch.zeros_like(self.q)  # the attention's output
        self.hidden = torch.zeros_like(self.h)  # the final norm of every row
        self._unused = torch.zeros(1, 1, dtype=torch.int32, device=device)  # attention-only fields of a piece
        self.sets: dict[tuple[int, bool, bool, int], _Pieces | None] = {}  # None: could not be captured
        self.generation = -1  # the LoRA tables' generation the sets were made with
        self.replays = self.captures = 0  # counters, for tests and benchmarks
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        self._copied = torch.cuda.Event() if pin else None

    def accepts(self, tokens: int) -> bool:
        return 0 < tokens <= self.buckets[-1]

    @torch.inference_mode()
    def run(self, host: HostBatch, staged: StagedUpload) -> torch.Tensor | None:
        """The final norm's output ``[R, H]`` at ``host.rows``; writes the step's KV into the pool.  None: the
        step must run eagerly (more adapters than the LoRA grid covers, or its set could not be captured)."""
        if self.lora.generation != self.generation:
            self.drop()
        if host.active_slots > self.classes[-1]:
            return None
        tokens = host.num_tokens
        bucket = next(b for b in self.buckets if b >= tokens)
        lora = self.lora.page_table is not None and host.active_slots > 0
        key = (bucket, lora, lora and plan_block_m(host.group_tokens) == 1,
               self._class(bucket, host.active_slots) if lora else 0)
        if key not in self.sets:
            self.sets[key] = self._make(*key)
        pieces = self.sets[key]
        if pieces is None:
            return None
        self._fill(host, bucket)
        batch = self._attention_batch(host, staged)
        q, attended = self.q[:tokens], self.attended[:tokens]
        pieces.runs[0]()
        for i in range(len(self.model.layers)):
            self.model.attend(i, q, self.pool, batch, self.block_tokens, out=attended)
            pieces.runs[i + 1]()
        self.replays += 1
        return self.hidden[batch.logits_rows]

    def capture_all(self) -> int:
        """Make the sets of every bucket now (largest first): without the LoRA kernels, and where adapters
        are resident with them on both plan paths in every adapter class; returns how many were made."""
        self.lora.refresh()
        if self.lora.generation != self.generation:
            self.drop()
        before = len(self.sets)
        for bucket in reversed(self.buckets):
            keys = [(bucket, False, False, 0)]
            if self.lora.page_table is not None:
                keys += [(bucket, True, gemv, c) for c in self._classes(bucket) for gemv in (False, True)]
            for key in keys:
                if key not in self.sets:
                    self.sets[key] = self._make(*key)
        return len(self.sets) - before

    def drop(self) -> None:
        """Forget the piece sets (the LoRA tables changed shape, or a launch setting the captures baked in
        did), with their memory pool on CUDA; steps capture again as they need them."""
        self.sets.clear()
        if self.capture:
            self.mempool = torch.cuda.graph_pool_handle()
        self.generation = self.lora.generation

    def _class(self, bucket: int, active: int) -> int:
        """The smallest adapter class that holds ``active`` adapters (``run`` sends more to the eager path),
        at most the bucket (a step has no more adapters than tokens)."""
        return adapter_class(self.classes, bucket, active)

    def _classes(self, bucket: int) -> list[int]:
        return bucket_classes(self.classes, bucket)[::-1]

    # -- inputs ------------------------------------------------------------
    def _fill(self, host: HostBatch, bucket: int) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have left the pinned buffers
        n = host.num_tokens
        self.np64[0, :n], self.np64[1, :n], self.np64[2, :n] = host.ids, host.positions, host.slots
        if self.groups > 1:
            self.np64[3, :n] = host.window_slots
        self.np32[:n] = host.token_slots
        self._pad(n, bucket)

    def _pad(self, start: int, end: int) -> None:
        self.np64[:2, start:end] = 0  # token 0 at position 0
        self.np64[2:, start:end] = -1  # no KV write
        self.np32[start:end] = -1  # no adapter
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32.copy_(self.host32, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _attention_batch(self, host: HostBatch, staged: StagedUpload) -> StepBatch:
        sent = staged.send(host.attention_arrays())
        n = host.num_tokens
        return StepBatch(
            input_ids=self.dev64[0, :n], positions=self.dev64[1, :n], slot_mapping=self.dev64[2, :n],
            block_tables=sent[0], seq_lens=sent[1], cu_seqlens_q=sent[2], max_q_len=host.max_q_len,
            token_slots=self.dev32[:n], logits_rows=sent[3], any_lora=host.active_slots > 0,
            group_tokens=host.group_tokens, active_slots=host.active_slots,
            window_slot_mapping=self.dev64[3, :n] if self.groups > 1 else None,
            window_block_tables=sent[4] if self.groups > 1 else None, num_decodes=host.num_decodes)

    def _piece_batch(self, bucket: int, lora: bool, gemv: bool, bound: int) -> StepBatch:
        """The static inputs of a bucket's pieces (the attention-only fields are placeholders); the LoRA
        plan's tile height hint is 1 on the GEMV path, else the bucket's; ``bound``: the adapter class."""
        hybrid = self.groups > 1
        block_m = 1 if gemv else plan_block_m(bucket)
        return StepBatch(
            input_ids=self.dev64[0, :bucket], positions=self.dev64[1, :bucket], slot_mapping=self.dev64[2, :bucket],
            block_tables=self._unused, seq_lens=self._unused[0], cu_seqlens_q=self._unused[0], max_q_len=0,
            token_slots=self.dev32[:bucket], logits_rows=self._unused[0], any_lora=lora, group_tokens=block_m,
            active_slots=bound if lora else 0,
            window_slot_mapping=self.dev64[3, :bucket] if hybrid else None,
            window_block_tables=self._unused if hybrid else None)

    # -- pieces --------------------------------------------------------------
    def _make(self, bucket: int, lora: bool, gemv: bool, bound: int) -> _Pieces | None:
        """The pieces of one key: captured graphs (warmed up on padding inputs), or the eager pieces;
        None if the device has no memory left for them."""
        if self._copied is not None:
            self._copied.synchronize()
        self._pad(0, bucket)  # a capture reads padding: no KV write, no adapter
        pieces = _Pieces([])
        batch = self._piece_batch(bucket, lora, gemv, bound)
        steps = self._pieces(batch, self.lora if lora else None, pieces.state)
        if not self.capture:
            pieces.runs = steps
            return pieces
        try:
            self._capture(steps, pieces)
        except torch.OutOfMemoryError as err:
            log.warning("mixed steps of %d tokens (LoRA %s, %d adapters) run eagerly: capturing their graphs ran "
                        "out of device memory (%s)", bucket, lora, bound, err)
            return None
        self.captures += 1
        return pieces

    def _capture(self, steps: list[Callable[[], None]], pieces: _Pieces) -> None:
        def all_pieces() -> None:
            for step in steps:
                step()

        warm_up(all_pieces, self.device)
        for step in steps:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.mempool):
                step()
            pieces.runs.append(graph.replay)

    def _pieces(self, batch: StepBatch, lora: LoraTables | None, state: dict) -> list[Callable[[], None]]:
        model, pool, n = self.model, self.pool, batch.input_ids.shape[0]
        h, q, attended = self.h[:n], self.q[:n], self.attended[:n]

        @torch.inference_mode()
        def first() -> None:
            state["ctx"] = ctx = model.context(batch, lora)
            embedded, x = model.embed(batch)
            h.copy_(embedded)
            q.copy_(model.attention_in(0, x, pool, ctx))

        @torch.inference_mode()
        def middle(i: int) -> None:  # layer i - 1 after its attention, layer i up to its attention
            new_h, x = model.layer_out(i - 1, h, attended, pool, state["ctx"], None)
            h.copy_(new_h)
            q.copy_(model.attention_in(i, x, pool, state["ctx"]))

        @torch.inference_mode()
        def last() -> None:
            self.hidden[:n].copy_(model.layer_out(len(model.layers) - 1, h, attended, pool, state["ctx"], None)[1])

        return [first, *(partial(middle, i) for i in range(1, len(model.layers))), last]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    t = torch.zeros(shape, dtype=dtype)
    return t.pin_memory() if pin else t

