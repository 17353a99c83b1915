"""`SchedulerConfig`: the scheduler's limits and policy choices, frozen and validated.

Each field's comment doubles as its help text.  A bad value raises
``ValueError`` naming the field and the allowed range.  The distinct-adapter
limit per step is not here: it is ``LoRAConfig.max_adapters_per_batch`` (a
kernel grid dimension), read from the memory's config.
"""

from __future__ import annotations

from dataclasses import dataclass

from unipage.config import int_at_least, require

ADMISSION_MODES = ("optimistic", "reserve")
VTC_CLIENTS = ("adapter", "tenant")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching: budgets per step, the ordering policy and the admission mode."""

    max_model_len: int = 4096  # context length: prompt + generated tokens of one request, >= 2
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes), >= 1
    max_num_seqs: int = 256  # running requests at most (each gets tokens in a step), >= 1
    long_prefill_token_threshold: int = 0  # most prefill tokens one request gets per step; 0 = the budget
    policy: str = "fcfs"  # waiting-queue order: fcfs, affinity, vtc or slo (see unipage.scheduler.policies)
    admission: str = "optimistic"  # optimistic (grow KV as needed, preempt by recompute) or reserve
    #   (reserve KV for the whole request at admission: no preemption ever)
    lookahead: int = 128  # waiting requests examined for admission per step, >= 1
    max_skips: int = 16  # steps a waiting request may be passed over before it blocks those behind it, >= 0
    prefetch_depth: int = 8  # next waiting requests whose adapters are loaded ahead while pages are free, >= 0
    prefill_coalesce_steps: int = 0  # steps in a row admission may wait while an adapter load is in flight for
    #   one of the next lookahead waiting requests, some prompt is ready but the ready ones fill less than the
    #   step, every running request only decodes and the batch has room: prompts whose adapters land a step or
    #   two apart then share one prefill step (0 = never wait; the slo policy's TTFT prediction does not count
    #   these waits; see Admission.waits), >= 0
    decode_kv_ahead: int = 0  # in a step of decodes only, each request also gets KV room for this many tokens
    #   past its own where a page is free or reclaimable, after every request's own room and the admission
    #   (never preempting): the engine's decode run-ahead writes the next step's KV before this scheduler has
    #   seen the step's tokens (`unipage.runner`); below the KV block size, >= 0
    affinity_max_wait_s: float = 1.0  # affinity: a request waiting this long goes first, in FCFS order, >= 0
    vtc_client: str = "adapter"  # vtc: whose virtual token counter a request charges: adapter or tenant
    vtc_input_weight: float = 1.0  # vtc: counter increment per prompt token computed, > 0
    vtc_output_weight: float = 2.0  # vtc: counter increment per generated token, > 0
    slo_ttft_s: float = 2.0  # slo: time-to-first-token objective; waiting requests predicted to miss it are dropped, > 0
    step_time_s: float = 0.03  # slo: duration of one step at the full token budget (the prediction model), > 0

    def __post_init__(self) -> None:
        require(int_at_least(self.max_model_len, 2), "max_model_len", "an integer >= 2", self.max_model_len)
        for name in ("max_num_batched_tokens", "max_num_seqs", "lookahead"):
            require(int_at_least(getattr(self, name), 1), name, "an integer >= 1", getattr(self, name))
        for name in ("long_prefill_token_threshold", "max_skips", "prefetch_depth", "prefill_coalesce_steps",
                     "decode_kv_ahead"):
            require(int_at_least(getattr(self, name), 0), name, "an integer >= 0", getattr(self, name))
        require(self.admission in ADMISSION_MODES, "admission", f"one of {list(ADMISSION_MODES)}",
                 self.admission)
        require(self.vtc_client in VTC_CLIENTS, "vtc_client", f"one of {list(VTC_CLIENTS)}", self.vtc_client)
        require(isinstance(self.affinity_max_wait_s, (int, float)) and self.affinity_max_wait_s >= 0,
                 "affinity_max_wait_s", ">= 0", self.affinity_max_wait_s)
        for name in ("vtc_input_weight", "vtc_output_weight", "slo_ttft_s", "step_time_s"):
            value = getattr(self, name)
            require(isinstance(value, (int, float)) and value > 0, name, "> 0", value)
        from unipage.scheduler.policies import POLICIES  # late: policies import this module

        require(self.policy in POLICIES, "policy", f"one of {sorted(POLICIES)}", self.policy)
