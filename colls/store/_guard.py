"""The store server's guard: half-open connection timeouts and token authentication.

A :class:`Guard` is composed into :class:`~colls.store.tcp_server.StoreServer` (kept apart so the
event loop stays readable); the server hands it the containers it shares with it and the two
calls it answers through. Everything runs on the server's loop thread.

* Half-open: a connection must send its first complete frame (with a token: finish AUTH /
  AUTH_PROOF) within ``handshake_timeout`` seconds of being accepted, and a frame it starts must be
  finished that fast; otherwise it is dropped. Deadlines sit in a heap with lazy invalidation.
* Authentication (:mod:`colls.auth`): AUTH carries the client's nonce and is answered with the
  server's nonce and proof; AUTH_PROOF carries the client's proof. Any other command before that,
  a wrong proof, or a token on only one side is answered with an ERROR naming the problem, logged
  with the peer's address, and the connection is closed.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field

from colls import auth
from colls.store import _wire
from colls.store._commands import expect
from colls.store._connection import Connection, Drop, Reply
from colls.store._wire import Command, ProtocolError, Status

logger = logging.getLogger("colls.store")


@dataclass(eq=False)
class Guard:
    """Half-open timeouts and authentication of one server's connections (module docstring).

    Args:
        address: the server's ``host:port``, for logs.
        token: the shared secret clients must prove they know, or None.
        handshake_s: seconds a connection has to establish itself or finish a frame.
        half_open: the heap of ``(deadline, sequence, connection)`` the guard keeps; the
            server reads its head to know how long it may sleep.
        unestablished: the connections not established yet, oldest first; the server caps
            them when it accepts one and forgets one it drops.
        reply: the server's reply. drop: the server's drop.
    """

    address: str
    token: bytes | None
    handshake_s: float
    half_open: list[tuple[float, int, Connection]]
    unestablished: dict[Connection, None]
    reply: Reply
    drop: Drop
    _sequence: itertools.count[int] = field(default_factory=itertools.count, repr=False)

    # ------------------------------------------------------------------------ half-open
    def arm(self, conn: Connection) -> None:
        """Give ``conn`` handshake_timeout seconds to establish itself or finish its frame."""
        conn.deadline = time.monotonic() + self.handshake_s
        heapq.heappush(self.half_open, (conn.deadline, next(self._sequence), conn))

    def rearm(self, conn: Connection) -> None:
        """After its input was processed: clear the deadline, or start one for a frame left
        half-sent (not while its requests are paused: then the server is the one waiting)."""
        if conn.closed or not conn.established:
            return  # the accept-time deadline stays
        if not conn.paused and conn.reader.has_partial():
            if conn.deadline is None:
                self.arm(conn)
        else:
            conn.deadline = None

    def expire(self) -> None:
        """Drop the connections whose handshake or half-sent frame ran out of time."""
        now = time.monotonic()
        while self.half_open and self.half_open[0][0] <= now:
            _, _, conn = heapq.heappop(self.half_open)
            if conn.closed or conn.deadline is None or conn.deadline > now:
                continue
            what = "authenticate" if self.token and not conn.established else "send a frame"
            self.drop(
                conn, f"half-open: did not {what} within {self.handshake_s:.1f} s"
            )

    def next_deadline(self) -> float | None:
        """Return the earliest live half-open deadline, or None (stale entries go)."""
        while self.half_open and self.half_open[0][2].deadline is None:
            heapq.heappop(self.half_open)
        return self.half_open[0][0] if self.half_open else None

    # -------------------------------------------------------------------------- auth
    def admit(self, conn: Connection, command: int) -> bool:
        """Let the first frames of a connection through, or refuse it; True to go on."""
        if self.token is None:
            if command in (Command.AUTH, Command.AUTH_PROOF):
                self._refuse(conn, "this TCPStore has no auth token but the client sent one; "
                             "set the same COLLS_AUTH_TOKEN on every rank (or on none)")
                return False
            self._establish(conn)
            return True
        if command in (Command.AUTH, Command.AUTH_PROOF):
            return True
        self._refuse(conn, "authentication required: this TCPStore only serves clients "
                     "that know its COLLS_AUTH_TOKEN")
        return False

    def _establish(self, conn: Connection) -> None:
        """Mark ``conn`` established: no handshake deadline, no longer counted against the cap."""
        conn.established = True
        conn.deadline = None
        self.unestablished.pop(conn, None)

    def _refuse(self, conn: Connection, message: str) -> None:
        logger.warning("TCPStore %s: refused connection from %s: %s",
                       self.address, conn.peer, message)
        self.reply(conn, Status.ERROR, [message.encode("utf-8")])
        self.drop(conn, None)

    def on_auth(self, conn: Connection, fields: list[bytes]) -> None:
        """AUTH: answer the client's nonce with this server's nonce and proof."""
        expect(fields, 1, "AUTH")
        if self.token is None or conn.server_nonce:
            raise ProtocolError("unexpected AUTH")
        if len(fields[0]) != auth.NONCE_BYTES:
            raise ProtocolError(f"AUTH nonce must be {auth.NONCE_BYTES} bytes")
        conn.client_nonce, conn.server_nonce = fields[0], auth.new_nonce()
        server_proof = auth.proof(
            self.token, auth.STORE_SERVER, conn.client_nonce, conn.server_nonce
        )
        self.reply(conn, Status.OK, [conn.server_nonce, server_proof])

    def on_auth_proof(self, conn: Connection, fields: list[bytes]) -> None:
        """AUTH_PROOF: check the client's proof; establish the connection or refuse it."""
        expect(fields, 1, "AUTH_PROOF")
        if self.token is None or not conn.server_nonce:
            raise ProtocolError("AUTH_PROOF before AUTH")
        if not auth.verify(self.token, auth.STORE_CLIENT, conn.server_nonce,
                           conn.client_nonce, fields[0]):
            self._refuse(conn, "authentication failed: wrong COLLS_AUTH_TOKEN")
            return
        self._establish(conn)
        conn.reader.limit = _wire.MAX_PAYLOAD_BYTES
        self.reply(conn, Status.OK, [])
