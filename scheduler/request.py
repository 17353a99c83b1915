"""A request, its states and the legal transitions between them.  Pure Python.

One scheduling model (as in vLLM v1): a request's tokens are its prompt
followed by what it has generated; ``num_computed_tokens`` (tokens whose KV is
in the pool, counting those scheduled in the step in flight) catches up with
``num_tokens`` a chunk at a time.  Prefill and decode are the same thing: a
step gives a request ``num_tokens - num_computed_tokens`` tokens or fewer,
and when the request has caught up the executor samples one more.

States and transitions (``TRANSITIONS``; anything else raises
`InvalidTransitionError`)::

    add() --> WAITING --admit--> RUNNING --stop / length--> FINISHED
               |   ^               |
      adapter  |   | its adapter   | out of pages: preempted by recompute
      missing  v   | loaded        v   (KV freed, adapter unpinned)
        WAITING_FOR_ADAPTER <--- PREEMPTED --admit--> RUNNING

    any live state --abort(), early abort, failed load--> ABORTED

WAITING, WAITING_FOR_ADAPTER and PREEMPTED are the waiting states: the request
sits in the policy's queue and holds no pages.  RUNNING holds a block table
and a pin on its adapter.  FINISHED and ABORTED hold nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


NEVER = 1 << 62  # a token count no request reaches (an int: compares faster with ints than inf)


class RequestError(ValueError):
    """A request the scheduler cannot take; the message names the cause."""


class DuplicateRequestError(RequestError):
    """A request id that is already live."""


class PromptTooLongError(RequestError):
    """A prompt that leaves no room for one generated token within ``max_model_len``."""


class RequestTooLargeError(RequestError):
    """A request whose KV and adapter could never fit in the pool at once."""


class InvalidTransitionError(RuntimeError):
    """A state change outside ``TRANSITIONS`` (a scheduler bug, never bad input)."""


class RequestStatus(Enum):
    WAITING = "waiting"  # queued
    WAITING_FOR_ADAPTER = "waiting_for_adapter"  # queued, found with its adapter not resident: its load is in
    #   flight or waits for pages; back to WAITING when the load completes
    RUNNING = "running"  # holds KV pages and a pin on its adapter; gets tokens every step it fits
    PREEMPTED = "preempted"  # was running, lost its KV to memory pressure; queued to recompute
    FINISHED = "finished"  # stopped or reached its length
    ABORTED = "aborted"  # aborted by the caller, dropped by the policy, or its adapter failed to load

    @property
    def is_waiting(self) -> bool:  # (module constants: in Python 3.11 a member read from its class is slow)
        return self is _WAITING or self is _WAITING_FOR_ADAPTER or self is _PREEMPTED  # no Enum hashing

    @property
    def is_done(self) -> bool:
        return self is _FINISHED or self is _ABORTED


_S = RequestStatus
_WAITING, _WAITING_FOR_ADAPTER, _PREEMPTED, _FINISHED, _ABORTED = \
    _S.WAITING, _S.WAITING_FOR_ADAPTER, _S.PREEMPTED, _S.FINISHED, _S.ABORTED
TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    _S.WAITING: frozenset((_S.RUNNING, _S.WAITING_FOR_ADAPTER, _S.ABORTED)),
    _S.WAITING_FOR_ADAPTER: frozenset((_S.WAITING, _S.ABORTED)),
    _S.RUNNING: frozenset((_S.PREEMPTED, _S.FINISHED, _S.ABORTED)),
    _S.PREEMPTED: frozenset((_S.RUNNING, _S.WAITING_FOR_ADAPTER, _S.ABORTED)),
    _S.FINISHED: frozenset(),
    _S.ABORTED: frozenset(),
}
_ALLOWED = {status.value: tuple(targets) for status, targets in TRANSITIONS.items()}  # `transition`'s table: an
#   Enum member hashes in Python code, its value and an identity test in a tuple do not


class FinishReason(Enum):
    STOP = "stop"  # generated one of its stop tokens (kept as the last output token)
    LENGTH = "length"  # reached max_tokens or max_model_len
    ABORT = "abort"  # abort() by the caller
    SLO = "slo"  # dropped while waiting: predicted to miss its time-to-first-token objective
    LOAD_FAILED = "load_failed"  # its adapter could not be loaded (or was unregistered)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the executor samples; the scheduler only carries it."""

    temperature: float = 1.0  # 0 = greedy, >= 0
    top_p: float = 1.0  # nucleus mass, in (0, 1]
    top_k: int = 0  # 0 = all tokens, >= 0
    seed: int | None = None  # per-request sampling seed

    def __post_init__(self) -> None:
        checks = (("temperature", self.temperature >= 0, ">= 0"), ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
                  ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0"))
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")


@dataclass(slots=True, eq=False)
class Request:
    """What a caller submits (the first nine fields) and the scheduler's state for it (the rest)."""

    request_id: str  # unique among live requests
    prompt_token_ids: list[int]  # at least one token, fewer than max_model_len
    adapter: str | None = None  # a registered adapter's name, or None for the base model
    sampling: SamplingParams = field(default_factory=SamplingParams)  # passed to the executor
    max_tokens: int = 16  # tokens to generate at most, >= 1
    stop_token_ids: tuple[int, ...] = ()  # generating one of these finishes the request (STOP)
    arrival_time: float | None = None  # seconds on the scheduler's clock; None = when add() is called
    tenant: str = ""  # who pays: the VTC policy can keep one counter per tenant
    priority: int = 0  # lower runs first; equal priorities are served in arrival order

    # -- scheduler state: set by Scheduler.add and the phases, read-only to callers --
    # (The fields every step reads come first, side by side: in a slotted object they share cache lines.)
    num_computed_tokens: int = field(default=0, init=False)  # KV in the pool, incl. the step in flight
    next_check: int = field(default=0, init=False)  # computed tokens from which update() looks closer: the
    #   length limit is one token away, or no token was sampled yet (0); 0 while not running
    stop_set: frozenset = field(default=frozenset(), init=False)
    all_token_ids: list[int] = field(default_factory=list, init=False)  # prompt + output
    capacity: int = field(default=0, init=False)  # tokens its block table holds
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    next_commit: int = field(default=NEVER, init=False)  # computed tokens at which a block fills (<= capacity
    #   after each schedule(): a request whose table is full has a block to commit)
    policy_data: object = field(default=None, init=False)  # owned by the scheduling policy
    num_prompt_tokens: int = field(default=0, init=False)
    num_cached_tokens: int = field(default=0, init=False)  # prefix-cache hit at the last admission
    max_len: int = field(default=0, init=False)  # num_tokens at which it finishes by LENGTH
    finish_reason: FinishReason | None = field(default=None, init=False)
    seq: int = field(default=0, init=False)  # add() order: the tie-break of every ordering
    slot: int = field(default=-1, init=False)  # adapter slot while running; -1 = base model
    salt: str = field(default="", init=False)  # prefix-hash salt: its adapter's content digest at admission
    block_table: list[int] | None = field(default=None, init=False)  # live KV table while running
    window_table: list[int] | None = field(default=None, init=False)  # live table of the sliding-window
    #   layers' KV while running, when the model mixes them with full layers (else None)
    skips: int = field(default=0, init=False)  # times passed over since it last entered the queue
    num_preemptions: int = field(default=0, init=False)
    first_token_time: float | None = field(default=None, init=False)
    finish_time: float | None = field(default=None, init=False)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def queue_key(self) -> tuple:
        """FCFS order within a priority level."""
        return (self.priority, self.arrival_time, self.seq)

    def transition(self, new: RequestStatus) -> None:
        if new not in _ALLOWED[self.status.value]:
            raise InvalidTransitionError(f"request {self.request_id!r}: {self.status.name} -> {new.name} "
                                         f"is not a legal transition")
        self.status = new


def next_check(req: Request) -> int:
    """``req.next_check`` for its current state: update() treats it as a plain decode until then."""
    return req.max_len - 1 if req.first_token_time is not None else 0
