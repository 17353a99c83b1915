"""`unipage-serve` end to end: a real server process on loopback, real clients (CPU, tiny model).

One server serves the module (``server``); the tests that need other limits or
stop the server start their own (test_server_shutdown.py).  Every bad input is
followed by a good request from another client and a check that the server's
state did not change.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time

import msgspec
import pytest
import test_server_support as ss
from test_server_support import pack, raw_socket, recv
from unipage.server import AsyncClient, Client, ErrorCode, ServerError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tiny = ss.tiny_model(tmp_path_factory.mktemp("server-model"))
    corrupt = os.path.join(tiny.adapter_root, "corrupt")
    os.makedirs(corrupt)
    shutil.copy(os.path.join(tiny.adapters["qv-r4"], "adapter_config.json"), corrupt)
    with open(os.path.join(corrupt, "adapter_model.safetensors"), "wb") as f:
        f.write(b"\x40\x00\x00\x00\x00\x00\x00\x00{not json" + b"\x00" * 64)
    os.makedirs(os.path.join(tiny.adapter_root, "empty"))
    return tiny


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    proc = ss.ServerProcess(tiny, tmp_path_factory.mktemp("server-main"))
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def offline(tiny):
    """unipage.LLM on the same files: the oracle (one torch thread: the server shares the cores)."""
    import torch
    from unipage.scheduler import SchedulerConfig

    from unipage import LLM
    from unipage.config import PoolConfig

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(tiny.model_dir, tiny.adapters, device="cpu", pool=PoolConfig(num_pages=256),
              scheduler=SchedulerConfig(max_model_len=64))
    torch.set_num_threads(threads)


@pytest.fixture
def client(server):
    with Client(server.endpoint, timeout=30) as c:
        yield c


def prompt(i: int, n: int = 6) -> list[int]:
    return [(7 * i + 3 * j) % 90 + 3 for j in range(n)]


# -- generation matches the offline API -------------------------------------------------------------


def test_concurrent_streams_match_offline(server, offline):
    """Twelve concurrent streams over every adapter and the base model: the tokens of unipage.LLM."""
    from unipage import SamplingParams

    names = [None, *ss.ADAPTERS] * 3
    seeds = [None] * 8 + [11, 12, 13, 14]  # the last four sample with a seed

    async def run():
        async with AsyncClient(server.endpoint, timeout=30) as client:
            async def one(i):
                temperature = 0.0 if seeds[i] is None else 0.9
                stream = client.generate(prompt(i, 4 + i), adapter=names[i], max_tokens=12,
                                         temperature=temperature, seed=seeds[i])
                chunks = [chunk async for chunk in stream]
                return stream, chunks
            return await asyncio.gather(*(one(i) for i in range(len(names))))

    results = asyncio.run(run())
    sampling = [SamplingParams(temperature=0) if s is None else SamplingParams(0.9, seed=s) for s in seeds]
    offline_outs = offline.generate([prompt(i, 4 + i) for i in range(len(names))], sampling, adapters=names,
                                    max_tokens=12)
    for i, (stream, chunks) in enumerate(results):
        want = offline_outs[i]
        assert stream.token_ids == want.token_ids, (names[i], seeds[i])
        assert stream.finished.reason == want.finish_reason
        assert stream.text == want.text
        assert len(chunks) == len(want.token_ids)  # one chunk per step with streaming
        assert stream.finished.completion_tokens == len(want.token_ids)
        assert stream.finished.prompt_tokens == 4 + i


def test_text_prompt_and_whole_completion(client, offline):
    from unipage import SamplingParams

    got = client.complete("Hello, unipage", adapter="all-r8", max_tokens=10, temperature=0)
    want = offline.generate("Hello, unipage", SamplingParams(temperature=0), adapter="all-r8", max_tokens=10)[0]
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert got.prompt_tokens == len("Hello, unipage") and got.ttft_s is not None and got.latency_s >= got.ttft_s


def test_a_temperature_too_small_to_divide_by_is_greedy(client):
    """It once made the engine's step raise for the whole batch; the sampler now treats it as greedy."""
    tiny_t = client.complete(prompt(4), max_tokens=8, temperature=1e-40, ignore_eos=True)
    greedy = client.complete(prompt(4), max_tokens=8, temperature=0, ignore_eos=True)
    assert tiny_t.token_ids == greedy.token_ids


