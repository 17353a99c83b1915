"""The protocol, the detokenizer, the options and the configs, without a server process."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import msgspec
import pytest
from unipage.server import protocol as p
from unipage.server.config import ServerConfig
from unipage.server.detokenize import IncrementalDetokenizer
from unipage.server.options import byte_size, field_help

V = p.VERSION
REQUESTS = [
    p.Generate(v=V, request_id="g", prompt=[1, 2, 3], adapter="sql", sampling=p.Sampling(temperature=0.5, top_p=0.9,
               top_k=4, seed=7), max_tokens=9, stop_token_ids=[2], ignore_eos=True, stream=False),
    p.Generate(v=V, request_id="t", prompt="text"),
    p.Abort(v=V, request_id="g"),
    p.LoadAdapter(v=V, request_id="l", name="a", path="/srv/a"),
    p.UnloadAdapter(v=V, request_id="u", name="a"),
    p.ListAdapters(v=V, request_id="la"),
    p.StatsRequest(v=V, request_id="s"),
    p.HealthRequest(v=V, request_id="h"),
]
REPLIES = [
    p.TokenChunk(v=V, request_id="g", token_ids=[4, 5], text="hi"),
    p.Finished(v=V, request_id="g", reason="length", prompt_tokens=3, completion_tokens=2, ttft_s=0.1, latency_s=0.2),
    p.Error(v=V, request_id="", code=p.ErrorCode.MALFORMED, message="bad"),
    p.AdapterList(v=V, request_id="la", adapters=[p.AdapterInfo(name="a", path="/srv/a", rank=8, resident=True,
                                                                pages=3, digest="ab")]),
    p.Stats(v=V, request_id="s", pool_pages={"free": 1}, total_pages=1, resident_adapters=[], registered_adapters=0,
            waiting=0, running=0, active=0, clients=0, tokens_per_s=0.0, window_s=10.0, generated_tokens=0,
            finished=0, errors=0, steps=0, uptime_s=1.0),
    p.Health(v=V, request_id="h", status="ok", model="m", device="cpu", has_tokenizer=False, uptime_s=1.0),
]


@pytest.mark.parametrize("message", REQUESTS, ids=lambda m: type(m).__name__)
def test_requests_round_trip(message):
    assert p.decode_request(p.encode(message)) == message


@pytest.mark.parametrize("message", REPLIES, ids=lambda m: type(m).__name__)
def test_replies_round_trip(message):
    assert p.decode_reply(p.encode(message)) == message


def test_every_message_is_a_map_with_type_and_version():
    for message in REQUESTS + REPLIES:
        raw = msgspec.msgpack.decode(p.encode(message))
        assert isinstance(raw, dict) and raw["v"] == V and isinstance(raw["type"], str)


def test_defaults_of_a_minimal_generate():
    g = p.decode_request(msgspec.msgpack.encode({"type": "generate", "v": 1, "request_id": "r", "prompt": [1],
                                                 "extra_key_from_a_newer_client": 1}))
    assert (g.adapter, g.max_tokens, g.stream, g.ignore_eos, g.stop_token_ids) == (None, 16, True, False, [])
    assert g.sampling == p.Sampling(temperature=1.0, top_p=1.0, top_k=0, seed=None)


@pytest.mark.parametrize(("raw", "code", "request_id"), [
    (b"\xc1", p.ErrorCode.MALFORMED, ""),
    (msgspec.msgpack.encode("generate"), p.ErrorCode.MALFORMED, ""),
    (msgspec.msgpack.encode({"type": "generate", "v": 2, "request_id": "r", "prompt": [1]}), p.ErrorCode.VERSION, "r"),
    (msgspec.msgpack.encode({"type": "generate", "v": True, "request_id": "r", "prompt": [1]}),
     p.ErrorCode.VERSION, "r"),
    (msgspec.msgpack.encode({"type": "nope", "v": 1, "request_id": "r"}), p.ErrorCode.UNKNOWN_TYPE, "r"),
    (msgspec.msgpack.encode({"type": "nope", "v": 3}), p.ErrorCode.VERSION, ""),
    (msgspec.msgpack.encode({"type": "generate", "v": 1, "request_id": "r", "prompt": [1.5]}),
     p.ErrorCode.MALFORMED, "r"),
    (msgspec.msgpack.encode({"type": "generate", "v": 1, "request_id": "", "prompt": [1]}), p.ErrorCode.MALFORMED, ""),
    (msgspec.msgpack.encode({"type": "finished", "v": 1, "request_id": "r"}), p.ErrorCode.UNKNOWN_TYPE, "r"),
])
def test_bad_frames_are_classified(raw, code, request_id):
    with pytest.raises(p.ProtocolError) as err:
        p.decode_request(raw)
    assert (err.value.code, err.value.request_id) == (code, request_id)


def test_error_codes_are_documented():
    with open(pathlib.Path(__file__).parent.parent / "docs" / "protocol.md", encoding="utf-8") as f:
        doc = f.read()
    for code in p.ErrorCode.ALL + p.FinishReasons.ALL + p.REQUEST_TYPES + p.REPLY_TYPES:
        assert f"`{code}`" in doc or f'`"{code}"`' in doc, code


def test_peek_request_id():
    assert p.peek_request_id(msgspec.msgpack.encode({"prompt": [1] * 100, "request_id": "big"})) == "big"
    assert p.peek_request_id(b"\xc1") == ""


def test_protocol_and_clients_import_no_torch():
    code = ("import sys, unipage.server, unipage.server.protocol, unipage.server.client, unipage.server.server; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


class ByteTokenizer:
    """Each token is one byte of UTF-8: characters span several tokens."""

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_holds_back_incomplete_characters():
    text = "naïve € 😀 done"
    detok = IncrementalDetokenizer(ByteTokenizer())
    pieces = [detok.push([b]) for b in text.encode()]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert pieces[text.encode().index("😀".encode()) + 3] == "😀"  # released with its last byte


def test_detokenizer_flushes_a_truncated_character():
    detok = IncrementalDetokenizer(ByteTokenizer())
    assert detok.push(list(b"ab") + ["€".encode()[0]]) == ""
    assert detok.flush() == "ab\ufffd"


def test_options_help_comes_from_the_config_comments():
    helps = field_help(ServerConfig)
    assert helps["client_backlog"].startswith("replies queued for one client beyond its socket buffers")
    assert "slow_reader" in helps["client_backlog"]  # the continuation line
    assert set(helps) == {f for f in ServerConfig.__dataclass_fields__}


@pytest.mark.parametrize(("text", "value"), [("1048576", 1 << 20), ("512MiB", 512 << 20), ("2GB", 2 * 10**9),
                                             ("1.5KiB", 1536)])
def test_byte_sizes(text, value):
    assert byte_size(text) == value


@pytest.mark.parametrize(("field", "value"), [("max_message_bytes", 0), ("client_backlog", -1), ("sndhwm", True),
                                              ("drain_timeout_s", -1.0), ("bind", "localhost:5555")])
def test_server_config_is_validated(field, value):
    with pytest.raises(ValueError, match=field):
        ServerConfig(**{field: value})


def test_serve_help_and_bad_model_directory(tmp_path):
    out = subprocess.run([sys.executable, "-m", "unipage.server.cli", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for flag in ("--model", "--adapter", "--adapter-root", "--bind", "--device", "--num-pages", "--max-num-seqs",
                 "--max-message-bytes", "--client-backlog", "--drain-timeout-s", "--eviction-policy"):
        assert flag in out, flag
    bad = subprocess.run([sys.executable, "-m", "unipage.server.cli", "--model", str(tmp_path)],
                         check=False, capture_output=True, text=True)
    assert bad.returncode == 2 and "no config.json" in bad.stderr
