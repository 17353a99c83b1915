"""What crosses the scheduler's boundary each step, both ways.  Pure Python.

``Scheduler.schedule() -> SchedulerOutput`` tells the executor what to run;
``Scheduler.update(StepResult) -> list[RequestOutput]`` takes back what it
produced.  The executor keeps its own per-request state (tokens, block table,
adapter slot, tokens computed): a request arrives in full once
(``new_requests``), then only as diffs (``new_block_ids``, and the tokens it
sampled itself), and its state is dropped when its id shows up in
``finished_ids``, ``aborted_ids`` or ``preempted_ids`` (ids it never saw are
ignored).  The executor applies a step's output in this order: drop
finished/aborted/preempted, perform ``adapter_effects`` in order, add
``new_requests``, extend block tables by ``new_block_ids`` (and window tables
by ``new_window_block_ids``), run the batch (the effects may also be performed
while the batch runs: none of its requests uses what they load or evict).  An
executor that cannot run the batch calls ``Scheduler.abandon_step()``.

Batch order (``req_ids``): the running requests scheduled this step, in the
scheduler's running order, then the new ones.  Token ``t`` of the batch
belongs to the request whose range of ``num_scheduled_tokens`` covers it;
a request's scheduled tokens are ``token_ids[num_computed : num_computed + n]``
at positions ``num_computed ...``, and it samples a token when
``num_computed + n`` equals its number of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from operator import itemgetter

from unipage.adapters import DropHostCopy, EvictAdapter, LoadAdapter
from unipage.scheduler.request import FinishReason, SamplingParams

AdapterEffect = LoadAdapter | EvictAdapter | DropHostCopy


@dataclass(slots=True)
class NewRequestData:
    """A request the executor has no state for: admitted, or resumed after preemption."""

    request_id: str
    token_ids: list[int]  # prompt + tokens generated before a preemption (a copy)
    num_prompt_tokens: int  # token_ids[:num_prompt_tokens] is the prompt
    adapter: str | None  # adapter name, None for the base model
    adapter_slot: int  # the adapter's slot (the kernels' index); -1 for the base model
    sampling: SamplingParams
    block_table: list[int]  # page ids of its KV blocks, in token order (a copy; later growth comes as diffs)
    num_computed_tokens: int  # tokens whose KV is already in the pool (prefix-cache hit) before this step
    window_table: list[int] | None = None  # models with full and sliding-window layers: the sliding
    #   layers' block table (a copy, as long as block_table; NO_PAGE (-1) before the window); else None


@dataclass(slots=True)
class SchedulerOutput:
    """One step: what to compute, for whom, with which adapters, and which data to move first."""

    step: int  # index of this step, from 0
    new_requests: list[NewRequestData] = field(default_factory=list)  # sent in full (admitted or resumed)
    running_ids: list[str] = field(default_factory=list)  # already-running requests scheduled this step,
    #   batch order (the first len(running_ids) of req_ids)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)  # running requests whose block table
    #   grew this step -> the page ids appended (the others' tables are unchanged)
    new_window_block_ids: dict[str, list[int]] = field(default_factory=dict)  # the same for the window
    #   tables (models with full and sliding-window layers).  Entries of blocks that left the window are
    #   not sent: attention never reads them, so the executor's copies may keep the old page ids
    req_ids: list[str] = field(default_factory=list)  # batch order: running_ids, then the new requests' ids
    num_scheduled_tokens: list[int] = field(default_factory=list)  # per req_ids entry: tokens this step
    total_num_scheduled_tokens: int = 0  # sum of num_scheduled_tokens (<= max_num_batched_tokens)
    token_slots: list[int] = field(default_factory=list)  # [T] adapter slot of each scheduled token, batch
    #   order; -1 = no adapter
    adapters: list[str] = field(default_factory=list)  # distinct adapters of the batch
    #   (<= max_adapters_per_batch)
    adapter_effects: list[AdapterEffect] = field(default_factory=list)  # loads, evictions and host-copy
    #   drops decided since the last step, in the order they must be performed
    preempted_ids: list[str] = field(default_factory=list)  # preempted this step (or by abandon_step()
    #   since the last one): KV freed, will recompute
    aborted_ids: list[str] = field(default_factory=list)  # aborted since the last step, from any state
    finished_ids: list[str] = field(default_factory=list)  # finished in the last update()

    @property
    def adapter_loads(self) -> list[LoadAdapter]:
        return [e for e in self.adapter_effects if isinstance(e, LoadAdapter)]

    @property
    def adapter_evictions(self) -> list[EvictAdapter]:
        return [e for e in self.adapter_effects if isinstance(e, EvictAdapter)]

    @property
    def is_empty(self) -> bool:
        """Nothing to compute (loads may still be pending)."""
        return not self.req_ids


@dataclass(slots=True)
class StepResult:
    """What the executor reports after running a `SchedulerOutput`."""

    sampled_token_ids: list[list[int]] = field(default_factory=list)  # per SchedulerOutput.req_ids entry: the
    #   tokens sampled (empty for a request still in prefill); [] when nothing was scheduled
    loads_done: list[str] = field(default_factory=list)  # adapters whose LoadAdapter has completed
    loads_failed: list[str] = field(default_factory=list)  # adapters whose LoadAdapter failed


class RequestOutput(tuple):
    """New tokens of one request in one step; ``finish_reason`` is set on its last output.

    An immutable record over the tuple ``(request_id, new_token_ids, finish_reason, detail)``, built from
    that tuple as `time.struct_time` is from its fields: ``RequestOutput((request_id, new_token_ids,
    finish_reason, detail))``; `RequestOutput.of` takes the fields as arguments.  It has no ``__new__`` of
    its own, so that `update`, which makes one per running request every step, makes them with the tuple
    type's constructor in C (`make_outputs`).  Equal only to another `RequestOutput` with equal fields.
    """

    __slots__ = ()

    @classmethod
    def of(cls, request_id: str, new_token_ids: list[int], finish_reason: FinishReason | None = None,
           detail: str = "") -> RequestOutput:
        return cls((request_id, new_token_ids, finish_reason, detail))

    request_id = property(itemgetter(0), doc="the request's id")
    new_token_ids = property(itemgetter(1), doc="tokens generated this step (may be empty on a final output)")
    finish_reason = property(itemgetter(2), doc="None while the request goes on")
    detail = property(itemgetter(3), doc="why it was dropped (SLO, LOAD_FAILED), for the caller")

    @property
    def finished(self) -> bool:
        return self[2] is not None

    def __repr__(self) -> str:
        reason = self.finish_reason.name if self.finish_reason else None
        return f"RequestOutput({self.request_id!r}, {self.new_token_ids}, {reason}, {self.detail!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RequestOutput) and tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # new_token_ids is a list


def make_outputs(request_ids: list[str], sampled: list[list[int]]) -> list[RequestOutput]:
    """``[RequestOutput.of(r, t) for r, t in zip(request_ids, sampled)]``, made in C."""
    n = len(request_ids)
    return list(map(RequestOutput, zip(request_ids, sampled, repeat(None, n), repeat("", n))))
