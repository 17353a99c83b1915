"""`Server`: one ROUTER socket and the engine loop, in one thread that never blocks on the network.

    loop:  poll the socket (wait only while the engine is idle)
           read every queued frame (non-blocking): decode, validate, act, reply
           finish adapter inspections done by the worker thread
           engine.step() -> TokenChunk / Finished replies
           retry replies a slow client's socket did not take

Sends are non-blocking with ``ROUTER_MANDATORY``: a reply the client's pipe
cannot take (it reads too slowly) waits in that client's bounded outbox, and
when the outbox overflows the client's requests are aborted and answered with
``slow_reader``; a reply to a client that has disconnected raises
``EHOSTUNREACH`` and its requests are aborted, their pages freed.  Nothing a
client sends can stop the loop: every bad frame is answered with an Error to
that client alone, and a request that raises changes nothing.

A live request is keyed by a server-made engine id; the client's own id is
unique per client only (``ClientState.live``).
"""

from __future__ import annotations

import concurrent.futures
import errno
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import zmq
from unipage.server.backend import Backend, BackendError
from unipage.server.config import ServerConfig
from unipage.server.detokenize import IncrementalDetokenizer
from unipage.server.protocol import (
    VERSION,
    Abort,
    AdapterList,
    Error,
    ErrorCode,
    Finished,
    FinishReasons,
    Generate,
    Health,
    HealthRequest,
    ListAdapters,
    LoadAdapter,
    ProtocolError,
    Stats,
    StatsRequest,
    TokenChunk,
    UnloadAdapter,
    decode_request,
    encode,
    peek_request_id,
)

log = logging.getLogger(__name__)

IDLE_POLL_MS = 50  # poll timeout with nothing to do: how soon a stop request is noticed
BUSY_POLL_MS = 2  # poll timeout while outboxes or adapter inspections wait
READ_BATCH = 512  # frames read per loop iteration at most, so a flood cannot starve the engine
TOKENS_WINDOW_S = 10.0  # Stats.tokens_per_s is measured over this window


@dataclass(slots=True, eq=False)
class ClientState:
    identity: bytes
    live: dict[str, str] = field(default_factory=dict)  # client request id -> engine id
    outbox: deque = field(default_factory=deque)  # (client request id, encoded reply) the socket did not take


@dataclass(slots=True, eq=False)
class Live:
    """A Generate being served."""

    engine_id: str
    client: ClientState
    request_id: str
    stream: bool
    prompt_tokens: int
    arrival: float
    detok: IncrementalDetokenizer | None
    first_token: float | None = None
    completion_tokens: int = 0
    held: list[int] = field(default_factory=list)  # tokens not yet sent (stream=False)


@dataclass(slots=True, eq=False)
class PendingLoad:
    client: ClientState
    request_id: str
    name: str
    future: concurrent.futures.Future


