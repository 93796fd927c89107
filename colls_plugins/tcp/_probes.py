"""Fail-fast probes: a collective receive pending too long asks its peer what it is doing.

:class:`~colls_plugins.tcp._mismatch.Tracker` decides when a probe is due and what an arriving
probe proves (:mod:`~colls_plugins.tcp._mismatch` explains the rule); :class:`Probes` sends the
header-only ``(PROBE_TAG, expected tag)`` frames and answers the peers' own. A probe to a rank
this rank only receives from needs a connection first: dialling blocks, so it runs on a thread
of its own, never on the progress thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from colls.errors import BackendError, CollsError
from colls_plugins.tcp._matching import Inbox
from colls_plugins.tcp._mismatch import PROBE_AFTER_S, PROBE_TAG, probe_field
from colls_plugins.tcp._peer import Peer, queue_frame

logger = logging.getLogger("colls.tcp")


class Probes:
    """The probes of one engine (the progress thread).

    Args:
        rank: this rank (for logs and thread names).
        inbox: the engine's matching state (its table and tracker, under its lock).
        peers: the connections by rank (read without a lock).
        connect: dials a rank (``Links.connect``), or None for a group with no listener.
        flush: writes a peer's send queue now (the progress thread's own flush).
    """

    def __init__(self, rank: int, inbox: Inbox, peers: Mapping[int, Peer],
                 connect: Callable[[int], Peer] | None, flush: Callable[[Peer], None]) -> None:
        self._rank = rank
        self._inbox = inbox
        self._peers = peers
        self._connect = connect
        self._flush = flush

    def timeout(self) -> float:
        """Seconds the progress thread may sleep: until the next probe, at most PROBE_AFTER_S.

        The bound lets a receive posted while the thread sleeps get its probe in time without
        waking the thread (an idle engine wakes twice a second: no measurable CPU).
        """
        due = self._inbox.tracker.next_probe
        if due is None:
            return PROBE_AFTER_S
        return min(PROBE_AFTER_S, max(0.0, due - time.monotonic()))

    def send_due(self) -> None:
        """Ask peers about collective receives pending too long."""
        inbox = self._inbox
        if inbox.tracker.next_probe is None:
            return
        with inbox.lock:
            due = inbox.tracker.due_probes(time.monotonic(), inbox.table)
        for src, tag in due:
            peer = self._peers.get(src)
            if peer is not None:
                self._send(peer, tag)
            elif self._connect is not None:  # dialling blocks: not on the progress thread
                threading.Thread(target=self._dial_and_probe, args=(src, tag),
                                 name=f"colls-tcp-probe:{self._rank}", daemon=True).start()

    def on_probe(self, peer: Peer, expected: int) -> None:
        """``peer`` probed: it waits for a message of tag ``expected`` from this rank."""
        inbox = self._inbox
        with inbox.lock:
            stale, conflict, answer = inbox.tracker.on_probe(peer.rank, expected, inbox.table)
        for op in stale:
            op.work.set_exception(BackendError(f"{op.work.description}: {conflict}"))
        if answer is not None:
            self._send(peer, answer)  # the prober learns of the conflict too

    def _dial_and_probe(self, src: int, tag: int) -> None:
        """Connect to ``src``, which this rank only receives from, to probe it (own thread)."""
        assert self._connect is not None
        try:
            peer = self._connect(src)
        except CollsError as exc:  # the receive itself fails by timeout or the broken group
            logger.info("tcp: rank %d could not probe rank %d: %s", self._rank, src, exc)
            return
        self._send(peer, tag)

    def _send(self, peer: Peer, tag: int) -> None:
        if queue_frame(peer, PROBE_TAG, probe_field(tag)):
            self._flush(peer)
