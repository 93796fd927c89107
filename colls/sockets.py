"""TCP keepalive for every store and mesh connection, so a host that vanishes is noticed.

A host that disappears without a reset (power off, cable pulled, a partition) sends nothing more:
without keepalive a connection that waits for it stays open until some timeout runs out, and one
with unacknowledged data retransmits for about 15 minutes. :func:`enable_keepalive` makes the
kernel probe an idle connection after ``COLLS_KEEPALIVE_IDLE`` seconds, every
``COLLS_KEEPALIVE_INTERVAL`` seconds, and drop it after ``COLLS_KEEPALIVE_COUNT`` unanswered
probes; ``TCP_USER_TIMEOUT`` gives data left unacknowledged the same bound. The defaults (5 s,
2 s, 5) notice a silent peer within about 15 s. A dropped connection then fails like any broken
one: a read or write raises ``TimeoutError`` (ETIMEDOUT), which the store and the tcp backend
turn into a :class:`~colls.errors.NetworkError` naming the peer.

A peer that is alive answers probes from its kernel, so a slow or stopped program (a long
computation, a debugger) is never mistaken for a vanished host, with one exception that
:func:`bound_unacknowledged` exists for: Linux drops a connection whose peer keeps its receive
window closed longer than ``TCP_USER_TIMEOUT``, even while the peer answers every probe. The tcp
engine closes the window on purpose when it holds a large message unread, so it tells the sender,
which lifts the bound on that connection until the hold ends; the holder renews that lift every
keepalive interval, and a lift that is not renewed within the bound counts as a vanished host
(:mod:`colls_plugins.tcp._holds`).
"""

from __future__ import annotations

import contextlib
import socket

from colls import env


def _timing() -> tuple[int, int, int]:
    """Return (idle, interval, count) from the ``COLLS_KEEPALIVE_*`` settings."""
    return (
        int(env.get("COLLS_KEEPALIVE_IDLE")),
        int(env.get("COLLS_KEEPALIVE_INTERVAL")),
        int(env.get("COLLS_KEEPALIVE_COUNT")),
    )


def bound_s() -> float:
    """Seconds after which a silent peer counts as vanished: idle + interval x count."""
    idle, interval, count = _timing()
    return float(idle + interval * count)


def probe_interval_s() -> float:
    """Seconds between two keepalive probes (``COLLS_KEEPALIVE_INTERVAL``)."""
    return float(_timing()[1])


def bound_unacknowledged(sock: socket.socket, on: bool) -> None:
    """Drop ``sock`` when sent data stays unacknowledged for the keepalive bound, or stop doing so.

    ``on=False`` is for a connection whose peer said it keeps its window closed on purpose (a held
    message). Nothing in the kernel watches such a connection any more (keepalive does not probe
    one with data queued), so whoever lifts the bound must watch the peer itself
    (:mod:`colls_plugins.tcp._holds`).
    """
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    if option is None:
        return
    milliseconds = int(bound_s() * 1000) if on else 0
    with contextlib.suppress(OSError):  # e.g. a socket that is already closed by its peer
        sock.setsockopt(socket.IPPROTO_TCP, option, milliseconds)


def enable_keepalive(sock: socket.socket) -> None:
    """Turn keepalive on for TCP socket ``sock``, timed by the ``COLLS_KEEPALIVE_*`` settings.

    Options the platform lacks are skipped (SO_KEEPALIVE alone then uses the system's timing).

    Args:
        sock: a TCP socket (connected, or a listener whose accepted sockets inherit the options).

    Raises:
        ValueError: a ``COLLS_KEEPALIVE_*`` variable is malformed (the message names it).
    """
    idle, interval, count = _timing()
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    timing = (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count))
    for name, value in timing:
        option = getattr(socket, name, None)
        if option is not None:
            options.append((socket.IPPROTO_TCP, option, value))
    for level, option, value in options:
        with contextlib.suppress(OSError):  # e.g. a socket that is already closed by its peer
            sock.setsockopt(level, option, value)
    bound_unacknowledged(sock, True)  # keepalive only probes a connection with nothing in flight
