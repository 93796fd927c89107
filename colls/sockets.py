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
computation, a debugger) is never mistaken for a vanished host.
"""

from __future__ import annotations

import contextlib
import socket

from colls import env


def enable_keepalive(sock: socket.socket) -> None:
    """Turn keepalive on for TCP socket ``sock``, timed by the ``COLLS_KEEPALIVE_*`` settings.

    Options the platform lacks are skipped (SO_KEEPALIVE alone then uses the system's timing).

    Raises:
        ValueError: a ``COLLS_KEEPALIVE_*`` variable is malformed (the message names it).
    """
    idle = int(env.get("COLLS_KEEPALIVE_IDLE"))
    interval = int(env.get("COLLS_KEEPALIVE_INTERVAL"))
    count = int(env.get("COLLS_KEEPALIVE_COUNT"))
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (
        ("TCP_KEEPIDLE", idle),
        ("TCP_KEEPINTVL", interval),
        ("TCP_KEEPCNT", count),
        # Data unacknowledged this long drops the connection too (keepalive only probes an
        # idle one); in milliseconds.
        ("TCP_USER_TIMEOUT", (idle + interval * count) * 1000),
    ):
        option = getattr(socket, name, None)
        if option is not None:
            options.append((socket.IPPROTO_TCP, option, value))
    for level, option, value in options:
        with contextlib.suppress(OSError):  # e.g. a socket that is already closed by its peer
            sock.setsockopt(level, option, value)
