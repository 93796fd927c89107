"""Holds: a large message nobody receives yet stays in the socket, and its sender is told.

**Holding** (:class:`Holds`, the receiving side). With no receive posted, the engine reads a small
message into a buffer of its own, queued as unexpected, but *holds* a large one
(:data:`HOLD_MIN_BYTES`), collective or user-tagged, and any message once the unexpected ones
fill :data:`~colls_plugins.tcp._matching.MAX_UNEXPECTED_BYTES`: the connection is not read until
a receive is posted, so the sender's kernel buffer fills and its send waits. A rank running
ahead of a slower one, or a flood of sends nobody receives, thus cannot make it buffer without
bound, and the body lands straight in the receive buffer (no extra copy). A receive for another
tag from that rank, or from any rank, turns a held message into an ordinary unexpected one, so
no message can block the stream behind it.

**Leases** (the sending side). While a peer holds a message of this rank unread, its receive
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
:class:`Holds` does both sides' work for one engine, on the engine's :class:`Inbox` (whose lock
guards the held peers).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from colls.matching import MESSAGE_OVERHEAD_BYTES, RecvOp
from colls.sockets import bound_s, bound_unacknowledged, probe_interval_s
from colls_plugins.tcp._frames import HOLD_TAG
from colls_plugins.tcp._matching import MAX_UNEXPECTED_BYTES, Inbox
from colls_plugins.tcp._peer import RX_BODY, RX_HELD, Peer, queue_frame

PeerT = TypeVar("PeerT")

#: A message at least this large that arrives before its receive is posted is held unread.
#: Smaller ones are buffered: holding costs the sender a stall and both sides a wake-up, which
#: only pays for itself on large messages.
HOLD_MIN_BYTES = 1 << 16


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


class Holds:
    """One engine's holds on its peers' messages, and its peers' leases on its own.

    Args:
        rank: this rank (for messages).
        inbox: the engine's matching state; its lock guards ``inbox.held``, and the methods
            that say "lock held" are called under it.
        request_write: has the progress thread send a peer's queued frames.
        fail_peer: ``fail_peer(peer, cause)`` drops a connection (the progress thread).
    """

    def __init__(self, rank: int, inbox: Inbox, request_write: Callable[[Peer], None],
                 fail_peer: Callable[[Peer, str], None]) -> None:
        self._rank = rank
        self._inbox = inbox
        self._request_write = request_write
        self._fail_peer = fail_peer
        self._renewals = Renewals()  # when this rank next renews its holds
        self.leases: Leases[Peer] = Leases()  # peers that hold a message of this rank

    def must_hold(self, src: int, nbytes: int) -> bool:
        """Return whether a message from ``src`` nobody receives yet stays in the socket.

        Never while a receive that could take a later message from ``src`` is posted (or left
        to its waiter, :meth:`Inbox.awaits`): that message may be behind this one on the
        stream (:meth:`release_for` reads past held messages for the same reason). Lock held.
        """
        if nbytes == 0:
            # Nothing to hold back, and a held message is released into a body read, where
            # reading an empty body (recv_into of an empty view returns 0) looks like EOF: the
            # connection was lost when the unexpected messages filled their budget.
            return False
        table = self._inbox.table
        if nbytes < HOLD_MIN_BYTES:
            buffered = table.unexpected_bytes + nbytes + MESSAGE_OVERHEAD_BYTES
            if buffered <= MAX_UNEXPECTED_BYTES:
                return False
        return not self._inbox.awaits(src)

    def hold(self, peer: Peer, tag: int, nbytes: int) -> None:
        """Leave the body of ``peer``'s message unread until its receive is posted (lock held)."""
        peer.held_tag, peer.held_nbytes = tag, nbytes
        peer.rx_mode = RX_HELD
        held = self._inbox.held
        self._renewals.started(holding_before=bool(held))
        held.add(peer)
        self._tell(peer, 1)

    def release_for(self, op: RecvOp) -> tuple[bool, list[Peer]]:
        """Let receive ``op`` take a held message, or release those that could block it.

        A held message from ``op``'s source with ``op``'s tag and size is bound to ``op``: its
        body is read straight into ``op.view``. Any other held message that ``op`` might be
        waiting behind (same source, or any source for an any-source receive) becomes an
        ordinary unexpected message, read into a buffer of its own. Lock held; returns whether
        ``op`` was bound and the peers to read again.
        """
        inbox = self._inbox
        if op.src is None:
            peers = list(inbox.held)
        else:
            peers = [p for p in inbox.held if p.rank == op.src]
        bound = False
        for peer in peers:
            inbox.held.discard(peer)
            self._tell(peer, 0)
            tag, nbytes = peer.held_tag, peer.held_nbytes
            if not bound and tag == op.tag and nbytes == op.view.nbytes:
                bound = True
                peer.rx_op, target = op, op.view
            else:
                peer.rx_msg = inbox.table.add_unexpected(peer.rank, tag, nbytes)
                target = memoryview(peer.rx_msg.buffer)
            peer.rx_view, peer.rx_pos = target, 0
            peer.rx_mode = RX_BODY  # last: a reader checks the mode without the lock
            inbox.count_arrival(peer.rank)
        return bound, peers

    def tick(self) -> None:
        """Renew this rank's holds when due; drop peers whose lease ran out (progress thread)."""
        inbox = self._inbox
        if inbox.held and self._renewals.due():
            with inbox.lock:  # so a renewal never follows the release it would undo
                for peer in inbox.held:
                    self._tell(peer, 1)
        if self.leases.due:
            for peer in self.leases.expired(deaf_to=lambda held: held.rx_mode == RX_HELD):
                self._fail_peer(peer, f"it held a message of rank {self._rank} unread and sent "
                                f"no word for {self.leases.length_s:.0f} s (COLLS_KEEPALIVE_*): "
                                "its host is gone or the link to it is down")

    def on_frame(self, peer: Peer, holding: int) -> None:
        """``peer`` holds a message of ours unread (``holding`` 1) or no longer (0)."""
        if holding:
            self.leases.grant(peer)
        else:
            self.leases.end(peer)
        bound_unacknowledged(peer.sock, on=holding == 0)

    def _tell(self, peer: Peer, holding: int) -> None:
        """Queue a hold frame to ``peer`` (lock held, so the frames leave in the order of the
        changes they announce)."""
        if queue_frame(peer, HOLD_TAG, holding):
            self._request_write(peer)
