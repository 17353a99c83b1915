"""The wire protocol of `unipage-serve`: msgspec Structs encoded as MessagePack.  Pure Python, no torch.

docs/protocol.md is the normative description (framing, every message, every
error code); this module is its Python binding.  In short::

    client (DEALER)  --- one frame: a MessagePack map, a Request ------->  server (ROUTER)
                     <-- one frame per reply: a MessagePack map, a Reply --

Every message is a map with ``"type"`` (the tag of its union member) and
``"v"`` (`VERSION`), and every request carries a ``request_id`` that the
replies to it echo.  A Generate is answered by zero or more `TokenChunk`s and
then exactly one terminal message for its id: `Finished`, or `Error`.  Every
other request is answered by exactly one reply.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta, Struct

VERSION = 1  # bumped on any incompatible change; a message with another "v" is refused with code "version"
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20  # largest request frame the server reads (configurable)

RequestId = Annotated[str, Meta(min_length=1, max_length=256)]
Name = Annotated[str, Meta(min_length=1, max_length=256)]


class ErrorCode:
    """Values of `Error.code`.  docs/protocol.md says when each is sent."""

    MALFORMED = "malformed"  # not one frame holding a MessagePack map of a known message with valid field types
    TOO_LARGE = "too_large"  # the frame exceeds the server's --max-message-bytes
    UNKNOWN_TYPE = "unknown_type"  # "type" names no request
    VERSION = "version"  # "v" missing or not this server's VERSION
    INVALID_REQUEST = "invalid_request"  # a value out of range: sampling, max_tokens, empty prompt, token ids ...
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt leaves no room for one token within the context length
    REQUEST_TOO_LARGE = "request_too_large"  # its KV and adapter could never fit in the pool at once
    DUPLICATE_REQUEST = "duplicate_request"  # this client already has a live request with this id
    UNKNOWN_REQUEST = "unknown_request"  # Abort of an id this client has no live request for
    UNKNOWN_ADAPTER = "unknown_adapter"  # adapter name not registered
    ADAPTER_EXISTS = "adapter_exists"  # LoadAdapter of a name already registered (or being loaded)
    ADAPTER_PATH = "adapter_path"  # adapter path outside the --adapter-root directories (or none configured)
    ADAPTER_INVALID = "adapter_invalid"  # missing or corrupt files, rank above the maximum, wrong shapes
    ADAPTER_BUSY = "adapter_busy"  # UnloadAdapter while live requests use it
    OVERLOADED = "overloaded"  # the server holds --max-active-requests requests already
    SLOW_READER = "slow_reader"  # the client read its replies too slowly: its requests were dropped
    SHUTTING_DOWN = "shutting_down"  # the server is draining and takes no new Generate or LoadAdapter
    INTERNAL = "internal"  # a server fault; the request is over, the server keeps serving

    ALL = (MALFORMED, TOO_LARGE, UNKNOWN_TYPE, VERSION, INVALID_REQUEST, PROMPT_TOO_LONG, REQUEST_TOO_LARGE,
           DUPLICATE_REQUEST, UNKNOWN_REQUEST, UNKNOWN_ADAPTER, ADAPTER_EXISTS, ADAPTER_PATH, ADAPTER_INVALID,
           ADAPTER_BUSY, OVERLOADED, SLOW_READER, SHUTTING_DOWN, INTERNAL)


class FinishReasons:
    """Values of `Finished.reason`."""

    STOP = "stop"  # generated a stop token (kept as the last token)
    LENGTH = "length"  # reached max_tokens or the context length
    ABORT = "abort"  # an Abort from the client, or the server shutting down (detail says which)
    SLO = "slo"  # dropped while waiting: predicted to miss the time-to-first-token objective
    LOAD_FAILED = "load_failed"  # its adapter could not be loaded into the pool

    ALL = (STOP, LENGTH, ABORT, SLO, LOAD_FAILED)


class _Msg(Struct, kw_only=True, tag_field="type", forbid_unknown_fields=False):
    v: int  # protocol version: always VERSION


# -- requests (client -> server) ---------------------------------------------------------------------


class Sampling(Struct, kw_only=True):
    """How the next token is drawn.  Checked by the server: bad values are an Error "invalid_request"."""

    temperature: float = 1.0  # 0 = greedy, >= 0
    top_p: float = 1.0  # nucleus mass, in (0, 1]
    top_k: int = 0  # 0 = all tokens, >= 0
    seed: int | None = None  # per-request seed: the same tokens whatever else is in the batch


class Generate(_Msg, tag="generate"):
    request_id: RequestId  # chosen by the client, unique among its live requests
    prompt: list[int] | str  # token ids, or text when the server's model has a tokenizer.json
    adapter: str | None = None  # a registered adapter's name, or None for the base model
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    max_tokens: int = 16  # tokens to generate at most, >= 1
    stop_token_ids: list[int] = msgspec.field(default_factory=list)  # extra tokens that end the request
    ignore_eos: bool = False  # do not stop at the tokenizer's end-of-sequence tokens
    stream: bool = True  # a TokenChunk per step (True) or one TokenChunk with everything at the end


class Abort(_Msg, tag="abort"):
    request_id: RequestId  # the Generate to abort; answered by its Finished (reason "abort")


class LoadAdapter(_Msg, tag="load_adapter"):
    request_id: RequestId
    name: Name  # the name requests will use; no "/"
    path: str  # a PEFT adapter directory on the server's file system, inside an --adapter-root


class UnloadAdapter(_Msg, tag="unload_adapter"):
    request_id: RequestId
    name: Name


class ListAdapters(_Msg, tag="list_adapters"):
    request_id: RequestId


class StatsRequest(_Msg, tag="stats"):
    request_id: RequestId


class HealthRequest(_Msg, tag="health"):
    request_id: RequestId


Request = Generate | Abort | LoadAdapter | UnloadAdapter | ListAdapters | StatsRequest | HealthRequest
REQUEST_TYPES = ("generate", "abort", "load_adapter", "unload_adapter", "list_adapters", "stats", "health")

# -- replies (server -> client) ----------------------------------------------------------------------


class TokenChunk(_Msg, tag="token_chunk"):
    request_id: str
    token_ids: list[int]  # tokens generated since the previous chunk
    text: str | None = None  # their text (UTF-8 held back until complete); None without a tokenizer


class Finished(_Msg, tag="finished"):
    request_id: str
    reason: str  # one of FinishReasons.ALL
    detail: str = ""  # why, in words, when the reason alone does not say
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None  # server-side: Generate received -> first token sent; None if no token
    latency_s: float = 0.0  # server-side: Generate received -> Finished sent


class Error(_Msg, tag="error"):
    request_id: str  # the request it answers; "" when the frame had no readable request_id
    code: str  # one of ErrorCode.ALL
    message: str  # for people: what was wrong and what to do


class AdapterInfo(Struct, kw_only=True):
    name: str
    path: str  # resolved directory
    rank: int  # largest rank of any of its modules
    resident: bool  # its weights are in the pool now
    pages: int  # pool pages it occupies when resident
    digest: str  # sha256 of its files (the prefix-cache salt)


class AdapterList(_Msg, tag="adapter_list"):
    request_id: str
    adapters: list[AdapterInfo]  # registered adapters, by name


class Stats(_Msg, tag="stats"):
    request_id: str
    pool_pages: dict[str, int]  # pages by owner kind: free, kv, cached_kv, adapter
    total_pages: int
    resident_adapters: list[str]
    registered_adapters: int
    waiting: int  # requests queued in the scheduler
    running: int  # requests holding KV pages
    active: int  # live Generate requests over all clients (waiting + running + being answered)
    clients: int  # clients with live requests or unsent replies
    tokens_per_s: float  # generated tokens per second over the last `window_s`
    window_s: float
    generated_tokens: int  # since start
    finished: int  # requests that ended with Finished, since start
    errors: int  # Error replies, since start
    steps: int  # engine steps, since start
    uptime_s: float


class Health(_Msg, tag="health"):
    request_id: str
    status: str  # "ok", or "draining" after SIGINT/SIGTERM
    model: str  # the served model (directory name)
    device: str
    has_tokenizer: bool  # text prompts are accepted and chunks carry text
    uptime_s: float


Reply = TokenChunk | Finished | Error | AdapterList | Stats | Health
REPLY_TYPES = ("token_chunk", "finished", "error", "adapter_list", "stats", "health")

# -- codecs ------------------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_raw_decoder = msgspec.msgpack.Decoder()


class ProtocolError(ValueError):
    """A frame that is not a valid message; ``code`` is the `ErrorCode` to answer with."""

    def __init__(self, code: str, message: str, request_id: str = "") -> None:
        super().__init__(message)
        self.code, self.message, self.request_id = code, message, request_id


class _RequestIdOnly(Struct):
    request_id: str = ""


_id_decoder = msgspec.msgpack.Decoder(_RequestIdOnly)


def peek_request_id(frame: bytes) -> str:
    """The ``request_id`` of a frame that will not be decoded in full (too large), or ""."""
    try:
        rid = _id_decoder.decode(frame).request_id
    except msgspec.DecodeError:
        return ""
    return rid if 0 < len(rid) <= 256 else ""


def encode(message: _Msg) -> bytes:
    return _encoder.encode(message)


def decode_request(frame: bytes) -> Request:
    """The request in ``frame``, or a `ProtocolError` saying why it is not one."""
    return _decode(frame, _request_decoder, REQUEST_TYPES, "protocol version {v} is not supported; "
                   "this server speaks version {ours}")


def decode_reply(frame: bytes) -> Reply:
    return _decode(frame, _reply_decoder, REPLY_TYPES, "reply of protocol version {v}; this client speaks "
                   "version {ours}")


def _decode(frame: bytes, decoder, types, wrong_version: str):
    try:
        message = decoder.decode(frame)
    except msgspec.DecodeError as err:
        raise _classify(frame, err, types) from None
    if message.v != VERSION:
        raise ProtocolError(ErrorCode.VERSION, wrong_version.format(v=message.v, ours=VERSION), message.request_id)
    return message


def _classify(frame: bytes, err: Exception, types: tuple[str, ...]) -> ProtocolError:
    """Why a frame failed to decode: a wrong version or type tells more than the field that broke."""
    try:
        raw = _raw_decoder.decode(frame)
    except msgspec.DecodeError:
        return ProtocolError(ErrorCode.MALFORMED, f"not a MessagePack value: {err}")
    if not isinstance(raw, dict):
        return ProtocolError(ErrorCode.MALFORMED, f"a message is a MessagePack map, got {type(raw).__name__}")
    rid = raw.get("request_id")
    rid = rid if isinstance(rid, str) and 0 < len(rid) <= 256 else ""
    version = raw.get("v")
    if version != VERSION or isinstance(version, bool):
        return ProtocolError(ErrorCode.VERSION, f"protocol version {version!r} is not supported; "
                             f"this side speaks version {VERSION} (key 'v')", rid)
    kind = raw.get("type")
    if kind not in types:
        return ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {kind!r}; expected one of "
                             f"{list(types)}", rid)
    return ProtocolError(ErrorCode.MALFORMED, f"bad {kind!r} message: {err}", rid)
