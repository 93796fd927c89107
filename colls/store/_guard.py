"""The store server's guard: half-open connection timeouts and token authentication.

Mixed into :class:`~colls.store.tcp_server.StoreServer` (kept apart so the event loop stays
readable). Everything runs on the server's loop thread.

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
import logging
import time
from typing import TYPE_CHECKING, Any

from colls import auth
from colls.store import _wire
from colls.store._wire import Command, ProtocolError, Status

if TYPE_CHECKING:
    from colls.store.tcp_server import _Connection

logger = logging.getLogger("colls.store")


class GuardMixin:
    """Half-open timeouts and authentication (see the module docstring)."""

    _token: bytes | None
    _handshake_s: float
    _half_open: list[tuple[float, int, _Connection]]
    _unestablished: dict[_Connection, None]
    _sequence: Any
    address: str

    def _reply(self, conn: _Connection, status: Status, fields: list[bytes]) -> None:
        raise NotImplementedError

    def _drop(self, conn: _Connection, reason: str | None) -> None:
        raise NotImplementedError

    @staticmethod
    def _expect(fields: list[bytes], count: int, command: str) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------------ half-open
    def _arm(self, conn: _Connection) -> None:
        """Give ``conn`` handshake_timeout seconds to establish itself or finish its frame."""
        conn.deadline = time.monotonic() + self._handshake_s
        heapq.heappush(self._half_open, (conn.deadline, next(self._sequence), conn))

    def _rearm(self, conn: _Connection) -> None:
        """After its input was processed: clear the deadline, or start one for a frame left
        half-sent (not while its requests are paused: then the server is the one waiting)."""
        if conn.closed or not conn.established:
            return  # the accept-time deadline stays
        if not conn.paused and conn.reader.has_partial():
            if conn.deadline is None:
                self._arm(conn)
        else:
            conn.deadline = None

    def _expire_half_open(self) -> None:
        now = time.monotonic()
        while self._half_open and self._half_open[0][0] <= now:
            _, _, conn = heapq.heappop(self._half_open)
            if conn.closed or conn.deadline is None or conn.deadline > now:
                continue
            what = "authenticate" if self._token and not conn.established else "send a frame"
            self._drop(
                conn, f"half-open: did not {what} within {self._handshake_s:.1f} s"
            )

    # -------------------------------------------------------------------------- auth
    def _admit(self, conn: _Connection, command: int) -> bool:
        """Let the first frames of a connection through, or refuse it; True to go on."""
        if self._token is None:
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

    def _establish(self, conn: _Connection) -> None:
        """Mark ``conn`` established: no handshake deadline, no longer counted against the cap."""
        conn.established = True
        conn.deadline = None
        self._unestablished.pop(conn, None)

    def _refuse(self, conn: _Connection, message: str) -> None:
        logger.warning("TCPStore %s: refused connection from %s: %s",
                       self.address, conn.peer, message)
        self._reply(conn, Status.ERROR, [message.encode("utf-8")])
        self._drop(conn, None)

    def _cmd_ping(self, conn: _Connection, fields: list[bytes]) -> None:
        self._expect(fields, 0, "PING")
        self._reply(conn, Status.OK, [])

    def _cmd_auth(self, conn: _Connection, fields: list[bytes]) -> None:
        self._expect(fields, 1, "AUTH")
        if self._token is None or conn.server_nonce:
            raise ProtocolError("unexpected AUTH")
        if len(fields[0]) != auth.NONCE_BYTES:
            raise ProtocolError(f"AUTH nonce must be {auth.NONCE_BYTES} bytes")
        conn.client_nonce, conn.server_nonce = fields[0], auth.new_nonce()
        server_proof = auth.proof(
            self._token, auth.STORE_SERVER, conn.client_nonce, conn.server_nonce
        )
        self._reply(conn, Status.OK, [conn.server_nonce, server_proof])

    def _cmd_auth_proof(self, conn: _Connection, fields: list[bytes]) -> None:
        self._expect(fields, 1, "AUTH_PROOF")
        if self._token is None or not conn.server_nonce:
            raise ProtocolError("AUTH_PROOF before AUTH")
        if not auth.verify(self._token, auth.STORE_CLIENT, conn.server_nonce,
                           conn.client_nonce, fields[0]):
            self._refuse(conn, "authentication failed: wrong COLLS_AUTH_TOKEN")
            return
        self._establish(conn)
        conn.reader.limit = _wire.MAX_PAYLOAD_BYTES
        self._reply(conn, Status.OK, [])

