"""Python clients of `unipage-serve`: `Client` (blocking) and `AsyncClient` (asyncio).  No torch.

    from unipage.server import Client

    with Client("tcp://127.0.0.1:5555") as client:
        for chunk in client.generate("Hello", adapter="sql", max_tokens=32, temperature=0):
            print(chunk.text or chunk.token_ids, end="", flush=True)
        done = client.complete([1, 2, 3], max_tokens=8)          # Completion: token_ids, text, finish_reason ...
        client.load_adapter("chat", "/srv/adapters/chat")       # at run time, inside an --adapter-root
        print(client.stats().pool_pages)

    async with AsyncClient("tcp://127.0.0.1:5555") as client:
        async for chunk in client.generate([1, 2, 3], max_tokens=8):
            ...
        done = await client.complete("Hi", adapter="chat")

One DEALER socket per client; replies are matched to requests by
``request_id``, so several streams of one client may be read interleaved.  A
`Client` is not thread-safe (use one per thread); an `AsyncClient` serves any
number of tasks on one event loop.  Every Error reply is raised as a
`ServerError` carrying its code (docs/protocol.md lists them).
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections import deque

import msgspec
import zmq
import zmq.asyncio
from unipage.server.protocol import (
    VERSION,
    Abort,
    AdapterInfo,
    AdapterList,
    Error,
    Finished,
    Generate,
    Health,
    HealthRequest,
    ListAdapters,
    LoadAdapter,
    ProtocolError,
    Sampling,
    Stats,
    StatsRequest,
    TokenChunk,
    UnloadAdapter,
    decode_reply,
    encode,
)


class ServerError(Exception):
    """An Error reply: ``code`` (see `ErrorCode`), ``message``, and the ``request_id`` it answers."""

    def __init__(self, code: str, message: str, request_id: str = "") -> None:
        super().__init__(f"[{code}] {message}")
        self.code, self.message, self.request_id = code, message, request_id


class Completion(msgspec.Struct, kw_only=True):
    """A whole generation."""

    request_id: str
    token_ids: list[int]
    text: str | None  # None when the server's model has no tokenizer
    finish_reason: str  # FinishReasons: stop, length, abort, slo, load_failed
    detail: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None  # server-side time to first token
    latency_s: float  # server-side time from receipt to Finished


def _generate_message(request_id: str, prompt, adapter, max_tokens, temperature, top_p, top_k, seed,
                      stop_token_ids, ignore_eos, stream) -> Generate:
    return Generate(v=VERSION, request_id=request_id, prompt=prompt if isinstance(prompt, str) else list(prompt),
                    adapter=adapter, sampling=Sampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed),
                    max_tokens=max_tokens, stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos, stream=stream)


class _Accumulator:
    """What a stream has received so far."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = []
        self.text: str | None = None
        self.finished: Finished | None = None

    def take(self, reply) -> TokenChunk | None:
        """Account ``reply``; the chunk to yield, or None once the stream is over (raises on Error)."""
        if isinstance(reply, TokenChunk):
            self.token_ids += reply.token_ids
            if reply.text is not None:
                self.text = (self.text or "") + reply.text
            return reply
        if isinstance(reply, Finished):
            self.finished = reply
            return None
        if isinstance(reply, Error):
            raise ServerError(reply.code, reply.message, reply.request_id)
        raise ServerError("malformed", f"unexpected {type(reply).__name__} for request {self.request_id!r}",
                          self.request_id)

    def completion(self) -> Completion:
        f = self.finished
        return Completion(request_id=self.request_id, token_ids=self.token_ids, text=self.text,
                          finish_reason=f.reason, detail=f.detail, prompt_tokens=f.prompt_tokens,
                          completion_tokens=f.completion_tokens, ttft_s=f.ttft_s, latency_s=f.latency_s)


def _expect(reply, kind):
    if isinstance(reply, Error):
        raise ServerError(reply.code, reply.message, reply.request_id)
    if not isinstance(reply, kind):
        raise ServerError("malformed", f"expected {kind.__name__}, got {type(reply).__name__}", reply.request_id)
    return reply


def _dealer(context: zmq.Context, address: str, heartbeat_s: float) -> zmq.Socket:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if heartbeat_s:
        ms = int(heartbeat_s * 1000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ms)
    sock.connect(address)
    return sock


# -- blocking ----------------------------------------------------------------------------------------


class _StreamView:
    """What both stream kinds show of what they received so far (``self._acc``: an `_Accumulator`)."""

    _acc: _Accumulator

    @property
    def finished(self) -> Finished | None:
        return self._acc.finished

    @property
    def token_ids(self) -> list[int]:
        return self._acc.token_ids

    @property
    def text(self) -> str | None:
        return self._acc.text


