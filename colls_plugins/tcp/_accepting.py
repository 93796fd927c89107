"""Accepting peers' connections on a lazily connected group's listener (the progress thread).

A rank of a lazy group (:class:`~colls_plugins.tcp.connections.Mesh`) keeps its listener open
for the group's life; its progress thread accepts each connection, reads the peer's hello (after
the auth exchange when there is a token) without ever blocking, and hands a checked hello to
:meth:`Links.on_hello <colls_plugins.tcp._links.Links.on_hello>`, which answers and adds the
peer. A connection with no valid hello within ``COLLS_HANDSHAKE_TIMEOUT`` is dropped, a refused
one closed and logged (connections.py, "Let no one in").
"""

from __future__ import annotations

import logging
import selectors
import socket
import time
from collections.abc import Callable

from colls_plugins.tcp._frames import Hello, HelloError
from colls_plugins.tcp._poller import Poller
from colls_plugins.tcp.connections import Incoming, Mesh, peer_name

logger = logging.getLogger("colls.tcp")


class Acceptor:
    """The handshakes in progress on ``mesh``'s listener, watched by ``poller``.

    Args:
        rank: this rank (for logs).
        mesh: the listener and the handshake rules.
        poller: the progress thread's selector; the listener's events carry ``mesh``, a
            handshake's its :class:`~colls_plugins.tcp.connections.Incoming` state.
        on_hello: called with a socket and its checked hello (``Links.on_hello``).
    """

    def __init__(self, rank: int, mesh: Mesh, poller: Poller,
                 on_hello: Callable[[socket.socket, Hello], None]) -> None:
        self._rank = rank
        self._mesh = mesh
        self._poller = poller
        self._on_hello = on_hello
        self._incoming: dict[socket.socket, Incoming] = {}
        mesh.listener.setblocking(False)
        poller.register(mesh.listener, mesh)

    def on_event(self, key: selectors.SelectorKey) -> None:
        """Accept a connection on the listener, or read a hello on an accepted one."""
        if key.data is self._mesh:
            accepted = self._mesh.accept()
            if accepted is not None:
                sock, state = accepted
                self._incoming[sock] = state
                self._poller.register(sock, state)
            return
        sock = key.fileobj
        assert isinstance(sock, socket.socket)
        try:
            hello = self._mesh.read_hello(sock, key.data)
        except (HelloError, OSError) as exc:
            logger.warning("tcp: rank %d refused a connection from %s: %s",
                           self._rank, peer_name(sock), exc)
            self._end(sock)
            sock.close()
            return
        if hello is not None:
            self._end(sock)
            self._on_hello(sock, hello)

    def timeout(self, timeout: float) -> float:
        """Return ``timeout`` cut to when the first handshake in progress runs out."""
        if not self._incoming:
            return timeout
        first = min(state.deadline for state in self._incoming.values())
        return min(timeout, max(0.0, first - time.monotonic()))

    def drop_half_open(self) -> None:
        """Close connections that sent no valid hello within COLLS_HANDSHAKE_TIMEOUT."""
        if not self._incoming:
            return
        now = time.monotonic()
        for sock, state in list(self._incoming.items()):
            if state.deadline <= now:
                logger.warning("tcp: rank %d dropped a half-open connection from %s: no valid "
                               "hello within %.1f s", self._rank, peer_name(sock),
                               self._mesh.handshake_s)
                self._end(sock)
                sock.close()

    def close(self) -> None:
        """Close every handshake in progress and the listener (after the progress thread)."""
        for sock in list(self._incoming):
            sock.close()
        self._incoming.clear()
        self._mesh.close()

    def _end(self, sock: socket.socket) -> None:
        self._poller.unregister(sock)
        del self._incoming[sock]
