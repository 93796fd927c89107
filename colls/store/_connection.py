"""The store server's per-client state: a connection and its parked request.

Shared by the server's event loop (:mod:`colls.store.tcp_server`), its guard
(:mod:`colls.store._guard`) and its command handlers (:mod:`colls.store._commands`); every field
is touched on the server's loop thread only.
"""

from __future__ import annotations

import collections
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

from colls.store import _wire
from colls.store._wire import Status

#: Unsent reply bytes of one connection past which its requests are no longer read. An honest
#: client has one request in flight; one that pipelines GETs of a large value without reading
#: the replies would otherwise make the server copy the value once per request (40 GETs of an
#: 8 MiB value: 320 MiB). A few MiB keeps replies streaming at full speed.
MAX_UNSENT_REPLY_BYTES = 4 << 20


@dataclass(eq=False)
class Waiter:
    """A parked GET / WAIT / MULTI_GET request."""

    conn: Connection
    command: int
    keys: list[bytes]
    missing: set[bytes]
    deadline: float | None
    done: bool = False


@dataclass(eq=False)
class Connection:
    """One client connection: its socket, unparsed input, pending output and parked request."""

    sock: socket.socket
    peer: str
    reader: _wire.FrameReader = field(default_factory=_wire.FrameReader)
    outbox: collections.deque[memoryview] = field(default_factory=collections.deque)
    outbox_bytes: int = 0
    events: int = 0  # selector events registered (0: not registered)
    parked: Waiter | None = None
    closed: bool = False
    established: bool = False  # authenticated, or (without a token) sent a complete frame
    deadline: float | None = None  # when a half-open connection is dropped
    client_nonce: bytes = b""
    server_nonce: bytes = b""

    @property
    def paused(self) -> bool:
        """Whether its requests wait for the server (a parked one, or replies to drain)."""
        return self.parked is not None or self.outbox_bytes > MAX_UNSENT_REPLY_BYTES


#: A command handler: answers one request of a connection (its fields already split).
Handler = Callable[[Connection, list[bytes]], None]
#: The server's reply: queues one frame to a connection and sends what the socket takes.
Reply = Callable[[Connection, Status, list[bytes]], None]
#: The server's drop: closes a connection, logging ``reason`` unless it is None.
Drop = Callable[[Connection, "str | None"], None]
