"""The store server's listening socket: bound to one address, read only while accepting helps.

Running out of file descriptors (EMFILE, ENFILE) leaves the pending connection in the kernel's
queue, so the listener stays readable and a level-triggered loop would call ``accept`` again at
once, forever, at 100 % CPU, while the clients it already has wait. :class:`Listener` takes
itself out of the selector instead, for :data:`ACCEPT_PAUSE_S` or until the server closes a
connection (which frees a descriptor), whichever comes first.
"""

from __future__ import annotations

import errno
import logging
import resource
import selectors
import socket
import time
from collections.abc import Callable

from colls.errors import NetworkError

logger = logging.getLogger("colls.store")

#: Pending connections the kernel queues for accept (capped by net.core.somaxconn).
LISTEN_BACKLOG = 4096
#: Seconds the listener rests after accept ran out of descriptors or kernel memory: long enough
#: to cost nothing, short enough that a client waiting in the backlog barely notices.
ACCEPT_PAUSE_S = 0.25
#: Connections accepted per readiness event. The loop then reads the handshakes of those it took
#: before taking more, so a burst of thousands of honest clients never counts as thousands of
#: unauthenticated connections at once (the server caps those, evicting the oldest).
ACCEPT_BATCH = 128
#: accept errors that mean "no resources now", not "this one connection failed".
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


#: Descriptors a store host needs beside its clients' connections: its own rank's sockets, shared
#: memory and files, and the interpreter's.
DESCRIPTOR_HEADROOM = 256


def make_room_for(clients: int) -> None:
    """Raise this process's soft limit on open descriptors (RLIMIT_NOFILE) when ``clients``
    connections, plus :data:`DESCRIPTOR_HEADROOM`, would not fit under it.

    A store host holds one connection per client, so a job of a thousand ranks passes the common
    soft limit of 1024 and accept fails (EMFILE) with ranks still outside. The soft limit is
    raised as far as needed, at most to the hard limit, which is the administrator's: a need
    beyond it is logged, naming both.
    """
    needed = clients + DESCRIPTOR_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            logger.warning("TCPStore: cannot raise the open-file limit from %d to %d: %s",
                           soft, target, exc)
            return
    if target < needed:
        logger.warning(
            "TCPStore: %d clients need about %d open files, but the hard limit (ulimit -Hn) "
            "is %d: ranks beyond it wait until they time out; raise it", clients, needed, hard)


def format_address(host: str, port: int) -> str:
    """Return ``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_listener(host: str, port: int) -> socket.socket:
    """Return a non-blocking listening socket bound to ``host``:``port`` only.

    Raises:
        NetworkError: the address cannot be resolved or bound (names host:port).
    """
    address = format_address(host, port)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise NetworkError(f"TCPStore {address}: cannot resolve host {host!r}: {exc}") from exc
    family, type_, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise NetworkError(f"TCPStore {address}: cannot listen: {exc}") from exc
    return sock


class Listener:
    """A bound listening socket that pauses itself while accepting cannot succeed.

    Args:
        host, port: the address to bind (port 0: the OS picks; read it from :attr:`sock`).
        selector: the server loop's selector; the listener registers itself there.
        on_ready: called by the loop when connections are waiting (it calls :meth:`accept`).
    """

    def __init__(self, host: str, port: int, selector: selectors.BaseSelector,
                 on_ready: Callable[[], None]) -> None:
        self.sock = bind_listener(host, port)
        self._selector = selector
        self._on_ready = on_ready
        self._registered = False
        #: When a pause ends (monotonic seconds); None while listening.
        self.resume_at: float | None = None

    def start(self) -> None:
        """Start listening through the selector."""
        self._selector.register(self.sock, selectors.EVENT_READ, self._on_ready)
        self._registered = True

    def accept(self, address: str) -> tuple[socket.socket, tuple] | None:
        """Return the next waiting (socket, peer address), or None if there is none now.

        Out of descriptors or kernel memory, the listener pauses (see the module docstring) and
        logs why, naming the server ``address``.
        """
        try:
            return self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            if exc.errno in _EXHAUSTED:
                logger.error("TCPStore %s: accept failed: %s; not accepting for %.2f s or until "
                             "a connection closes", address, exc, ACCEPT_PAUSE_S)
                self._pause()
            else:  # the one connection failed (ECONNABORTED, ...): the next may not
                logger.warning("TCPStore %s: accept failed: %s", address, exc)
            return None

    def _pause(self) -> None:
        if self._registered:
            self._selector.unregister(self.sock)
            self._registered = False
        self.resume_at = time.monotonic() + ACCEPT_PAUSE_S

    def resume(self) -> None:
        """Listen again now, if paused (called when a connection closes)."""
        if self.resume_at is not None and not self._registered:
            self.resume_at = None
            self.start()

    def resume_if_due(self) -> None:
        """Listen again if the pause has run out."""
        if self.resume_at is not None and time.monotonic() >= self.resume_at:
            self.resume()

    def close(self) -> None:
        """Stop listening and close the socket (the selector may already be closed)."""
        self._registered = False
        self.sock.close()


__all__ = [
    "ACCEPT_BATCH",
    "ACCEPT_PAUSE_S",
    "LISTEN_BACKLOG",
    "Listener",
    "bind_listener",
    "format_address",
]