def test_one_client_reads_streams_interleaved(client, offline):
    from unipage import SamplingParams

    a = client.generate(prompt(1), adapter="qv-r4", max_tokens=8, temperature=0, ignore_eos=True)
    b = client.generate(prompt(2), adapter="mlp-r2", max_tokens=8, temperature=0, ignore_eos=True)
    for _ in zip(a, b):
        pass
    list(a), list(b)
    greedy = SamplingParams(temperature=0)
    assert a.token_ids == offline.generate(prompt(1), greedy, adapter="qv-r4", max_tokens=8,
                                           ignore_eos=True)[0].token_ids
    assert b.token_ids == offline.generate(prompt(2), greedy, adapter="mlp-r2", max_tokens=8,
                                           ignore_eos=True)[0].token_ids


def test_abort_ends_the_stream(client):
    stream = client.generate(prompt(3), max_tokens=50, temperature=0, ignore_eos=True)
    next(stream)
    stream.abort()
    list(stream)
    assert stream.finished.reason == "abort" and stream.finished.completion_tokens < 50
    assert client.stats().active == 0


# -- adapters at run time ---------------------------------------------------------------------------


def test_load_list_unload_at_run_time(client, tiny, offline):
    from unipage import SamplingParams
    from unipage.peft_write import write_random_adapter

    path = write_random_adapter(os.path.join(tiny.adapter_root, "late-r6"), ss.MODEL, rank=6, alpha=12,
                                targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=9, std=0.3)
    listed = client.load_adapter("late", path)
    assert [a.name for a in listed] == sorted([*ss.ADAPTERS, "late"])
    late = next(a for a in client.list_adapters() if a.name == "late")
    assert (late.rank, late.resident, late.path) == (6, False, path)
    got = client.complete(prompt(5), adapter="late", max_tokens=10, temperature=0)
    offline.add_adapter("late", path)
    try:
        want = offline.generate(prompt(5), SamplingParams(temperature=0), adapter="late", max_tokens=10)[0]
    finally:
        offline.remove_adapter("late")
    assert got.token_ids == want.token_ids
    assert "late" in client.stats().resident_adapters
    assert "late" not in [a.name for a in client.unload_adapter("late")]
    with pytest.raises(ServerError) as err:
        client.complete(prompt(5), adapter="late", max_tokens=2)
    assert err.value.code == ErrorCode.UNKNOWN_ADAPTER


def test_unload_of_a_busy_adapter_is_refused(client):
    stream = client.generate(prompt(6), adapter="all-r8", max_tokens=50, temperature=0, ignore_eos=True)
    next(stream)
    with pytest.raises(ServerError) as err:
        client.unload_adapter("all-r8")
    assert err.value.code == ErrorCode.ADAPTER_BUSY
    stream.abort()
    list(stream)
    assert "all-r8" in [a.name for a in client.list_adapters()]


# -- bad input: an Error to that client only, nothing changed ----------------------------------------