class Stream(_StreamView):
    """The replies to one Generate: iterate for `TokenChunk`s; ``finished`` holds the `Finished` at the end.

    Leaving a ``with`` block (or `close`) before the end aborts the request.
    """

    def __init__(self, client: Client, request_id: str) -> None:
        self._client = client
        self._acc = _Accumulator(request_id)
        self.request_id = request_id
        self._closed = False

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> TokenChunk:
        if self._closed:
            raise StopIteration
        try:
            chunk = self._acc.take(self._client._next(self.request_id))
        except ServerError:
            self._end()
            raise
        if chunk is None:
            self._end()
            raise StopIteration
        return chunk

    def completion(self) -> Completion:
        """Read to the end; the whole generation."""
        for _ in self:
            pass
        return self._acc.completion()

    def abort(self) -> None:
        """Ask the server to stop; the stream then ends with a Finished of reason "abort"."""
        if not self._closed:
            self._client.abort(self.request_id)

    def close(self) -> None:
        """Abort if still running and stop listening (replies still in flight are dropped)."""
        if not self._closed:
            self._client.abort(self.request_id)
            self._end()

    def _end(self) -> None:
        self._closed = True
        self._client._forget(self.request_id)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _RequestIds:
    """Request ids unique to this client: a random prefix and a counter."""

    def __init__(self) -> None:
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count()

    def new_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"


