"""unipage.server — the ZeroMQ frontend: protocol, server loop, clients, `unipage-serve`.

    unipage-serve --model DIR --adapter sql=DIR --bind tcp://127.0.0.1:5555

    from unipage.server import Client
    with Client("tcp://127.0.0.1:5555") as client:
        print(client.complete("Hello", adapter="sql", max_tokens=16, temperature=0).text)

The protocol and the clients import no torch (a client machine needs only
msgspec and pyzmq).  docs/protocol.md is the wire specification.
"""

from unipage.server.client import (
    AsyncClient,
    AsyncStream,
    Client,
    Completion,
    ServerError,
    Stream,
)
from unipage.server.config import ServerConfig
from unipage.server.protocol import VERSION, ErrorCode, FinishReasons

__all__ = ["VERSION", "AsyncClient", "AsyncStream", "Client", "Completion", "ErrorCode", "FinishReasons",
           "Server", "ServerConfig", "ServerError", "Stream"]


def __getattr__(name: str):
    if name == "Server":
        from unipage.server.server import Server

        return Server
    raise AttributeError(f"module 'unipage.server' has no attribute {name!r}")
