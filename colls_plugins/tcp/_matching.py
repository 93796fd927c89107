"""The tcp engine's receive matching: colls' own queues (:mod:`colls.matching`) and their state.

The queues were written here first and moved to the core so that every backend can use them
(:class:`colls.backend.Matcher`); the names stay importable from here for the tests.

:class:`Inbox` is what every path that matches a message shares: the socket reader and
``irecv`` (:mod:`~colls_plugins.tcp.engine`), the host peers' rings
(:mod:`~colls_plugins.tcp.host_peers`) and the holds (:mod:`~colls_plugins.tcp._holds`) match
against one table, under one lock, and refuse work by one rule. The engine makes it and passes it
to each of them.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from colls.errors import BackendError
from colls.matching import MatchTable as MatchTable
from colls.matching import Message as Message
from colls.matching import RecvOp as RecvOp
from colls.matching import size_error
from colls_plugins.tcp._mismatch import Tracker

if TYPE_CHECKING:
    from colls_plugins.tcp._peer import Peer

#: Most bytes that unexpected messages (bodies plus matching.MESSAGE_OVERHEAD_BYTES each) may
#: hold; a message that would pass it waits in the socket (:mod:`~colls_plugins.tcp._holds`) or
#: in its ring like a large one. A few receives' worth of small messages, so latency-bound
#: exchanges never stall on it. One thing passes it: a socket message from a host peer moves
#: that peer's ring entries sent before it into the queue first (their order), so the queue may
#: hold one ring's entries more per host peer: up to the ring's bytes of small messages, and the
#: large messages that remote entries announce (host_peers.HostPeers.drain).
MAX_UNEXPECTED_BYTES = 16 << 20

#: What a matching step leaves to complete once the lock is released: each receive with its
#: source rank, or with the exception it fails with.
Completions = list[tuple[RecvOp, Any]]


class Inbox:
    """The match table, the lock that guards it and the state that refuses new receives.

    Attributes, all guarded by ``lock`` (a flag may be read without it where a stale answer is
    harmless, as the docstrings of its readers say):
        table: posted receives and unexpected messages.
        tracker: the mismatched-collective detector (:mod:`~colls_plugins.tcp._mismatch`).
        arrivals: socket messages per rank that reached the table (:meth:`count_arrival`).
        held: peers whose next message is held unread in the socket (``_holds``).
        deferred: receives left to their waiters, not posted, per (source, tag), in the order
            they were made (:mod:`~colls_plugins.tcp._deferred`).
        closed: the engine was closed. broken: why the group is broken, or None.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.table = MatchTable()
        self.tracker = Tracker()
        self.arrivals: dict[int, int] = {}
        self.held: set[Peer] = set()
        self.deferred: dict[tuple[int, int], deque[Any]] = {}
        self.closed = False
        self.broken: BackendError | None = None

    def refusal(self) -> BackendError | None:
        """Return why no new work is taken (closed or broken), or None."""
        if self.closed:
            return BackendError("tcp backend closed")
        return self.broken

    def awaits(self, src: int) -> bool:
        """Whether a receive posted or left to its waiter accepts some message from ``src``
        (lock held): then a message from ``src`` is never held back or left in its ring for
        want of room, since the one the receive waits for may be behind it."""
        return self.table.awaits(src) or any(key[0] == src for key in self.deferred)

    def count_arrival(self, src: int) -> None:
        """Count a socket message from ``src`` that reached the match table (lock held).

        Counted for every rank from the start, before the host's memory is attached: a host
        peer that attached first may already have sent over the socket, and its ring entries
        count those messages too (:mod:`colls_plugins.tcp.shm.p2p`, "Order").
        """
        self.arrivals[src] = self.arrivals.get(src, 0) + 1


def wrong_size(op: RecvOp, src: int, nbytes: int) -> BackendError:
    """Return the error of receive ``op`` matched by a message of ``nbytes`` from ``src``."""
    return size_error(op.work.description, src, op.tag, nbytes, op.view.nbytes)


def finish(done: Completions) -> None:
    """Complete the receives a matching step collected (no lock held)."""
    for op, value in done:
        if isinstance(value, BaseException):
            op.work.set_exception(value)
        else:
            op.work.set_result(value)