class Server:
    def __init__(self, backend: Backend, config: ServerConfig | None = None,
                 context: zmq.Context | None = None) -> None:
        self.backend = backend
        self.config = config = config or ServerConfig()
        self.context = context or zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self._configure(self.socket, config)
        self.socket.bind(config.bind)
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.clients: dict[bytes, ClientState] = {}
        self.live: dict[str, Live] = {}  # engine id -> request
        self.loads: list[PendingLoad] = []
        self._workers = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="unipage-adapter-inspect")
        self._ids = itertools.count()
        self._stopping = False
        self._deadline: float | None = None
        self._started = time.monotonic()
        self._window: deque = deque()  # (time, tokens) per step that produced tokens
        self._window_tokens = 0
        self.counters = {"generated_tokens": 0, "finished": 0, "errors": 0, "steps": 0}
        self._handlers = {Generate: self._generate, Abort: self._abort, LoadAdapter: self._load_adapter,
                          UnloadAdapter: self._unload_adapter, ListAdapters: self._list_adapters,
                          StatsRequest: self._stats, HealthRequest: self._health}

    @staticmethod
    def _configure(sock: zmq.Socket, config: ServerConfig) -> None:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable -> EHOSTUNREACH, full pipe -> EAGAIN
        sock.setsockopt(zmq.SNDHWM, config.sndhwm)
        sock.setsockopt(zmq.RCVHWM, config.rcvhwm)
        sock.setsockopt(zmq.LINGER, 1000)
        # A hard cap far above the protocol's limit: frames between the two get a "too_large" reply;
        # libzmq drops the connection of a peer that sends more than the cap.
        sock.setsockopt(zmq.MAXMSGSIZE, max(4 * config.max_message_bytes, config.max_message_bytes + (1 << 20)))
        if config.sndbuf:
            sock.setsockopt(zmq.SNDBUF, config.sndbuf)
        if config.heartbeat_s:
            ms = int(config.heartbeat_s * 1000)
            sock.setsockopt(zmq.HEARTBEAT_IVL, ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ms)
            sock.setsockopt(zmq.HEARTBEAT_TTL, 3 * ms)

    # -- the loop ----------------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Begin a graceful shutdown (safe to call from a signal handler)."""
        self._stopping = True

    @property
    def stopping(self) -> bool:
        return self._stopping

    def serve_forever(self) -> None:
        """Serve until `request_stop`, then drain: finish or abort what is live and answer each."""
        try:
            while not (self._stopping and self._drained()):
                self.run_once()
        finally:
            self._shutdown()

    def run_once(self) -> None:
        busy = self.backend.has_unfinished()
        if self._stopping and self._deadline is None:
            self._deadline = time.monotonic() + self.config.drain_timeout_s
            log.info("draining: %d live requests, up to %.1f s", len(self.live), self.config.drain_timeout_s)
        if self._deadline is not None and time.monotonic() >= self._deadline and self.live:
            self._abort_all("server shutting down: drain timeout")
        timeout = 0 if busy else BUSY_POLL_MS if (self.loads or self._backlogged() or self._stopping) \
            else IDLE_POLL_MS
        if self.socket.poll(timeout, zmq.POLLIN):
            self._read()
        if self.loads:
            self._finish_loads()
        if self.backend.has_unfinished():
            self._step()
        if self._backlogged():
            self._flush()

    def _drained(self) -> bool:
        return not self.live and not self.loads and not self.backend.has_unfinished()

    def _shutdown(self) -> None:
        self._abort_all("server shutting down")
        deadline = time.monotonic() + 1.0
        while self._backlogged() and time.monotonic() < deadline:
            self._flush()
            time.sleep(0.001)
        self._workers.shutdown(wait=True, cancel_futures=True)
        self.socket.close(linger=1000)
        log.info("stopped")

    # -- reading -----------------------------------------------------------------------------------
    def _read(self) -> None:
        sock = self.socket
        for _ in range(READ_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            client = self.clients.get(frames[0])
            if client is None:
                client = self.clients[frames[0]] = ClientState(frames[0])
            self._handle(client, frames[1:])
            if not client.live and not client.outbox:
                self.clients.pop(client.identity, None)

    def _handle(self, client: ClientState, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self._error(client, "", ErrorCode.MALFORMED, f"a message is exactly one frame, got {len(frames)}")
            return
        frame = frames[0]
        if len(frame) > self.config.max_message_bytes:
            self._error(client, peek_request_id(frame), ErrorCode.TOO_LARGE, f"message of {len(frame)} bytes exceeds the server's "
                        f"limit of {self.config.max_message_bytes} bytes")
            return
        try:
            message = decode_request(frame)
        except ProtocolError as err:
            self._error(client, err.request_id, err.code, err.message)
            return
        try:
            self._handlers[type(message)](client, message)
        except Exception as err:  # a server bug: answer it, keep serving the others
            log.exception("handling %s from client %s", type(message).__name__, client.identity.hex())
            self._error(client, message.request_id, ErrorCode.INTERNAL, f"{type(err).__name__}: {err}")

    # -- requests ----------------------------------------------------------------------------------
    def _generate(self, client: ClientState, msg: Generate) -> None:
        rid = msg.request_id
        if self._stopping:
            return self._error(client, rid, ErrorCode.SHUTTING_DOWN, "the server is shutting down")
        if rid in client.live:
            return self._error(client, rid, ErrorCode.DUPLICATE_REQUEST, f"request id {rid!r} is live already")
        if len(self.live) >= self.config.max_active_requests:
            return self._error(client, rid, ErrorCode.OVERLOADED, f"the server holds "
                               f"{self.config.max_active_requests} requests; retry later")
        engine_id = f"{next(self._ids)}"
        try:
            prompt_tokens = self.backend.submit(engine_id, msg)
        except BackendError as err:
            return self._error(client, rid, err.code, err.message)
        tokenizer = self.backend.tokenizer
        detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.live[engine_id] = Live(engine_id, client, rid, msg.stream, prompt_tokens, time.monotonic(), detok)
        client.live[rid] = engine_id

    def _abort(self, client: ClientState, msg: Abort) -> None:
        engine_id = client.live.get(msg.request_id)
        if engine_id is None:
            return self._error(client, msg.request_id, ErrorCode.UNKNOWN_REQUEST,
                               f"no live request {msg.request_id!r} from this client")
        self.backend.abort(engine_id)
        self._finish(self.live[engine_id], FinishReasons.ABORT, "aborted by the client")

    def _load_adapter(self, client: ClientState, msg: LoadAdapter) -> None:
        rid, name = msg.request_id, msg.name
        if self._stopping:
            return self._error(client, rid, ErrorCode.SHUTTING_DOWN, "the server is shutting down")
        if not self.config.adapter_roots:
            return self._error(client, rid, ErrorCode.ADAPTER_PATH, "this server was started without "
                               "--adapter-root: loading adapters at run time is off")
        if self.backend.has_adapter(name) or any(p.name == name for p in self.loads):
            return self._error(client, rid, ErrorCode.ADAPTER_EXISTS, f"adapter {name!r} is already registered")
        if "/" in name:
            return self._error(client, rid, ErrorCode.INVALID_REQUEST, f"adapter name {name!r} contains '/'")
        future = self._workers.submit(self.backend.inspect_adapter, msg.path, self.config.adapter_roots)
        self.loads.append(PendingLoad(client, rid, name, future))

    def _finish_loads(self) -> None:
        done = [p for p in self.loads if p.future.done()]
        for load in done:
            self.loads.remove(load)
            try:
                self.backend.register_adapter(load.name, load.future.result())
            except BackendError as err:
                self._error(load.client, load.request_id, err.code, err.message)
                continue
            except Exception as err:  # a fault in the inspection: report it, keep serving
                log.exception("inspecting adapter %r", load.name)
                self._error(load.client, load.request_id, ErrorCode.INTERNAL, f"{type(err).__name__}: {err}")
                continue
            log.info("adapter %r registered", load.name)
            self._send(load.client, load.request_id,
                       AdapterList(v=VERSION, request_id=load.request_id, adapters=self.backend.adapters()))

    def _unload_adapter(self, client: ClientState, msg: UnloadAdapter) -> None:
        try:
            self.backend.remove_adapter(msg.name)
        except BackendError as err:
            return self._error(client, msg.request_id, err.code, err.message)
        log.info("adapter %r unregistered", msg.name)
        self._list_adapters(client, msg)

    def _list_adapters(self, client: ClientState, msg) -> None:
        self._send(client, msg.request_id,
                   AdapterList(v=VERSION, request_id=msg.request_id, adapters=self.backend.adapters()))

    def _stats(self, client: ClientState, msg: StatsRequest) -> None:
        now = time.monotonic()
        self._trim_window(now)
        span = min(TOKENS_WINDOW_S, now - self._started)
        stats = Stats(v=VERSION, request_id=msg.request_id, **self.backend.stats(), active=len(self.live),
                      clients=len(self.clients),
                      tokens_per_s=self._window_tokens / span if span > 0 else 0.0, window_s=TOKENS_WINDOW_S,
                      generated_tokens=self.counters["generated_tokens"], finished=self.counters["finished"],
                      errors=self.counters["errors"], uptime_s=now - self._started)
        self._send(client, msg.request_id, stats)

    def _health(self, client: ClientState, msg: HealthRequest) -> None:
        self._send(client, msg.request_id, Health(
            v=VERSION, request_id=msg.request_id, status="draining" if self._stopping else "ok",
            model=self.backend.model_name, device=self.backend.device,
            has_tokenizer=self.backend.tokenizer is not None, uptime_s=time.monotonic() - self._started))

    # -- the engine --------------------------------------------------------------------------------
    def _step(self) -> None:
        try:
            outputs = self.backend.step()
        except Exception as err:  # an engine fault: end what is live with an error, keep serving
            log.exception("engine step failed")
            self._fail_all(f"engine step failed: {type(err).__name__}: {err}")
            return
        self.counters["steps"] += 1
        now = time.monotonic()
        produced = 0
        live = self.live
        for out in outputs:
            req = live.get(out.request_id)
            if req is None:
                continue
            ids = out.new_token_ids
            if ids:
                produced += len(ids)
                req.completion_tokens += len(ids)
                if req.first_token is None:
                    req.first_token = now
                if req.stream:
                    text = req.detok.push(ids) if req.detok is not None else None
                    self._send(req.client, req.request_id,
                               TokenChunk(v=VERSION, request_id=req.request_id, token_ids=ids, text=text))
                else:
                    req.held.extend(ids)
            if out.finish_reason is not None and req.engine_id in live:
                self._finish(req, out.finish_reason, out.detail)
        if produced:
            self.counters["generated_tokens"] += produced
            self._window.append((now, produced))
            self._window_tokens += produced

    def _trim_window(self, now: float) -> None:
        while self._window and self._window[0][0] < now - TOKENS_WINDOW_S:
            self._window_tokens -= self._window.popleft()[1]

    def _finish(self, req: Live, reason: str, detail: str) -> None:
        """Send the rest of ``req``'s output and its Finished; forget it."""
        self._forget(req)
        rid = req.request_id
        if req.stream:
            rest = req.detok.flush() if req.detok is not None else ""
            if rest:
                self._send(req.client, rid, TokenChunk(v=VERSION, request_id=rid, token_ids=[], text=rest))
        elif req.held:
            text = None
            if req.detok is not None:
                text = req.detok.push(req.held) + req.detok.flush()
            self._send(req.client, rid, TokenChunk(v=VERSION, request_id=rid, token_ids=req.held, text=text))
        now = time.monotonic()
        self.counters["finished"] += 1
        self._send(req.client, rid, Finished(
            v=VERSION, request_id=rid, reason=reason, detail=detail, prompt_tokens=req.prompt_tokens,
            completion_tokens=req.completion_tokens,
            ttft_s=None if req.first_token is None else req.first_token - req.arrival, latency_s=now - req.arrival))

    def _forget(self, req: Live) -> None:
        self.live.pop(req.engine_id, None)
        client = req.client
        client.live.pop(req.request_id, None)
        if not client.live and not client.outbox and self.clients.get(client.identity) is client:
            del self.clients[client.identity]

    def _abort_all(self, detail: str) -> None:
        for req in list(self.live.values()):
            self.backend.abort(req.engine_id)
            self._finish(req, FinishReasons.ABORT, detail)

    def _fail_all(self, message: str) -> None:
        for req in list(self.live.values()):
            try:
                self.backend.abort(req.engine_id)
            except Exception:  # the engine is already broken; the reply matters more
                log.exception("abort after a failed step")
            self._forget(req)
            self._error(req.client, req.request_id, ErrorCode.INTERNAL, message)

    # -- sending -----------------------------------------------------------------------------------
    def _error(self, client: ClientState, request_id: str, code: str, message: str) -> None:
        self.counters["errors"] += 1
        log.debug("error %s to %s (%s): %s", code, client.identity.hex(), request_id, message)
        self._send(client, request_id, Error(v=VERSION, request_id=request_id, code=code, message=message))

    def _send(self, client: ClientState, request_id: str, message) -> None:
        payload = encode(message)
        if client.outbox:  # keep the order: behind what is already waiting
            client.outbox.append((request_id, payload))
            if len(client.outbox) > self.config.client_backlog:
                self._drop_slow(client)
            return
        try:
            self.socket.send_multipart((client.identity, payload), zmq.NOBLOCK)
        except zmq.Again:
            client = self.clients.setdefault(client.identity, client)  # the flush walks self.clients
            client.outbox.append((request_id, payload))
        except zmq.ZMQError as err:
            if err.errno != errno.EHOSTUNREACH:
                raise
            self._client_gone(client)

    def _backlogged(self) -> bool:
        return any(c.outbox for c in self.clients.values())

    def _flush(self) -> None:
        for client in [c for c in self.clients.values() if c.outbox]:
            outbox = client.outbox
            try:
                while outbox:
                    self.socket.send_multipart((client.identity, outbox[0][1]), zmq.NOBLOCK)
                    outbox.popleft()
            except zmq.Again:
                continue
            except zmq.ZMQError as err:
                if err.errno != errno.EHOSTUNREACH:
                    raise
                self._client_gone(client)
            if not client.live and not client.outbox:
                self.clients.pop(client.identity, None)

    def _drop_slow(self, client: ClientState) -> None:
        """The client's outbox overflowed: abort its requests and queue their slow_reader Errors; of the replies
        of its requests that ended before, keep the newest within the backlog and every final one (`_trim`)."""
        dropped = set(client.live)
        for rid in list(dropped):
            req = self.live[client.live[rid]]
            self.backend.abort(req.engine_id)
            self._forget(req)
        log.warning("client %s reads too slowly: %d requests dropped", client.identity.hex(), len(dropped))
        kept = [item for item in client.outbox if item[0] not in dropped]  # of requests that ended before
        limit = self.config.client_backlog
        client.outbox = deque(_trim(kept, len(kept) + len(dropped) - limit))
        for rid in dropped:
            self.counters["errors"] += 1
            error = Error(v=VERSION, request_id=rid, code=ErrorCode.SLOW_READER,
                          message=f"replies were not read fast enough (more than {limit} queued): request dropped")
            client.outbox.append((rid, encode(error)))

    def _client_gone(self, client: ClientState) -> None:
        """The client disconnected: abort its requests (freeing their pages) and forget it."""
        for engine_id in list(client.live.values()):
            self.backend.abort(engine_id)
            self._forget(self.live[engine_id])
        client.outbox.clear()
        self.clients.pop(client.identity, None)
        log.info("client %s disconnected; its requests were aborted", client.identity.hex())


def _trim(replies: list, excess: int) -> list:
    """``replies`` (``(request id, payload)``, of requests that have ended, oldest first) less up to
    ``excess`` of the oldest that are not their request's last: a request's last reply is its final one
    (finished, or an error such as an earlier slow_reader drop's), which the client must still get."""
    last = {rid: index for index, (rid, _) in enumerate(replies)}
    out = []
    for index, item in enumerate(replies):
        if excess > 0 and last[item[0]] != index:
            excess -= 1
        else:
            out.append(item)
    return out