class Client(_RequestIds):
    def __init__(self, address: str = "tcp://127.0.0.1:5555", *, timeout: float | None = 60.0,
                 heartbeat_s: float = 5.0, context: zmq.Context | None = None) -> None:
        """Connect to ``address``.  ``timeout``: seconds to wait for any one reply (None = forever)."""
        self.address, self.timeout = address, timeout
        self._sock = _dealer(context or zmq.Context.instance(), address, heartbeat_s)
        super().__init__()
        self._inbox: dict[str, deque] = {}  # request id -> replies received and not yet read

    # -- generation ----------------------------------------------------------------------------------
    def generate(self, prompt: list[int] | str, *, adapter: str | None = None, max_tokens: int = 16,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop_token_ids=(), ignore_eos: bool = False, stream: bool = True,
                 request_id: str | None = None) -> Stream:
        """Send a Generate; iterate the returned `Stream` for its chunks (one chunk if ``stream=False``)."""
        rid = request_id or self.new_id()
        message = _generate_message(rid, prompt, adapter, max_tokens, temperature, top_p, top_k, seed,
                                    stop_token_ids, ignore_eos, stream)
        self._inbox[rid] = deque()
        self._sock.send(encode(message))
        return Stream(self, rid)

    def complete(self, prompt: list[int] | str, **kwargs) -> Completion:
        """The whole generation in one reply (arguments as for `generate`)."""
        kwargs.setdefault("stream", False)
        return self.generate(prompt, **kwargs).completion()

    def abort(self, request_id: str) -> None:
        """Ask the server to abort ``request_id``; its stream ends with reason "abort"."""
        self._sock.send(encode(Abort(v=VERSION, request_id=request_id)))

    # -- adapters and state ------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str) -> list[AdapterInfo]:
        """Register the PEFT directory ``path`` (on the server) as ``name``; the adapters afterwards."""
        rid = self.new_id()
        return _expect(self._call(LoadAdapter(v=VERSION, request_id=rid, name=name, path=path)),
                       AdapterList).adapters

    def unload_adapter(self, name: str) -> list[AdapterInfo]:
        rid = self.new_id()
        return _expect(self._call(UnloadAdapter(v=VERSION, request_id=rid, name=name)), AdapterList).adapters

    def list_adapters(self) -> list[AdapterInfo]:
        return _expect(self._call(ListAdapters(v=VERSION, request_id=self.new_id())), AdapterList).adapters

    def stats(self) -> Stats:
        return _expect(self._call(StatsRequest(v=VERSION, request_id=self.new_id())), Stats)

    def health(self) -> Health:
        return _expect(self._call(HealthRequest(v=VERSION, request_id=self.new_id())), Health)

    def close(self) -> None:
        self._sock.close(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- plumbing ------------------------------------------------------------------------------------
    def _call(self, message):
        rid = message.request_id
        self._inbox[rid] = deque()
        try:
            self._sock.send(encode(message))
            return self._next(rid)
        finally:
            self._forget(rid)

    def _forget(self, request_id: str) -> None:
        self._inbox.pop(request_id, None)

    def _next(self, request_id: str):
        """The next reply for ``request_id``, stashing replies to other requests on the way."""
        box = self._inbox[request_id]
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while not box:
            wait = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sock.poll(wait, zmq.POLLIN):
                raise TimeoutError(f"no reply for {request_id!r} from {self.address} in {self.timeout} s")
            self._drain(request_id)
        return box.popleft()

    def _drain(self, waiting: str) -> None:
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = decode_reply(frame)
            except ProtocolError as err:
                raise ServerError(err.code, err.message, err.request_id) from None
            box = self._inbox.get(reply.request_id)
            if box is not None:
                box.append(reply)
            elif isinstance(reply, Error) and not reply.request_id:  # about a frame it could not read
                self._inbox[waiting].append(reply)


# -- asyncio -----------------------------------------------------------------------------------------


class AsyncStream(_StreamView):
    """``async for chunk in stream``; sent when iteration starts; ``finished`` at the end."""

    def __init__(self, client: AsyncClient, message: Generate) -> None:
        self._client = client
        self._message = message
        self._acc = _Accumulator(message.request_id)
        self.request_id = message.request_id
        self._queue: asyncio.Queue | None = None
        self._closed = False

    async def start(self) -> AsyncStream:
        """Send the request now (iteration does it too)."""
        if self._queue is None:
            self._queue = await self._client._open(self._message)
        return self

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> TokenChunk:
        if self._closed:
            raise StopAsyncIteration
        await self.start()
        try:
            chunk = self._acc.take(await self._client._get(self._queue, self.request_id))
        except (ServerError, TimeoutError):
            self._end()
            raise
        if chunk is None:
            self._end()
            raise StopAsyncIteration
        return chunk

    async def completion(self) -> Completion:
        async for _ in self:
            pass
        return self._acc.completion()

    async def abort(self) -> None:
        if not self._closed and self._queue is not None:
            await self._client.abort(self.request_id)

    async def close(self) -> None:
        if not self._closed:
            if self._queue is not None:
                await self._client.abort(self.request_id)
            self._end()

    def _end(self) -> None:
        self._closed = True
        self._client._queues.pop(self.request_id, None)

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()


class AsyncClient(_RequestIds):
    def __init__(self, address: str = "tcp://127.0.0.1:5555", *, timeout: float | None = 60.0,
                 heartbeat_s: float = 5.0, context: zmq.asyncio.Context | None = None) -> None:
        self.address, self.timeout = address, timeout
        self._sock = _dealer(context or zmq.asyncio.Context.instance(), address, heartbeat_s)
        self._queues: dict[str, asyncio.Queue] = {}
        super().__init__()
        self._reader: asyncio.Task | None = None

    def generate(self, prompt: list[int] | str, *, adapter: str | None = None, max_tokens: int = 16,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop_token_ids=(), ignore_eos: bool = False, stream: bool = True,
                 request_id: str | None = None) -> AsyncStream:
        """An `AsyncStream` of the request's chunks (sent when iteration starts, or on ``await .start()``)."""
        rid = request_id or self.new_id()
        return AsyncStream(self, _generate_message(rid, prompt, adapter, max_tokens, temperature, top_p, top_k,
                                                   seed, stop_token_ids, ignore_eos, stream))

    async def complete(self, prompt: list[int] | str, **kwargs) -> Completion:
        kwargs.setdefault("stream", False)
        return await self.generate(prompt, **kwargs).completion()

    async def abort(self, request_id: str) -> None:
        await self._sock.send(encode(Abort(v=VERSION, request_id=request_id)))

    async def load_adapter(self, name: str, path: str) -> list[AdapterInfo]:
        message = LoadAdapter(v=VERSION, request_id=self.new_id(), name=name, path=path)
        return _expect(await self._call(message), AdapterList).adapters

    async def unload_adapter(self, name: str) -> list[AdapterInfo]:
        message = UnloadAdapter(v=VERSION, request_id=self.new_id(), name=name)
        return _expect(await self._call(message), AdapterList).adapters

    async def list_adapters(self) -> list[AdapterInfo]:
        return _expect(await self._call(ListAdapters(v=VERSION, request_id=self.new_id())), AdapterList).adapters

    async def stats(self) -> Stats:
        return _expect(await self._call(StatsRequest(v=VERSION, request_id=self.new_id())), Stats)

    async def health(self) -> Health:
        return _expect(await self._call(HealthRequest(v=VERSION, request_id=self.new_id())), Health)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
            self._reader = None
        self._sock.close(linger=0)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- plumbing ------------------------------------------------------------------------------------
    async def _open(self, message) -> asyncio.Queue:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        queue = self._queues[message.request_id] = asyncio.Queue()
        await self._sock.send(encode(message))
        return queue

    async def _get(self, queue: asyncio.Queue, request_id: str):
        try:
            return await asyncio.wait_for(queue.get(), self.timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no reply for {request_id!r} from {self.address} in {self.timeout} s") from None

    async def _call(self, message):
        queue = await self._open(message)
        try:
            return await self._get(queue, message.request_id)
        finally:
            self._queues.pop(message.request_id, None)

    async def _read_loop(self) -> None:
        while True:
            frame = await self._sock.recv()
            try:
                reply = decode_reply(frame)
            except ProtocolError as err:
                reply = Error(v=VERSION, request_id=err.request_id, code=err.code, message=err.message)
            queue = self._queues.get(reply.request_id)
            if queue is not None:
                queue.put_nowait(reply)
            elif isinstance(reply, Error) and not reply.request_id:
                for queue in self._queues.values():  # about a frame it could not read: tell every waiter
                    queue.put_nowait(reply)
