"""The tcp engine's table of connections, opened lazily, and the tie-break between two openings.

:class:`Links` maps peer ranks to :class:`~colls_plugins.tcp._peer.Peer` objects. A caller thread
that sends to a peer without a connection dials it (:meth:`Links.connect`, through
:meth:`~colls_plugins.tcp.connections.Mesh.dial`); the engine's progress thread hands every
incoming hello to :meth:`Links.on_hello`, which answers it. One lock (a condition) covers the
table and the set of peers being dialled, so the verdict on an incoming hello and the decision to
dial are never interleaved:

* an incoming hello from a rank this rank is dialling, or already holds a connection it dialled
  to, is declined when this rank is the lower one (its own connection stays) and accepted when
  it is the higher one (the lower rank declines this rank's connection in turn);
* a second connection from a rank that is already connected, opened by that rank, is refused.

So two ranks that open their pair at once end with exactly the lower rank's connection, and a
dialler that was declined waits for the peer's connection, which is on its way.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from colls.errors import BackendError, CollsError, NetworkError
from colls_plugins.tcp._frames import ACCEPT, DECLINE, Hello
from colls_plugins.tcp._peer import Peer
from colls_plugins.tcp.connections import Connection, Mesh, peer_name

logger = logging.getLogger("colls.tcp")


class Links:
    """Connections of one rank: those given at construction plus those opened on demand.

    Args:
        rank: this rank's group rank.
        connections: connections that exist already (a fixed mesh, e.g. over socketpairs).
        mesh: the listener and handshake of a lazily connected group; None: no more peers
            than ``connections`` (dialling another rank is a BackendError).
        timeout: seconds a connection may take to open (the group timeout).
        on_new: called with each new peer, under the lock, before anyone can use it (the
            engine makes the socket non-blocking and registers it with its selector).
        abandon: returns why to stop dialling (the group broke or closed), or None.
    """

    def __init__(
        self, rank: int, connections: dict[int, Connection], mesh: Mesh | None, timeout: float,
        on_new: Callable[[Peer], None], abandon: Callable[[], BaseException | None],
    ) -> None:
        self.rank = rank
        self.mesh = mesh
        self.timeout = timeout
        self.peers: dict[int, Peer] = {r: Peer(c) for r, c in connections.items()}
        self._on_new = on_new
        self._abandon = abandon
        self._cond = threading.Condition()
        self._dialing: set[int] = set()
        self._closed = False

    def start(self) -> None:
        """Hand the peers given at construction to ``on_new`` (once the engine is ready)."""
        with self._cond:
            for peer in self.peers.values():
                self._on_new(peer)

    def snapshot(self) -> list[Peer]:
        """Return the peers connected now."""
        with self._cond:
            return list(self.peers.values())

    def close(self) -> None:
        """Refuse new connections; wake threads waiting for one."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- the dialling side (caller threads) ---------------------------------------------------
    def join(self, *, ring: bool = True) -> None:
        """Publish this rank's address and connect to its two ring neighbours (blocking).

        Every other connection opens when first needed. The ring is opened at once because a
        rank that dies must be seen by someone: its neighbours see its connections drop and
        break the group (colls.health), which every other rank then learns from the store. It
        also makes group creation fail, naming the rank, when a neighbour never comes. Rank
        ``r`` dials ``r - 1`` and waits for ``r + 1`` (modulo the size); of two ranks, rank 1
        dials and rank 0 waits, so each pair is opened from one side. ``ring=False`` (every
        member of the group alike) only publishes: a subgroup of a tcp world, whose ring
        already watches every rank.

        Raises:
            CollsTimeoutError: a neighbour did not publish, connect or answer within the group
                timeout (named).
            NetworkError / BackendError: a connection failed or was refused.
        """
        mesh = self.mesh
        if mesh is None or mesh.world_size == 1:
            return
        deadline = time.monotonic() + self.timeout
        mesh.publish()
        if not ring:
            return
        n = mesh.world_size
        if self.rank > 0 or n > 2:
            self.connect((self.rank - 1) % n, deadline)
        self.wait_for((self.rank + 1) % n, deadline)

    def connect(self, rank: int, deadline: float | None = None) -> Peer:
        """Return the connection to ``rank``, dialling it first when there is none.

        Raises:
            CollsTimeoutError: ``rank`` did not publish, accept or answer in time (named).
            NetworkError / BackendError: the connection failed, or the engine closed.
        """
        if deadline is None:
            deadline = time.monotonic() + self.timeout
        with self._cond:
            while True:
                peer = self._ready(rank)
                if peer is not None:
                    return peer
                if rank not in self._dialing:
                    break
                self._wait(rank, deadline)  # another thread is dialling it
            self._dialing.add(rank)
        try:
            conn = self._mesh(rank).dial(rank, deadline, self._abandon)
        except BaseException:
            with self._cond:
                self._dialing.discard(rank)
                self._cond.notify_all()
            raise
        with self._cond:
            # Leave the dialling set and add the connection at once: between the two, a hello
            # from ``rank`` would find neither and be accepted, and each side would then keep
            # the connection the other closes.
            self._dialing.discard(rank)
            self._cond.notify_all()
            if conn is not None and rank not in self.peers and not self._closed:
                return self._add(conn)
            if conn is not None:  # closed meanwhile (an accepted duplicate cannot happen)
                conn.sock.close()
            while (peer := self._ready(rank)) is None:  # declined: the peer's one is coming
                self._wait(rank, deadline)
            return peer

    def dial_for_send(self, rank: int,
                      on_lost: Callable[[int, BaseException], None] | None) -> Peer:
        """Return the connection to ``rank`` for a send, dialling it first; a failure to reach
        it breaks the group: ``on_lost(rank, error)`` (colls.health's listener) hears of it.

        Raises:
            BackendError: the group is closed or broken.
            NetworkError: ``rank`` never published, accepted or answered (names it).
        """
        refusal = self._abandon()
        if refusal is not None:
            raise refusal
        try:
            return self.connect(rank)
        except CollsError as exc:
            if self._abandon() is not None:
                raise
            # A NetworkError, not the CollsTimeoutError itself: Work.wait() takes a
            # TimeoutError raised by its future for its own timeout.
            error = NetworkError(f"tcp: rank {self.rank} cannot reach rank {rank}: {exc}")
            error.__cause__ = exc
            if on_lost is not None:
                on_lost(rank, error)
            raise error from exc

    def wait_for(self, rank: int, deadline: float) -> Peer:
        """Return the connection to ``rank`` once either side has opened it.

        Raises:
            CollsTimeoutError: no connection within ``deadline`` (names ``rank``).
        """
        with self._cond:
            while (peer := self._ready(rank)) is None:
                self._wait(rank, deadline)
            return peer

    def _ready(self, rank: int) -> Peer | None:
        if self._closed:
            raise BackendError("tcp backend closed")
        return self.peers.get(rank)

    def _wait(self, rank: int, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise self._mesh(rank).timeout_error("no valid connection from", [rank])
        self._cond.wait(remaining)

    def _mesh(self, rank: int) -> Mesh:
        if self.mesh is None:
            raise BackendError(f"tcp: rank {self.rank} has no connection to rank {rank}")
        return self.mesh

    def _add(self, conn: Connection) -> Peer:
        peer = Peer(conn)
        self.peers[conn.rank] = peer
        self._on_new(peer)
        self._cond.notify_all()
        return peer

    # -- the accepting side (progress thread) -------------------------------------------------
    def on_hello(self, sock: socket.socket, hello: Hello) -> None:
        """Answer a checked incoming hello: accept (a new peer), decline, or refuse."""
        mesh = self._mesh(hello.rank)
        with self._cond:
            existing = self.peers.get(hello.rank)
            if self._closed or existing is not None and not (
                existing.dialed and self.rank < hello.rank
            ):
                why = "the backend is closed" if self._closed else "a duplicate connection"
                logger.warning("tcp: rank %d refused a connection from %s: %s of rank %d",
                               self.rank, peer_name(sock), why, hello.rank)
                sock.close()
                return
            mine_wins = self.rank < hello.rank and (
                existing is not None or hello.rank in self._dialing
            )
            verdict = DECLINE if mine_wins else ACCEPT
            try:
                mesh.answer(sock, verdict)
            except OSError as exc:
                logger.warning("tcp: rank %d could not answer rank %d at %s: %s",
                               self.rank, hello.rank, peer_name(sock), exc)
                sock.close()
                return
            if verdict == DECLINE:
                sock.close()
                return
            self._add(Connection(hello.rank, sock, hello.address))
