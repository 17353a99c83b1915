"""`unipage-serve` under pressure and at the end: a slow reader, graceful shutdown, the drain timeout.

Each server here runs with its own limits: small send queues and backlog (so a
client that does not read overflows them quickly) and long generations (so
requests are live when the signal comes).  The last tests run `unipage-serve`'s
``main`` in this process, to see its engine's storage closed once it has stopped.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
import test_server_support as ss
from test_server_support import pack, raw_socket, recv
from unipage.server import Client, ErrorCode, ServerError

LONG = ("--max-model-len", "256", "--num-pages", "512")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ss.tiny_model(tmp_path_factory.mktemp("shutdown-model"))


@pytest.fixture(scope="module")
def limited(tiny, tmp_path_factory):
    """A server with tiny send queues and backlog, and no drain time."""
    proc = ss.ServerProcess(tiny, tmp_path_factory.mktemp("limited"), *LONG, "--sndhwm", "8",
                            "--client-backlog", "16", "--sndbuf", "4096", "--drain-timeout-s", "0")
    yield proc
    assert proc.stop() == 0, proc.log()


def test_a_slow_reader_loses_its_requests_and_stalls_no_one(limited):
    count = 32
    slow = raw_socket(limited.endpoint, RCVHWM=2, RCVBUF=2048)
    try:
        for i in range(count):
            slow.send(pack(type="generate", request_id=f"s{i}", prompt=[5, 6, i + 7], max_tokens=200,
                           ignore_eos=True))
        with Client(limited.endpoint, timeout=30) as other:
            start = time.monotonic()
            done = other.complete([9, 9, 9], adapter="qv-r4", max_tokens=20, temperature=0, ignore_eos=True)
            assert done.completion_tokens == 20
            assert time.monotonic() - start < 20
            deadline = time.monotonic() + 30
            while (stats := other.stats()).active and time.monotonic() < deadline:
                time.sleep(0.05)
            assert stats.active == 0 and stats.running == 0 and stats.pool_pages["kv"] == 0
            assert stats.errors >= count
        terminal = {}
        while len(terminal) < count:  # now read: some chunks, then one slow_reader error per request
            reply = recv(slow)
            if reply["type"] != "token_chunk":
                assert reply["request_id"] not in terminal
                terminal[reply["request_id"]] = reply
        assert sorted(terminal) == sorted(f"s{i}" for i in range(count))
        assert {(r["type"], r["code"]) for r in terminal.values()} == {("error", ErrorCode.SLOW_READER)}
        assert not slow.poll(300)
    finally:
        slow.close()


def test_a_second_overflow_keeps_the_first_drops_errors():
    """A slow reader overflows twice (requests it sent meanwhile became live, and it still reads nothing): the
    slow_reader errors of the first drop stay queued beside the second's, so every request gets its final
    reply; older chunks of requests that ended go first when the backlog is over."""
    from unipage.server.config import ServerConfig
    from unipage.server.protocol import VERSION, Error, TokenChunk, decode_reply, encode
    from unipage.server.server import ClientState, Live, Server

    server = Server(type("Backend", (), {"abort": lambda self, engine_id: None})(),
                    ServerConfig(bind="tcp://127.0.0.1:*", client_backlog=4))
    try:
        client = server.clients[b"slow"] = ClientState(b"slow")

        def overflow(rids):
            for rid in rids:
                req = Live(f"e-{rid}", client, rid, True, 3, 0.0, None)
                server.live[req.engine_id], client.live[rid] = req, req.engine_id
            client.outbox.extend((rid, encode(TokenChunk(v=VERSION, request_id=rid, token_ids=[1], text="x")))
                                 for rid in rids + rids[:2])
            server._drop_slow(client)

        chunk = encode(TokenChunk(v=VERSION, request_id="z", token_ids=[1], text="x"))
        final = encode(Error(v=VERSION, request_id="z", code=ErrorCode.INVALID_REQUEST, message="it ended"))
        client.outbox.extend([("z", chunk), ("z", chunk), ("z", final)])  # a request that ended before
        overflow(["a", "b", "c"])
        overflow(["d", "e", "f"])
        replies = [decode_reply(payload) for _, payload in client.outbox]
        assert sorted(r.request_id for r in replies) == ["a", "b", "c", "d", "e", "f", "z"]  # no chunk of z left
        assert {(type(r).__name__, r.code) for r in replies} == {("Error", ErrorCode.SLOW_READER),
                                                                   ("Error", ErrorCode.INVALID_REQUEST)}
        assert not server.live and not client.live
    finally:
        server.socket.close(linger=0)


def test_sigint_aborts_what_outlives_the_drain_timeout(limited):
    with Client(limited.endpoint, timeout=30) as client:
        streams = [client.generate([5, 6, 7 + i], max_tokens=200, ignore_eos=True) for i in range(2)]
        for stream in streams:
            next(stream)
        limited.proc.send_signal(signal.SIGINT)
        for stream in streams:
            list(stream)
            assert stream.finished.reason == "abort", stream.finished
            assert "drain timeout" in stream.finished.detail
            assert stream.finished.completion_tokens < 200
    # the server exits by itself; a SIGTERM from stop() could land after its handlers are gone
    assert limited.proc.wait(60) == 0, limited.log()


def test_sigterm_finishes_live_requests_and_refuses_new_ones(tiny, tmp_path):
    with ss.ServerProcess(tiny, tmp_path, *LONG) as server, Client(server.endpoint, timeout=30) as client:
        streams = [client.generate([5, 6, 7 + i], adapter=name, max_tokens=150, temperature=0, ignore_eos=True)
                   for i, name in enumerate(["qv-r4", None, "all-r8"])]
        for stream in streams:
            next(stream)
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while client.health().status != "draining" and time.monotonic() < deadline:
            time.sleep(0.005)
        assert client.health().status == "draining"
        with pytest.raises(ServerError) as err:
            client.complete([5, 6], max_tokens=2)
        assert err.value.code == ErrorCode.SHUTTING_DOWN
        with pytest.raises(ServerError) as err:
            client.load_adapter("x", tiny.adapters["qv-r4"])
        assert err.value.code == ErrorCode.SHUTTING_DOWN
        for stream in streams:
            list(stream)
            assert (stream.finished.reason, len(stream.token_ids)) == ("length", 150)
        assert server.proc.wait(30) == 0, server.log()


@pytest.fixture
def in_process_main(tiny, monkeypatch):
    """Run `cli.main` in this process: the engine's storage gets the CUDA storage's parts (see
    test_engine_close); the signal handlers and root logger main sets are undone afterwards.  Yields
    ``(run, made)``: ``run(*extra_argv)`` returns main's exit status, ``made`` the storages built."""
    import test_engine_close as tc
    from unipage.server import cli

    import unipage.engine

    made = tc.shared_storages(monkeypatch, unipage.engine)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    root = logging.getLogger()
    root_handlers, root_level = list(root.handlers), root.level

    def run(*extra: str) -> int:
        return cli.main(["--device", "cpu", "--model", tiny.model_dir, "--num-pages", "256", "--max-model-len",
                         "64", "--log-level", "WARNING", *extra])

    try:
        yield run, made
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        root.handlers[:] = root_handlers
        root.setLevel(root_level)


