"""Reading peers' sockets: the receive state machine of each connection, frame by frame.

A connection's receive half (``Peer.rx_*``, :mod:`~colls_plugins.tcp._peer`) is in one of four
states: reading a 16-byte header, reading a body into the memory chosen for it, discarding a
body whose receive failed, or holding (a header was read whose body waits unread, ``_holds``).
:class:`Reader` moves the bytes; what a complete header or body means is the engine's
(``on_header``, ``on_body``): matching, control frames, failure. One thread reads at a time:
the progress thread, or a waiter polling before it sleeps (:meth:`Reader.poll`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence

from colls.work import Work
from colls_plugins.tcp._frames import HEADER
from colls_plugins.tcp._peer import RX_BODY, RX_DRAIN, RX_HELD, Peer

#: At most this many ``recv_into`` calls per readiness event, so one busy peer cannot starve
#: the others (the selector is level-triggered and reports it again).
READ_BUDGET = 64

#: Size of the scratch buffer that discards the body of a message whose receive failed.
DRAIN_CHUNK_BYTES = 1 << 20

#: How long a thread about to wait for a receive reads the sockets itself (seconds), and how
#: many polls it makes between two ``sched_yield`` calls.
CALLER_POLL_SECONDS = 0.0002
CALLER_POLLS_PER_YIELD = 8


class Reader:
    """Reads connections into their receive state, one thread at a time (:attr:`lock`).

    Args:
        on_header: ``on_header(peer, tag, nbytes)``: a header is in; it sets the peer's next
            state (a body, holding, or the next header).
        on_body: ``on_body(peer)``: the body being read is all in.
        fail_peer: ``fail_peer(peer, cause)`` drops a broken connection (progress thread).
    """

    def __init__(self, on_header: Callable[[Peer, int, int], None],
                 on_body: Callable[[Peer], None], fail_peer: Callable[[Peer, str], None]
                 ) -> None:
        self._on_header = on_header
        self._on_body = on_body
        self._fail_peer = fail_peer
        self._scratch: memoryview | None = None
        #: Held by whichever thread reads the sockets.
        self.lock = threading.Lock()

    def poll(self, work: Work, peers: Sequence[Peer], poll_rings: Callable[[], object] | None,
             seconds: float = CALLER_POLL_SECONDS) -> None:
        """Read ``peers`` on the calling thread until ``work`` completes or ``seconds`` pass.

        A thread about to wait for a receive calls this first: when the message comes within
        the budget, it is read and completed right here, without waking the progress thread
        and then the waiter (two scheduler wake-ups and GIL hand-offs per message). Only one
        thread reads at a time (:attr:`lock`); a connection error is left to the progress
        thread to report. ``poll_rings``: also look at the host peers' rings.
        """
        deadline = time.perf_counter() + seconds
        polls = 0
        while not work.is_completed():
            if poll_rings is not None:
                poll_rings()
            if self.lock.acquire(blocking=False):
                try:
                    for peer in peers:
                        if peer.dead is None:
                            self.read(peer, caller=True)
                finally:
                    self.lock.release()
            if work.is_completed() or time.perf_counter() >= deadline:
                return
            polls += 1
            if polls % CALLER_POLLS_PER_YIELD == 0:
                os.sched_yield()  # ranks may outnumber cores: let the sender run

    def read(self, peer: Peer, *, caller: bool = False) -> int:
        """Read what ``peer``'s socket holds, a bounded number of calls (:attr:`lock` held).

        Returns the bytes read. ``caller``: a waiting thread polls (``Engine.poll_until``); it
        leaves errors and EOF to the progress thread, which sees them again on its next read.
        """
        total = 0
        for _ in range(READ_BUDGET):
            if peer.rx_mode == RX_HELD:
                return total
            try:
                if peer.rx_mode == RX_DRAIN:
                    scratch = self._scratch_view()
                    n = peer.sock.recv_into(scratch[: min(peer.rx_left, len(scratch))])
                else:
                    n = peer.sock.recv_into(peer.rx_view[peer.rx_pos :])
            except BlockingIOError:
                return total
            except OSError as exc:
                if not caller:
                    self._fail_peer(peer, str(exc) or type(exc).__name__)
                return total
            if n == 0:
                if not caller:
                    self._fail_peer(peer, "peer closed the connection")
                return total
            total += n
            self._advance(peer, n)
            if peer.dead is not None:
                return total
        return total

    def _scratch_view(self) -> memoryview:
        if self._scratch is None:
            self._scratch = memoryview(bytearray(DRAIN_CHUNK_BYTES))
        return self._scratch

    def _advance(self, peer: Peer, n: int) -> None:
        if peer.rx_mode == RX_DRAIN:
            peer.rx_left -= n
            if peer.rx_left == 0:
                peer.reset_rx()
            return
        peer.rx_pos += n
        if peer.rx_pos < len(peer.rx_view):
            return
        if peer.rx_mode == RX_BODY:
            self._on_body(peer)
            return
        tag, nbytes = HEADER.unpack(peer.rx_header)
        self._on_header(peer, tag, nbytes)
