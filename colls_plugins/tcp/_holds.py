"""Leases on held messages: a peer that holds our message unread must keep saying so.

While a peer holds a message of this rank unread (:mod:`colls_plugins.tcp.engine`), its receive
window stays closed and this rank's kernel keeps the rest of the message queued. Linux would drop
such a connection once ``TCP_USER_TIMEOUT`` passes, even though the peer answers every probe, so
the holder announces the hold with a ``HOLD_TAG`` frame and the sender lifts the bound
(:func:`colls.sockets.bound_unacknowledged`). Lifting it also lifts the only kernel bound left on
that connection: keepalive never probes a connection with data queued, and window probes go on
for many minutes. A holder whose host vanished mid-hold would never send its release frame, and
the sender would wait for the group timeout.

So the lift is a lease. The holder renews it with another hold frame every
``COLLS_KEEPALIVE_INTERVAL`` seconds for as long as the hold lasts; the sender drops the connection
when a lease runs a whole keepalive bound (idle + interval x count, :func:`colls.sockets.bound_s`)
without renewal or release. One case cannot be judged: while this rank itself holds a message
from the same peer it does not read that connection, so it cannot hear the renewals; the lease is
then extended, and the group timeout stays the last word.

:class:`Leases` is the sender's side; :class:`Renewals` times the holder's frames. Both are
touched by whichever thread reads the sockets and by the progress thread, so each guards itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from colls.sockets import bound_s, probe_interval_s

PeerT = TypeVar("PeerT")


class Leases(Generic[PeerT]):
    """When each peer that holds a message of ours must be heard from next (sender's side)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: When each leasing peer must be heard from next. Read without the lock only to see
        #: whether it is empty (the progress loop's check, once per wake-up).
        self.due: dict[PeerT, float] = {}
        self.length_s = bound_s()

    def grant(self, peer: PeerT) -> None:
        """``peer`` started or renewed a hold: it must renew again within :attr:`length_s`."""
        with self._lock:
            self.due[peer] = time.monotonic() + self.length_s

    def end(self, peer: PeerT) -> None:
        """``peer`` released its hold, or its connection is gone."""
        with self._lock:
            self.due.pop(peer, None)

    def expired(self, deaf_to: Callable[[PeerT], bool]) -> list[PeerT]:
        """Remove and return the peers whose lease ran out.

        A peer for which ``deaf_to(peer)`` is true (this rank does not read its connection now)
        gets a new lease instead: its renewals cannot have arrived.
        """
        now = time.monotonic()
        lapsed: list[PeerT] = []
        with self._lock:
            for peer, due in list(self.due.items()):
                if due > now:
                    continue
                if deaf_to(peer):
                    self.due[peer] = now + self.length_s
                else:
                    del self.due[peer]
                    lapsed.append(peer)
        return lapsed


class Renewals:
    """When the holder next renews its holds (holder's side; the caller guards the held set)."""

    def __init__(self) -> None:
        self.interval_s = probe_interval_s()
        self._next = 0.0

    def started(self, holding_before: bool) -> None:
        """A hold started; the first renewal comes one interval after the first hold."""
        if not holding_before:
            self._next = time.monotonic() + self.interval_s

    def due(self) -> bool:
        """Return whether the holds should be renewed now, and if so plan the next renewal."""
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.interval_s
        return True
