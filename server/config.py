"""`ServerConfig`: the frontend's socket, limits and shutdown settings, frozen and validated.

Each field's comment doubles as its ``unipage-serve --help`` text.  Nothing
here imports torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from unipage.config import int_at_least, require
from unipage.server.protocol import DEFAULT_MAX_MESSAGE_BYTES


@dataclass(frozen=True)
class ServerConfig:
    """The ZeroMQ frontend: where it listens, what it accepts, how it sheds load and how it stops."""

    bind: str = "tcp://127.0.0.1:5555"  # ZeroMQ endpoint of the ROUTER socket; tcp://HOST:* picks a free port
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # largest request frame read; larger ones get "too_large"
    max_active_requests: int = 4096  # live Generate requests over all clients; more get "overloaded", >= 1
    client_backlog: int = 2048  # replies queued for one client beyond its socket buffers; past this its
    #   requests are dropped with "slow_reader", >= 1
    sndhwm: int = 1000  # ZeroMQ send high-water mark per client connection (messages), >= 1
    rcvhwm: int = 1000  # ZeroMQ receive high-water mark per client connection (messages), >= 1
    sndbuf: int = 0  # kernel send buffer per connection in bytes; 0 = the OS default
    drain_timeout_s: float = 30.0  # on SIGINT/SIGTERM: time for live requests to finish before they are aborted
    heartbeat_s: float = 5.0  # ZeroMQ heartbeat interval; a peer silent for 3x this is disconnected; 0 = off
    adapter_roots: tuple[str, ...] = ()  # directories LoadAdapter may read from; none = runtime loading off

    def __post_init__(self) -> None:
        require(isinstance(self.bind, str) and "://" in self.bind, "bind", "a ZeroMQ endpoint like "
                 "tcp://127.0.0.1:5555", self.bind)
        for name in ("max_message_bytes", "max_active_requests", "client_backlog", "sndhwm", "rcvhwm"):
            require(int_at_least(getattr(self, name), 1), name, "an integer >= 1", getattr(self, name))
        require(int_at_least(self.sndbuf, 0), "sndbuf", "an integer >= 0", self.sndbuf)
        for name in ("drain_timeout_s", "heartbeat_s"):
            value = getattr(self, name)
            require(isinstance(value, (int, float)) and value >= 0, name, ">= 0", value)
        roots = tuple(os.path.realpath(os.fspath(r)) for r in self.adapter_roots)
        object.__setattr__(self, "adapter_roots", roots)
