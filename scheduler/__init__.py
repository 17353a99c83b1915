"""unipage.scheduler — adapter-aware continuous batching over the unified pool (pure Python).

    from unipage.scheduler import Request, Scheduler, SchedulerConfig, StepResult

    scheduler = Scheduler(memory, SchedulerConfig(max_model_len=4096, policy="vtc"))
    scheduler.add(Request("r1", prompt_token_ids, adapter="sql"))
    while scheduler.has_unfinished():
        out = scheduler.schedule()                # SchedulerOutput: what to run, what to load
        result = executor.run(out)                # StepResult: sampled tokens, loads done/failed
        for o in scheduler.update(result):        # RequestOutput: new tokens, finish reason
            ...

See docs/design.md ("Scheduler (`unipage.scheduler`)") and docs/scheduler_example.py.
"""

from unipage.scheduler.config import SchedulerConfig
from unipage.scheduler.output import NewRequestData, RequestOutput, SchedulerOutput, StepResult
from unipage.scheduler.policies import POLICIES, SchedulingPolicy, StepContext, make_policy, register_policy
from unipage.scheduler.request import (TRANSITIONS, DuplicateRequestError, FinishReason, InvalidTransitionError,
                                       PromptTooLongError, Request, RequestError, RequestStatus,
                                       RequestTooLargeError, SamplingParams)
from unipage.scheduler.scheduler import Scheduler, SchedulerStats

__all__ = [
    "POLICIES", "TRANSITIONS", "DuplicateRequestError", "FinishReason", "InvalidTransitionError",
    "NewRequestData", "PromptTooLongError", "Request", "RequestError", "RequestOutput", "RequestStatus",
    "RequestTooLargeError", "SamplingParams", "Scheduler", "SchedulerConfig", "SchedulerOutput",
    "SchedulerStats", "SchedulingPolicy", "StepContext", "StepResult", "make_policy", "register_policy",
]
