"""`ModelRunner`: turns a `SchedulerOutput` into tensors, runs the model, samples.

The runner keeps its own state per request (the executor side of the
scheduler's contract, see `unipage.scheduler.output`): tokens, block table,
adapter slot and tokens computed.  A step's output is applied in the
contract's order — drop finished/aborted/preempted, add new requests, extend
block tables — and then `execute` builds one `StepBatch` at one boundary, runs
the forward pass (the engine performs the adapter effects once it is launched,
through ``during``) and samples a token for every request that caught up with
its tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from unipage.graphs import DecodeGraphs, RunAhead
from unipage.lora_layout import AdapterLayout
from unipage.mixed_graphs import MixedGraphs
from unipage.models.decoder import DecoderLM
from unipage.models.lora_tables import LoraTables
from unipage.models.moe_stacks import MoeStacks
from unipage.models.shrink_stack import ShrinkStack
from unipage.sampling import make_generator, sample_tokens
from unipage.scheduler import SamplingParams, SchedulerOutput
from unipage.staging import StagedUpload
from unipage.step_inputs import host_batch, upload


@dataclass
class SeqState:
    """A running request as the runner sees it.  Its tables are only ever extended, never edited or
    replaced (the decode graphs' `DecodeInputs` copies only the pages added since a row's last fill)."""

    token_ids: list[int]  # prompt + generated
    block_table: list[int]  # page ids of its KV blocks
    slot: int  # adapter slot, -1 = base model
    num_computed: int  # tokens whose KV is in the pool
    sampling: SamplingParams
    generator: torch.Generator | None
    window_table: list[int] | None = None  # the sliding-window layers' block table (hybrid models)


@dataclass(frozen=True)
class GraphLimits:
    max_seqs: int  # the largest decode batch captured (the scheduler's max_num_seqs)
    max_model_len: int  # sets the block-table width of the graphs
    max_adapters: int  # distinct adapters per step (the LoRA kernels' tile-height hint)
    max_tokens: int = 0  # mixed steps up to this many tokens replay piecewise graphs (0: they run eagerly)
    run_ahead: bool = False  # launch each decode step's successor before reading its tokens (`ModelRunner`)


@dataclass
class StepOutput:
    sampled: list[list[int]]  # per SchedulerOutput.req_ids entry
    logits: dict[str, torch.Tensor]  # request id -> [V] float32 logits it sampled from (when kept)


class ModelRunner:
    def __init__(self, model: DecoderLM, pool: torch.Tensor, block_tokens: int, device: torch.device,
                 keep_logits: bool = False, graphs: GraphLimits | None = None, lora_slots: int | None = None) -> None:
        """``graphs``: capture CUDA graphs of decode steps (and of mixed steps, piecewise) within these limits
        (None: run eagerly).
        ``lora_slots``: the LoRA tables' slot capacity from the start (None: grown on demand).
        The model's shrink stack (``model.stack``, `shrink_stack`), if it has one, is kept in step here."""
        self.model, self.pool, self.block_tokens, self.device = model, pool, block_tokens, device
        self.lora = LoraTables(model.model, device, slots=lora_slots)
        self.stack: ShrinkStack | None = model.stack
        self.moe_stacks: MoeStacks | None = model.moe_stacks
        self.upload = StagedUpload(device)
        self.graphs = self.mixed = None
        if graphs is not None:
            self.graphs = DecodeGraphs(model, pool, self.lora, block_tokens, graphs.max_seqs,
                                       -(-graphs.max_model_len // block_tokens), graphs.max_adapters, device)
        if graphs is not None and graphs.max_tokens:
            self.mixed = MixedGraphs(model, pool, self.lora, block_tokens, graphs.max_tokens, graphs.max_adapters,
                                     device)
        self.seqs: dict[str, SeqState] = {}
        self._generators: dict[str, torch.Generator | None] = {}  # of preempted requests, until resumed
        self.keep_logits = keep_logits
        self.run_ahead = graphs is not None and graphs.run_ahead
        self._ahead: RunAhead | None = None  # the decode step launched ahead, if any
        self._tokens_copied = torch.cuda.Event() if graphs is not None else None  # (run_ahead may be switched on)
        self.ahead_taken = self.ahead_dropped = 0  # steps run ahead that were used / thrown away

    # -- adapter slots (the engine calls these while performing effects) --
    def slot_loaded(self, slot: int, pages, layout: AdapterLayout) -> None:
        self.lora.assign(slot, pages, layout)
        if self.stack is not None:
            self.stack.forget(slot)
        if self.moe_stacks is not None:
            self.moe_stacks.assign(slot, layout)

    def slot_evicted(self, slot: int) -> None:
        self.lora.release(slot)
        if self.stack is not None:
            self.stack.forget(slot)
        if self.moe_stacks is not None:
            self.moe_stacks.release(slot)

    # -- request state -----------------------------------------------------
    def drop(self, out: SchedulerOutput) -> None:
        for rid in (*out.finished_ids, *out.aborted_ids):
            self.seqs.pop(rid, None)
            self._generators.pop(rid, None)
        for rid in out.preempted_ids:  # its generator lives on: a resumed request continues its random stream
            seq = self.seqs.pop(rid, None)
            if seq is not None:
                self._generators[rid] = seq.generator

    def admit(self, out: SchedulerOutput) -> None:
        for new in out.new_requests:
            gen = self._generators.pop(new.request_id, None) or make_generator(new.sampling, self.device)
            window = list(new.window_table) if new.window_table is not None else None
            self.seqs[new.request_id] = SeqState(list(new.token_ids), list(new.block_table), new.adapter_slot,
                                                 new.num_computed_tokens, new.sampling, gen, window)
        for rid, pages in out.new_block_ids.items():
            self.seqs[rid].block_table.extend(pages)
        for rid, pages in out.new_window_block_ids.items():
            self.seqs[rid].window_table.extend(pages)

    # -- one step ------------------------------------------------------------
    def execute(self, out: SchedulerOutput, during: Callable[[], None] | None = None) -> StepOutput:
        """Run the step's forward pass and sample.  ``during`` is called once the forward pass is launched
        and before sampling waits for it (at once if nothing runs): host work that overlaps the GPU.

        With ``run_ahead`` a decode step launches its successor's graph (`DecodeGraphs.run_ahead`) before
        the host reads its tokens: the same sequences one position on, fed their tokens on the device.
        The next step uses that launch if it is a decode step of those sequences (any subset, any order:
        requests finishing, aborted or preempted leave rows unused), else throws it away: the GPU then
        runs it for nothing, and its KV writes are overwritten or fall in pages whose owner is gone (all
        on one stream, before whatever comes next, so pages freed meanwhile are written in order)."""
        ahead, self._ahead = self._ahead, None
        if not out.req_ids:
            if during is not None:
                during()
            return StepOutput([], {})
        self.lora.refresh()
        seqs = [self.seqs[rid] for rid in out.req_ids]
        self._check_fits(out, seqs)
        self._prepare_stack(seqs, out.num_scheduled_tokens)
        samplers = [i for i, (seq, n) in enumerate(zip(seqs, out.num_scheduled_tokens))
                    if seq.num_computed + n == len(seq.token_ids)]
        decode = self.graphs is not None and self.graphs.accepts(out.num_scheduled_tokens,
                                                                  [s.block_table for s in seqs], [s.slot for s in seqs])
        hidden = self._take_ahead(seqs, ahead, decode)
        if decode:
            hidden = self.graphs.run(seqs) if hidden is None else hidden
            logits = self.model.logits(hidden if len(samplers) == len(seqs) else hidden[samplers])
        else:
            logits = self._forward(seqs, out.num_scheduled_tokens)
        if during is not None:
            during()
        tokens = sample_tokens(logits, [seqs[i].sampling for i in samplers], [seqs[i].generator for i in samplers])
        for seq, n in zip(seqs, out.num_scheduled_tokens):
            seq.num_computed += n
        kept = ({out.req_ids[i]: logits[row].to("cpu", non_blocking=True) for row, i in enumerate(samplers)}
                if self.keep_logits else {})  # (read once the tokens are: copied before them)
        if decode and self.run_ahead and len(samplers) == len(seqs):
            host = self._to_host(tokens)  # queued before the step run ahead, so not read after it
            self._ahead = self.graphs.run_ahead(seqs, tokens)
            self._tokens_copied.synchronize()
            tokens = host
        sampled: list[list[int]] = [[] for _ in seqs]
        for i, token in zip(samplers, tokens.tolist()):
            seqs[i].token_ids.append(token)
            sampled[i] = [token]
        return StepOutput(sampled, kept)

    def _to_host(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` copied into pinned host memory, the copy's end recorded in ``_tokens_copied``."""
        host = tokens.to("cpu", non_blocking=True)
        self._tokens_copied.record()
        return host

    def _take_ahead(self, seqs: list[SeqState], ahead: RunAhead | None, decode: bool) -> torch.Tensor | None:
        """The decode step's hidden states if the step run ahead (if any) ran it, else None; counts that step
        as taken or thrown away."""
        if ahead is None:
            return None
        hidden = self.graphs.take_ahead(ahead, seqs) if decode else None
        if hidden is None:
            self.ahead_dropped += 1
        else:
            self.ahead_taken += 1
        return hidden

    def _forward(self, seqs: list[SeqState], num_tokens: list[int]) -> torch.Tensor:
        """Logits of the step's sampling rows, eagerly or through the mixed steps' graphs."""
        host = host_batch(seqs, num_tokens, self.block_tokens)
        hidden = None
        if self.mixed is not None and self.mixed.accepts(host.num_tokens):
            hidden = self.mixed.run(host, self.upload)  # None: this step runs eagerly
        if hidden is not None:
            return self.model.logits(hidden)
        return self.model.forward(upload(host, self.upload), self.pool, self.lora, self.block_tokens)

    def _prepare_stack(self, seqs: list[SeqState], num_tokens: list[int]) -> None:
        """Bring the step's adapters into the shrink stack if the step may use it (the model decides by
        its token count, or its graph bucket's, which is no smaller), and into the MoE LoRA stacks if they
        may take them (the model decides by the step's or its graph's adapter bound, no smaller)."""
        if self.lora.page_table is None:
            return
        slots = {seq.slot for seq in seqs if seq.slot >= 0}
        rows = self.model.model.layer_rows
        if slots and self.stack is not None and self.stack.covers(sum(num_tokens)):
            self.stack.prepare(slots, self.lora, self.pool, rows)
        if slots and self.moe_stacks is not None and self.moe_stacks.covers(self._bucket(sum(num_tokens)), len(slots)):
            self.moe_stacks.prepare(slots, self.lora, self.pool, rows)

    def _bucket(self, tokens: int) -> int:
        """The most tokens a step of ``tokens`` tokens runs as: its graph bucket's, decode or mixed (`covers` of
        the MoE LoRA stacks grows with tokens and shrinks with adapters, and a graph's adapter class is no
        smaller than its step's adapters, so a step the model runs through the stacks finds them filled)."""
        chosen = [min((b for b in graphs.buckets if b >= tokens), default=tokens)
                  for graphs in (self.graphs, self.mixed) if graphs is not None]
        return max(chosen, default=tokens)

    def _check_fits(self, out: SchedulerOutput, seqs: list[SeqState]) -> None:
        bt = self.block_tokens
        for rid, seq, n in zip(out.req_ids, seqs, out.num_scheduled_tokens):
            end = seq.num_computed + n
            if end > len(seq.token_ids) or end > len(seq.block_table) * bt:
                raise RuntimeError(f"request {rid!r}: {n} tokens scheduled at {seq.num_computed} exceed its "
                                   f"{len(seq.token_ids)} tokens or {len(seq.block_table)} KV blocks")