def _bad_inputs(tiny) -> list[tuple[str, list[bytes], str, str]]:
    """(case, frames, expected code, expected request_id)."""
    gen = {"type": "generate", "request_id": "bad", "prompt": [5, 6, 7], "max_tokens": 2}
    root = tiny.adapter_root
    return [
        ("not msgpack", [b"\xc1\xc1\xc1"], ErrorCode.MALFORMED, ""),
        ("not a map", [msgspec.msgpack.encode([1, 2, 3])], ErrorCode.MALFORMED, ""),
        ("empty frame", [b""], ErrorCode.MALFORMED, ""),
        ("two frames", [pack(**gen), pack(**gen)], ErrorCode.MALFORMED, ""),
        ("oversized", [pack(**{**gen, "prompt": [300] * 400_000})], ErrorCode.TOO_LARGE, "bad"),
        ("unknown type", [pack(type="explode", request_id="bad")], ErrorCode.UNKNOWN_TYPE, "bad"),
        ("wrong version", [msgspec.msgpack.encode({**gen, "v": 99})], ErrorCode.VERSION, "bad"),
        ("no version", [msgspec.msgpack.encode(gen)], ErrorCode.VERSION, "bad"),
        ("token id of the wrong type", [pack(**{**gen, "prompt": [5, "x"]})], ErrorCode.MALFORMED, "bad"),
        ("no request id", [pack(type="generate", prompt=[5])], ErrorCode.MALFORMED, ""),
        ("unknown adapter", [pack(**gen, adapter="nope")], ErrorCode.UNKNOWN_ADAPTER, "bad"),
        ("negative temperature", [pack(**gen, sampling={"temperature": -1.0})], ErrorCode.INVALID_REQUEST, "bad"),
        ("top_p of zero", [pack(**gen, sampling={"top_p": 0.0})], ErrorCode.INVALID_REQUEST, "bad"),
        ("negative top_k", [pack(**gen, sampling={"top_k": -3})], ErrorCode.INVALID_REQUEST, "bad"),
        ("max_tokens of zero", [pack(**{**gen, "max_tokens": 0})], ErrorCode.INVALID_REQUEST, "bad"),
        ("empty prompt", [pack(**{**gen, "prompt": []})], ErrorCode.INVALID_REQUEST, "bad"),
        ("token outside the vocabulary", [pack(**{**gen, "prompt": [5, 4096]})], ErrorCode.INVALID_REQUEST, "bad"),
        ("prompt too long", [pack(**{**gen, "prompt": [5] * 64})], ErrorCode.PROMPT_TOO_LONG, "bad"),
        ("adapter outside the roots", [pack(type="load_adapter", request_id="bad", name="x",
                                            path=tiny.adapters["qv-r4"] + "/../../model")],
         ErrorCode.ADAPTER_PATH, "bad"),
        ("corrupt adapter", [pack(type="load_adapter", request_id="bad", name="x", path=f"{root}/corrupt")],
         ErrorCode.ADAPTER_INVALID, "bad"),
        ("adapter without files", [pack(type="load_adapter", request_id="bad", name="x", path=f"{root}/empty")],
         ErrorCode.ADAPTER_INVALID, "bad"),
        ("adapter name taken", [pack(type="load_adapter", request_id="bad", name="qv-r4",
                                     path=tiny.adapters["mlp-r2"])], ErrorCode.ADAPTER_EXISTS, "bad"),
        ("unload of an unknown adapter", [pack(type="unload_adapter", request_id="bad", name="nope")],
         ErrorCode.UNKNOWN_ADAPTER, "bad"),
        ("abort of an unknown request", [pack(type="abort", request_id="bad")], ErrorCode.UNKNOWN_REQUEST, "bad"),
    ]


def _state(client: Client) -> tuple:
    stats = client.stats()
    adapters = [(a.name, a.path, a.digest) for a in client.list_adapters()]
    return adapters, stats.registered_adapters, stats.active, stats.waiting, stats.running, stats.pool_pages["kv"]


def test_every_bad_input_gets_an_error_and_changes_nothing(server, tiny, client):
    before = _state(client)
    sock = raw_socket(server.endpoint)
    try:
        for case, frames, code, request_id in _bad_inputs(tiny):
            sock.send_multipart(frames)
            reply = recv(sock)
            assert (reply["type"], reply["code"], reply["request_id"]) == ("error", code, request_id), case
            assert reply["v"] == 1 and reply["message"], case
            ok = client.complete(prompt(7), adapter="qv-r4", max_tokens=3, temperature=0)  # another client
            assert ok.completion_tokens >= 1, case
            assert _state(client) == before, case
        assert not sock.poll(200), "one reply per bad frame"
    finally:
        sock.close()


def test_duplicate_live_request_id(server, client):
    sock = raw_socket(server.endpoint)
    try:
        gen = {"type": "generate", "request_id": "dup", "prompt": [5, 6], "max_tokens": 40, "ignore_eos": True}
        sock.send(pack(**gen))
        assert recv(sock)["type"] == "token_chunk"
        sock.send(pack(**gen))
        replies = []
        while not replies or replies[-1]["type"] == "token_chunk":
            replies.append(recv(sock))
        errors = [r for r in replies if r["type"] == "error"]
        assert errors and errors[0]["code"] == ErrorCode.DUPLICATE_REQUEST
        sock.send(pack(type="abort", request_id="dup"))
        while (reply := recv(sock))["type"] == "token_chunk":
            pass
        assert (reply["type"], reply["reason"]) == ("finished", "abort")
    finally:
        sock.close()
    assert client.stats().active == 0