def test_sigterm_closes_the_engine_once_live_requests_are_answered(in_process_main, tmp_path):
    """`main` returns only after the drain has answered the live request and the engine's storage is
    closed: its shared ring's file gone, its reader processes exited (the CUDA storage's parts, given to
    this CPU storage as in test_engine_close)."""
    import test_engine_close as tc

    run, made = in_process_main
    ready = str(tmp_path / "endpoint")
    finished, over = [], threading.Event()

    def client_then_sigterm():
        signalled = False
        try:
            deadline = time.monotonic() + 120
            while not os.path.exists(ready) and time.monotonic() < deadline and not over.is_set():
                time.sleep(0.02)
            with open(ready, encoding="utf-8") as f, Client(f.read().strip(), timeout=30) as client:
                stream = client.generate([5, 6, 7], max_tokens=40, temperature=0, ignore_eos=True)
                next(stream)
                if not tc.released(*made[0]):  # (else the test fails below)
                    os.kill(os.getpid(), signal.SIGTERM)
                    signalled = True
                    list(stream)
                    finished.append(stream.finished)
        finally:
            if not signalled:  # whatever went wrong: never leave main serving
                os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, lambda *_: None)  # until main sets its own: a SIGTERM must not end pytest
    thread = threading.Thread(target=client_then_sigterm, daemon=True)
    thread.start()
    try:
        assert run("--bind", "tcp://127.0.0.1:*", "--ready-file", ready) == 0
    finally:
        over.set()
        thread.join(60)  # before pytest's handlers are back: its last SIGTERM lands on main's
    assert [(f.reason, f.completion_tokens) for f in finished] == [("length", 40)]
    ((storage, ring),) = made
    assert storage.closed and tc.released(storage, ring)


def test_a_taken_endpoint_is_exit_2_and_the_engine_is_closed(in_process_main, capsys):
    import test_engine_close as tc
    import zmq

    run, made = in_process_main
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as taken:
        taken.bind("tcp://127.0.0.1:*")
        endpoint = taken.getsockopt_string(zmq.LAST_ENDPOINT)
        assert run("--bind", endpoint) == 2
    assert "unipage-serve:" in capsys.readouterr().err
    ((storage, ring),) = made
    assert storage.closed and tc.released(storage, ring)


def test_sigterm_during_start_up_closes_the_engine(in_process_main, tiny, monkeypatch):
    """A SIGTERM while adapters are being registered ends main with 128 + SIGTERM, the engine closed."""
    import test_engine_close as tc

    import unipage.engine

    register = unipage.engine.Engine.add_adapter

    def signalled(self, name, path):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)  # the handler runs in this thread before the sleep ends
        register(self, name, path)

    monkeypatch.setattr(unipage.engine.Engine, "add_adapter", signalled)
    run, made = in_process_main
    with pytest.raises(SystemExit) as stop:
        run("--bind", "tcp://127.0.0.1:*", "--adapter", f"qv-r4={tiny.adapters['qv-r4']}")
    assert stop.value.code == 128 + signal.SIGTERM
    ((storage, ring),) = made
    assert storage.closed and tc.released(storage, ring)
