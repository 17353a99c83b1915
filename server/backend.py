"""The server's one view of the engine: `EngineBackend` turns protocol messages into engine calls.

The server loop talks only to this interface (`Backend`), so a benchmark can
swap in an engine that computes nothing and time the frontend alone.  Every
caller-caused problem is a `BackendError` with the protocol's error code;
a call that raises changes nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

from unipage.scheduler import (
    PromptTooLongError,
    Request,
    RequestTooLargeError,
    SamplingParams,
)
from unipage.server.protocol import AdapterInfo, ErrorCode, Generate

from unipage.errors import (
    AdapterBusyError,
    AdapterError,
    AdapterExistsError,
    AdapterPathError,
    ClosedError,
    UnknownAdapterError,
)


class BackendError(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(slots=True)
class Output:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None  # a protocol FinishReasons value once the request is over
    detail: str = ""


class Backend(Protocol):
    model_name: str
    device: str
    tokenizer: object | None  # has decode(ids) -> str when text is available

    def submit(self, request_id: str, message: Generate) -> int: ...  # prompt tokens; BackendError
    def abort(self, request_id: str) -> bool: ...
    def has_unfinished(self) -> bool: ...
    def step(self) -> list[Output]: ...
    def inspect_adapter(self, path: str, roots: tuple[str, ...]) -> object: ...  # any thread; BackendError
    def register_adapter(self, name: str, info: object) -> None: ...  # BackendError
    def remove_adapter(self, name: str) -> None: ...  # BackendError
    def has_adapter(self, name: str) -> bool: ...
    def adapters(self) -> list[AdapterInfo]: ...
    def stats(self) -> dict: ...  # the engine-side fields of protocol.Stats


def adapter_error_code(err: Exception) -> str:
    if isinstance(err, AdapterPathError):
        return ErrorCode.ADAPTER_PATH
    if isinstance(err, AdapterExistsError):
        return ErrorCode.ADAPTER_EXISTS
    if isinstance(err, UnknownAdapterError):
        return ErrorCode.UNKNOWN_ADAPTER
    if isinstance(err, AdapterBusyError):
        return ErrorCode.ADAPTER_BUSY
    return ErrorCode.ADAPTER_INVALID


class EngineBackend:
    """`unipage.engine.Engine` (and the model's tokenizer, if any) behind the `Backend` interface."""

    def __init__(self, engine, tokenizer=None, model_name: str = "") -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.device = str(engine.device)
        self.eos = tuple(tokenizer.eos_token_ids) if tokenizer is not None else ()

    # -- requests --------------------------------------------------------------------------------
    def submit(self, request_id: str, message: Generate) -> int:
        prompt = message.prompt
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise BackendError(ErrorCode.INVALID_REQUEST, "text prompts need a model with a tokenizer.json; "
                                   "send token ids instead")
            prompt = self.tokenizer.encode(prompt)
        s = message.sampling
        try:
            sampling = SamplingParams(s.temperature, s.top_p, s.top_k, s.seed)
        except (ValueError, TypeError) as err:
            raise BackendError(ErrorCode.INVALID_REQUEST, f"sampling: {err}") from None
        stops = tuple(message.stop_token_ids) + (() if message.ignore_eos else self.eos)
        request = Request(request_id, list(prompt), message.adapter, sampling, message.max_tokens, stops)
        try:
            self.engine.add_request(request)
        except PromptTooLongError as err:
            raise BackendError(ErrorCode.PROMPT_TOO_LONG, str(err)) from None
        except RequestTooLargeError as err:
            raise BackendError(ErrorCode.REQUEST_TOO_LARGE, str(err)) from None
        except UnknownAdapterError as err:
            raise BackendError(ErrorCode.UNKNOWN_ADAPTER, str(err)) from None
        except ClosedError as err:
            raise BackendError(ErrorCode.SHUTTING_DOWN, str(err)) from None
        except ValueError as err:
            raise BackendError(ErrorCode.INVALID_REQUEST, str(err)) from None
        return len(prompt)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def close(self) -> None:
        """Close the engine (`Engine.close`: its storage's shared memory and reader processes go); safe to
        call again.  Not part of `Backend`: whoever builds the backend closes it, after the server stops."""
        self.engine.close()

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[Output]:
        return [Output(o.request_id, o.new_token_ids, o.finish_reason.value if o.finish_reason else None,
                       o.detail or "") for o in self.engine.step()]

    # -- adapters --------------------------------------------------------------------------------
    def inspect_adapter(self, path: str, roots: tuple[str, ...]):
        """Check ``path`` against ``roots`` and the model; reads files only, so any thread may call it."""
        from unipage.peft_io import inspect_adapter, resolve_adapter_dir

        try:
            resolve_adapter_dir(path, roots)
            return inspect_adapter(path, self.engine.config.model, self.engine.config.lora)
        except AdapterError as err:
            raise BackendError(adapter_error_code(err), str(err)) from None
        except (OSError, ValueError) as err:
            raise BackendError(ErrorCode.ADAPTER_INVALID, f"adapter {path!r}: {err}") from None

    def register_adapter(self, name: str, info) -> None:
        try:
            self.engine.memory.adapters.register(name, info)
        except AdapterError as err:
            raise BackendError(adapter_error_code(err), str(err)) from None

    def remove_adapter(self, name: str) -> None:
        try:
            self.engine.remove_adapter(name)
        except AdapterError as err:
            raise BackendError(adapter_error_code(err), str(err)) from None

    def has_adapter(self, name: str) -> bool:
        return name in self.engine.memory.adapters

    def adapters(self) -> list[AdapterInfo]:
        manager = self.engine.memory.adapters
        out = []
        for name in sorted(manager.names()):
            record = manager.get(name)
            out.append(AdapterInfo(name=name, path=os.fspath(record.info.path), rank=record.info.max_rank,
                                   resident=record.resident, pages=record.num_pages, digest=record.info.digest))
        return out

    def stats(self) -> dict:
        memory, scheduler = self.engine.memory, self.engine.scheduler
        return {"pool_pages": memory.occupancy(), "total_pages": memory.pool.num_pages,
                "resident_adapters": sorted(memory.adapters.resident()),
                "registered_adapters": len(memory.adapters.names()), "waiting": scheduler.num_waiting,
                "running": len(scheduler.running), "steps": scheduler.stats.steps}