def test_health_and_stats(client):
    health = client.health()
    assert (health.status, health.device, health.has_tokenizer) == ("ok", "cpu", True)
    stats = client.stats()
    assert sum(stats.pool_pages.values()) == stats.total_pages == 256
    assert stats.registered_adapters >= len(ss.ADAPTERS) and stats.generated_tokens > 0


# -- disconnects and load --------------------------------------------------------------------------


def test_disconnect_mid_stream_frees_the_pages(server, client):
    before = client.stats()
    sock = raw_socket(server.endpoint)
    sock.send(pack(type="generate", request_id="gone", prompt=prompt(8), adapter="mlp-r2", max_tokens=55,
                   ignore_eos=True))
    assert recv(sock)["type"] == "token_chunk"
    assert recv(sock)["type"] == "token_chunk"
    sock.close(linger=0)
    deadline = time.monotonic() + 20
    while (stats := client.stats()).active and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stats.active == 0 and stats.running == 0 and stats.waiting == 0
    assert stats.pool_pages["kv"] == 0  # the KV of the stream is freed (full blocks may stay as cached_kv)
    assert stats.finished == before.finished + 0  # aborted, never finished


def test_a_thousand_requests_from_sixteen_clients(server):
    """Every request answered exactly once: its chunks, then one Finished; nothing lost or duplicated."""
    clients, per_client = 16, 63  # 1,008 requests
    results: dict[int, list] = {}
    failures: list[BaseException] = []
    names = [None, *ss.ADAPTERS]

    def run(c: int) -> None:
        sock = raw_socket(server.endpoint)
        try:
            for i in range(per_client):
                sock.send(pack(type="generate", request_id=f"c{c}-{i}", prompt=prompt(c * per_client + i, 3),
                               adapter=names[i % 4], max_tokens=1 + i % 3, stream=bool(i % 2),
                               sampling={"temperature": 0.0}, ignore_eos=True))
            replies, done = [], 0
            while done < per_client:
                reply = recv(sock, 60)
                replies.append(reply)
                done += reply["type"] in ("finished", "error")
            assert not sock.poll(300), "a reply after every request had its terminal reply"
            results[c] = replies
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            failures.append(err)
        finally:
            sock.close()

    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[0]
    answered = 0
    for c, replies in results.items():
        by_id: dict[str, list] = {}
        for reply in replies:
            by_id.setdefault(reply["request_id"], []).append(reply)
        assert sorted(by_id) == sorted(f"c{c}-{i}" for i in range(per_client))
        for rid, rs in by_id.items():
            i = int(rid.split("-")[1])
            assert [r["type"] for r in rs][-1] == "finished" and sum(r["type"] == "finished" for r in rs) == 1
            tokens = [t for r in rs if r["type"] == "token_chunk" for t in r["token_ids"]]
            assert len(tokens) == rs[-1]["completion_tokens"] == 1 + i % 3, rid
            assert len(rs) == (1 + len(tokens) if i % 2 else 2), rid  # streamed: one chunk per token
            answered += 1
    assert answered == clients * per_client


def test_async_client_control_calls_errors_and_abort(server, tiny):
    async def run():
        async with AsyncClient(server.endpoint, timeout=30) as client:
            health, stats, adapters = await asyncio.gather(client.health(), client.stats(), client.list_adapters())
            assert health.status == "ok" and stats.total_pages == 256
            assert [a.name for a in adapters] == sorted(ss.ADAPTERS)
            with pytest.raises(ServerError) as err:
                await client.complete(prompt(1), adapter="nope")
            assert err.value.code == ErrorCode.UNKNOWN_ADAPTER
            with pytest.raises(ServerError) as err:
                await client.load_adapter("x", tiny.model_dir)
            assert err.value.code == ErrorCode.ADAPTER_PATH
            async with client.generate(prompt(2), max_tokens=50, ignore_eos=True, temperature=0) as stream:
                async for _ in stream:
                    break  # leaving the block aborts it
            deadline = time.monotonic() + 10
            while (await client.stats()).active and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert (await client.stats()).active == 0
            done = await client.complete("abc", adapter="qv-r4", max_tokens=3, temperature=0, ignore_eos=True)
            assert done.completion_tokens == 3 and done.text is not None

    asyncio.run(run())
