"""Frontend overhead of `unipage-serve` on CPU: streamed chunks per second and added latency.

The server under test is the real `unipage.server.Server` (ROUTER socket,
engine loop, outboxes, encoding) over a *trivial model*: a backend that
computes nothing and gives every live request one token per step.  What is
measured is therefore the frontend alone — socket I/O, msgspec, the loop's
bookkeeping — plus the client on the other end of loopback TCP.

    python benchmarks/server.py [--out benchmarks/results/server-cpu.jsonl] [--quick]

Rows (JSON lines, the CPU benchmarks' record format):

- ``zmq_floor``: round trips through a bare ROUTER that echoes each frame
  (Python, pyzmq): the latency floor of Python + ZeroMQ on this machine.
- ``stream_throughput``: S concurrent streams of T tokens each from one
  client process; chunks/s = S·T / wall time, client-observed.  Once with raw
  DEALER sockets + msgspec, once through `unipage.server.Client` streams.
- ``added_latency``: Generate requests of one token sent open-loop at a fixed
  rate; client-observed latency from send to Finished (the whole frontend
  round trip, the trivial model's step included) and the server's own
  ``latency_s``.  Targets: ≥ 20,000 chunks/s; p99 added latency ≤ 1 ms at
  1,000 requests/s.

Two processes (server and client) share the machine's cores; on a shared
2-core machine the figures vary from run to run, the tail latencies most (a
descheduled process adds milliseconds; ``max_send_lag_ms`` shows how late the
client itself was), so the latency rows are repeated.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import msgspec
import zmq
from unipage.server import Client
from unipage.server.backend import BackendError, Output
from unipage.server.protocol import ErrorCode

SEED = 0
TARGET_CHUNKS_PER_S = 20_000
TARGET_P99_MS = 1.0


def emit(record: dict, out) -> None:
    record = {"bench": "server", "device": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "python": sys.version.split()[0], "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(),
              "msgspec": msgspec.__version__, "seed": SEED, "unix_time": round(time.time(), 3), **record}
    print(json.dumps(record), file=out, flush=True)


class TrivialBackend:
    """A model that computes nothing: each step, one token for every live request."""

    model_name, device, tokenizer = "trivial", "cpu", None

    def __init__(self) -> None:
        self.live: dict[str, list[int]] = {}  # id -> [tokens left, next token]

    def submit(self, request_id: str, message) -> int:
        if isinstance(message.prompt, str) or not message.prompt:
            raise BackendError(ErrorCode.INVALID_REQUEST, "token ids only")
        self.live[request_id] = [message.max_tokens, len(message.prompt)]
        return len(message.prompt)

    def abort(self, request_id: str) -> bool:
        return self.live.pop(request_id, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def step(self) -> list[Output]:
        outputs = []
        for rid, state in list(self.live.items()):
            state[0] -= 1
            state[1] += 1
            done = state[0] == 0
            if done:
                del self.live[rid]
            outputs.append(Output(rid, [state[1] % 1000], "length" if done else None))
        return outputs

    def inspect_adapter(self, path, roots):
        raise BackendError(ErrorCode.ADAPTER_INVALID, "the trivial model takes no adapters")

    def register_adapter(self, name, info) -> None:
        raise BackendError(ErrorCode.ADAPTER_INVALID, "the trivial model takes no adapters")

    def remove_adapter(self, name) -> None:
        raise BackendError(ErrorCode.UNKNOWN_ADAPTER, f"unknown adapter {name!r}")

    def has_adapter(self, name) -> bool:
        return False

    def adapters(self) -> list:
        return []

    def stats(self) -> dict:
        return {"pool_pages": {}, "total_pages": 0, "resident_adapters": [], "registered_adapters": 0,
                "waiting": 0, "running": len(self.live), "steps": 0}


# -- child processes -----------------------------------------------------------------------------------


def serve_trivial(ready_file: str) -> None:
    from unipage.server.config import ServerConfig
    from unipage.server.server import Server

    server = Server(TrivialBackend(), ServerConfig(bind="tcp://127.0.0.1:*", max_active_requests=100_000))
    _ready(ready_file, server.endpoint)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: server.request_stop())
    server.serve_forever()


def serve_echo(ready_file: str) -> None:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:*")
    _ready(ready_file, sock.getsockopt_string(zmq.LAST_ENDPOINT))
    while True:
        sock.send_multipart(sock.recv_multipart())


def _ready(path: str, endpoint: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(endpoint)
    os.replace(path + ".tmp", path)


class Child:
    def __init__(self, mode: str) -> None:
        self.ready = os.path.join(tempfile.mkdtemp(prefix="unipage-bench-"), "endpoint")
        self.proc = subprocess.Popen([sys.executable, __file__, f"--{mode}", self.ready])
        while not os.path.exists(self.ready):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{mode} server exited with {self.proc.returncode}")
            time.sleep(0.02)
        with open(self.ready) as f:
            self.endpoint = f.read()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


# -- measurements ----------------------------------------------------------------------------------------


def percentiles(values: list[float]) -> dict:
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]
    return {"p50_ms": round(pick(0.5) * 1e3, 3), "p90_ms": round(pick(0.9) * 1e3, 3),
            "p99_ms": round(pick(0.99) * 1e3, 3), "max_ms": round(values[-1] * 1e3, 3),
            "mean_ms": round(statistics.fmean(values) * 1e3, 3)}


def dealer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(endpoint)
    return sock


def generate(rid: str, max_tokens: int) -> bytes:
    return msgspec.msgpack.encode({"type": "generate", "v": 1, "request_id": rid, "prompt": [1, 2, 3],
                                   "max_tokens": max_tokens, "sampling": {"temperature": 0.0}})


class Terminal(msgspec.Struct):
    type: str
    request_id: str
    latency_s: float = 0.0


def open_loop(endpoint: str, rate: float, count: int, payload, is_done) -> tuple[list[float], list[bytes], float]:
    """Send ``count`` frames at ``rate``/s (spinning, one socket); the send-to-done latency of each."""
    sock = dealer(endpoint)
    sent: dict[str, float] = {}
    latencies, frames = [], []
    start = time.perf_counter()
    lag = 0.0
    i = 0
    while i < count or sent:
        now = time.perf_counter()
        if i < count and now >= start + i / rate:
            lag = max(lag, now - (start + i / rate))
            rid = f"r{i}"
            sent[rid] = time.perf_counter()
            sock.send(payload(rid))
            i += 1
            continue
        while sock.poll(0 if i < count else 1000):
            frame = sock.recv()
            now = time.perf_counter()
            rid = is_done(frame)
            if rid is not None:
                latencies.append(now - sent.pop(rid))
                frames.append(frame)
            if i < count:
                break
        else:
            if i >= count and sent:
                raise RuntimeError(f"{len(sent)} requests unanswered")
    sock.close()
    return latencies, frames, lag


def bench_zmq_floor(rate: float, count: int) -> dict:
    echo = Child("echo")
    try:
        latencies, _, lag = open_loop(echo.endpoint, rate, count, lambda rid: rid.encode(), lambda f: f.decode())
    finally:
        echo.stop()
    return {"row": "zmq_floor", "rate_per_s": rate, "requests": count, "max_send_lag_ms": round(lag * 1e3, 3),
            **percentiles(latencies)}


def bench_added_latency(endpoint: str, rate: float, count: int) -> dict:
    decoder = msgspec.msgpack.Decoder(Terminal)

    def is_done(frame: bytes) -> str | None:
        reply = decoder.decode(frame)
        if reply.type == "error":
            raise RuntimeError(frame)
        return reply.request_id if reply.type == "finished" else None

    latencies, frames, lag = open_loop(endpoint, rate, count, lambda rid: generate(rid, 1), is_done)
    server_side = [decoder.decode(f).latency_s for f in frames]
    server = percentiles(server_side)
    return {"row": "added_latency", "model": "trivial", "rate_per_s": rate, "requests": count, "max_tokens": 1,
            "stream": True, "max_send_lag_ms": round(lag * 1e3, 3), **percentiles(latencies),
            **{f"server_{k}": v for k, v in server.items()}, "target_p99_ms": TARGET_P99_MS}


def bench_stream_raw(endpoint: str, streams: int, tokens: int, sockets: int) -> dict:
    socks = [dealer(endpoint) for _ in range(sockets)]
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    decoder = msgspec.msgpack.Decoder(Terminal)
    chunks = finished = 0
    start = time.perf_counter()
    for i in range(streams):
        socks[i % sockets].send(generate(f"s{i}", tokens))
    while finished < streams:
        for sock, _ in poller.poll(10_000):
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                kind = decoder.decode(frame).type
                chunks += kind == "token_chunk"
                finished += kind == "finished"
                if kind == "error":
                    raise RuntimeError(frame)
    wall = time.perf_counter() - start
    for sock in socks:
        sock.close()
    assert chunks == streams * tokens, (chunks, streams * tokens)
    return {"row": "stream_throughput", "client": "raw zmq + msgspec", "model": "trivial", "streams": streams,
            "tokens_per_stream": tokens, "client_sockets": sockets, "chunks": chunks, "wall_s": round(wall, 3),
            "chunks_per_s": round(chunks / wall), "target_chunks_per_s": TARGET_CHUNKS_PER_S}


def bench_stream_client(endpoint: str, streams: int, tokens: int) -> dict:
    with Client(endpoint, timeout=60) as client:
        start = time.perf_counter()
        live = [client.generate([1, 2, 3], max_tokens=tokens, temperature=0) for _ in range(streams)]
        chunks = 0
        while live:
            for stream in list(live):
                chunk = next(stream, None)
                if chunk is None:
                    live.remove(stream)
                else:
                    chunks += 1
        wall = time.perf_counter() - start
    assert chunks == streams * tokens
    return {"row": "stream_throughput", "client": "unipage.server.Client", "model": "trivial", "streams": streams,
            "tokens_per_stream": tokens, "client_sockets": 1, "chunks": chunks, "wall_s": round(wall, 3),
            "chunks_per_s": round(chunks / wall), "target_chunks_per_s": TARGET_CHUNKS_PER_S}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="append the records to this file (default: stdout)")
    parser.add_argument("--quick", action="store_true", help="a short run (smoke test)")
    parser.add_argument("--serve-trivial", metavar="READY_FILE", help=argparse.SUPPRESS)
    parser.add_argument("--echo", metavar="READY_FILE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_trivial:
        return serve_trivial(args.serve_trivial)
    if args.echo:
        return serve_echo(args.echo)
    scale = 0.1 if args.quick else 1.0
    out = open(args.out, "a") if args.out else sys.stdout  # noqa: SIM115 - closed below
    try:
        for repeat in range(2):
            emit({**bench_zmq_floor(1000, int(5000 * scale)), "repeat": repeat}, out)
        server = Child("serve-trivial")
        try:
            for streams, tokens, sockets in ((64, 1000, 1), (256, 250, 4)):
                emit(bench_stream_raw(server.endpoint, streams, int(tokens * scale), sockets), out)
            emit(bench_stream_client(server.endpoint, 64, int(500 * scale)), out)
            for rate, repeat in ((1000, 0), (1000, 1), (1000, 2), (5000, 0)):
                emit({**bench_added_latency(server.endpoint, rate, int(5 * rate * scale)), "repeat": repeat}, out)
        finally:
            server.stop()
    finally:
        if out is not sys.stdout:
            out.close()


if __name__ == "__main__":
    main()
