"""The progress thread's half of the tcp engine: its loop, what arrives on the sockets, and
failure and shutdown.

:class:`EngineProgress` is mixed into :class:`~colls_plugins.tcp.engine.Engine`, which keeps the
callers' half (posting sends and receives, the host peers' rings, refusals). The state is the
engine's, set up by its constructor; the attributes this half reads are declared below.

* The loop (:meth:`EngineProgress._run`) sleeps in ``select()`` on the poller
  (:mod:`~colls_plugins.tcp._poller`): it reads each readable peer through the receive state
  machine (:mod:`~colls_plugins.tcp._reading`), which calls back :meth:`~EngineProgress._on_header`
  and :meth:`~EngineProgress._finish_body`: a body goes straight into the matching receive's
  memory, into a buffer queued as unexpected, or stays in the socket
  (:mod:`~colls_plugins.tcp._holds`). It flushes each writable peer's send queue, sends the
  fail-fast probes that are due (:mod:`~colls_plugins.tcp._probes`) and moves the host peers'
  rings along.
* Failure: any OSError or EOF on a connection marks that peer dead and fails, with a
  :class:`~colls.errors.NetworkError` naming the rank and address, every pending send to it,
  every pending receive from it and (unless the peer left in an orderly way) every pending
  any-source receive; later operations with a dead peer fail at once. An exception escaping the
  loop fails all pending work. :meth:`~EngineProgress.close` fails whatever is still pending
  with ``BackendError("tcp backend closed")``; :meth:`~EngineProgress.abort` (a broken group)
  fails it with the group's error.
"""

from __future__ import annotations

import logging
import selectors
import threading
from collections.abc import Callable
from typing import Any

from colls.errors import BackendError, NetworkError
from colls.matching import MatchTable, Message, RecvOp
from colls.work import Work
from colls_plugins.tcp._accepting import Acceptor
from colls_plugins.tcp._frames import GOODBYE_TAG, HEADER, HOLD_TAG
from colls_plugins.tcp._holds import Holds
from colls_plugins.tcp._links import Links
from colls_plugins.tcp._matching import Completions, Inbox, finish, wrong_size
from colls_plugins.tcp._mismatch import PROBE_TAG, probed_tag
from colls_plugins.tcp._peer import RX_BODY, RX_DRAIN, RX_HELD, SEND_FLAGS, Peer, write_queue
from colls_plugins.tcp._poller import Poller
from colls_plugins.tcp._probes import Probes
from colls_plugins.tcp._reading import CALLER_POLL_SECONDS, Reader
from colls_plugins.tcp.connections import Mesh
from colls_plugins.tcp.host_peers import HostPeers

logger = logging.getLogger("colls.tcp")

#: Seconds close() waits for the progress thread to exit.
JOIN_TIMEOUT_SECONDS = 10.0

_GOODBYE = HEADER.pack(GOODBYE_TAG, 0)


class EngineProgress:
    """The progress thread's side of :class:`~colls_plugins.tcp.engine.Engine` (see the module
    docstring): the engine's constructor sets the state below and starts :meth:`_run`."""

    rank: int
    _mesh: Mesh | None
    _inbox: Inbox
    _lock: threading.Lock
    _table: MatchTable
    _refusal: Callable[[], BackendError | None]
    _on_peer_lost: Callable[[int, BaseException], None] | None
    _abrupt: NetworkError | None
    _max_message: int
    _thread: threading.Thread | None
    _reader: Reader
    _poller: Poller | None
    _acceptor: Acceptor | None
    _links: Links
    _peers: dict[int, Peer]
    _hosts: HostPeers
    _channel_for: Callable[[int], Any]
    _holds: Holds
    _probes: Probes
    _all_gone: Callable[[], bool]
    _complete_from: Callable[[RecvOp, Message], None]

    # -- fail-fast hooks (colls.health) and shutdown -------------------------------------------
    def peer_error(self, rank: int) -> BaseException | None:
        """Return why waiting for ``rank`` is pointless (closed, broken, peer lost), or None.

        Used by the shared-memory collectives, which learn of a dead peer from its connection.
        They call it while they sleep, so it also moves ring entries into the match table: a
        host peer blocked in a send this rank is to read from its memory (shm_remote) must not
        wait for this rank's collective to end, which may need that peer.
        """
        self._hosts.poll()
        refusal = self._refusal()
        if refusal is not None:
            return refusal
        peer = self._peers.get(rank)
        return peer.dead if peer is not None else None

    def set_failure_listener(self, callback: Callable[[int, BaseException], None]) -> None:
        """Call ``callback(rank, error)`` (progress thread) when a peer vanishes abruptly."""
        self._on_peer_lost = callback

    def abort(self, error: BackendError) -> None:
        """Fail every pending operation with ``error`` and refuse new ones. Idempotent.

        The group is broken: connections stay open (peers learn the cause from colls.health,
        not from a dropped connection) until close(). Buffers of failed receives are undefined.
        """
        inbox = self._inbox
        with inbox.lock:
            if inbox.closed or inbox.broken is not None:
                return
            inbox.broken = error
            pending: list[Any] = self._table.remove_all()
            peers = self._links.snapshot()
            for peer in peers:
                pending.extend(self._rx_pending(peer))
        for peer in peers:
            with peer.send_lock:
                pending.extend(peer.send_queue)
        for op in pending:
            op.work.set_exception(error)

    def close(self) -> None:
        """Stop the thread, say goodbye to peers, close sockets, fail pending work. Idempotent."""
        inbox = self._inbox
        with inbox.lock:
            if inbox.closed:
                return
            inbox.closed = True
        if self._thread is not None:
            assert self._poller is not None
            self._poller.wake()
            self._thread.join(JOIN_TIMEOUT_SECONDS)
            if self._thread.is_alive():
                logger.warning("tcp: progress thread %s did not exit", self._thread.name)
        closed = BackendError("tcp backend closed")
        works = [op.work for op in self._release_all(goodbye=True)]
        if self._poller is not None:
            self._poller.close()
        for work in works:
            work.set_exception(closed)

    # --------------------------------------------------------------------------- the loop
    def _run(self) -> None:
        poller = self._poller
        assert poller is not None
        inbox, hosts, acceptor, reader = self._inbox, self._hosts, self._acceptor, self._reader
        try:
            while not inbox.closed:
                self._probes.send_due()
                self._holds.tick()
                for key, mask in poller.select(self._select_timeout()):
                    peer = key.data
                    if peer is None:  # the wake-up socket
                        for writer in poller.take_writers():
                            self._flush(writer)
                        continue
                    if not isinstance(peer, Peer):
                        assert acceptor is not None  # only a lazy group registers handshakes
                        acceptor.on_event(key)
                        continue
                    if mask & selectors.EVENT_WRITE and peer.dead is None:
                        self._flush(peer)
                    if mask & selectors.EVENT_READ and peer.dead is None:
                        with reader.lock:
                            reader.read(peer)
                        if peer.rx_mode == RX_HELD:
                            poller.sync_read_interest(peer)
                if acceptor is not None:
                    acceptor.drop_half_open()
                hosts.progress()
        except BaseException as exc:  # never die silently: fail everything pending
            self._crash(exc)

    def _select_timeout(self) -> float:
        """Sleep until the next probe is due, the rings need a look or a handshake times out."""
        timeout = self._hosts.timeout(self._probes.timeout())
        if self._acceptor is not None:
            timeout = self._acceptor.timeout(timeout)
        return timeout

    def _crash(self, exc: BaseException) -> None:
        logger.exception("tcp: progress thread of rank %d failed", self.rank)
        error = BackendError(f"tcp: progress thread of rank {self.rank} failed: {exc!r}")
        error.__cause__ = exc
        with self._lock:
            self._inbox.broken = error
        for op in self._release_all(goodbye=False):
            op.work.set_exception(error)

    def _flush(self, peer: Peer) -> None:
        """Write as much of ``peer``'s send queue as the kernel takes (progress thread)."""
        with peer.send_lock:
            if peer.dead is not None:
                return
            finished, error = write_queue(peer, SEND_FLAGS)
            if error is None:
                assert self._poller is not None
                self._poller.set_write_interest(peer, bool(peer.send_queue))
        for op in finished:
            op.work.set_result(None)
        if error is not None:
            self._fail_peer(peer, f"send failed: {error}")

    # --------------------------------------------------------------------------- receiving
    def poll_until(self, work: Work, seconds: float = CALLER_POLL_SECONDS) -> None:
        """Read the sockets (and rings) on the calling thread until ``work`` completes or
        ``seconds`` pass (:meth:`Reader.poll`): a thread about to wait for a receive calls it."""
        if self._thread is not None:
            hosts = self._hosts
            self._reader.poll(work, list(self._peers.values()),
                              hosts.poll if hosts.ranks else None, seconds)

    def _on_header(self, peer: Peer, tag: int, nbytes: int) -> None:
        """Act on a header that just arrived from ``peer`` (the reader's lock held)."""
        if tag == GOODBYE_TAG:
            self._fail_peer(peer, "peer closed its backend", orderly=True)
        elif tag == PROBE_TAG:
            peer.reset_rx()
            self._probes.on_probe(peer, probed_tag(nbytes))
        elif tag == HOLD_TAG:  # the peer holds our message unread (1) or no longer (0)
            peer.reset_rx()
            self._holds.on_frame(peer, nbytes)
        elif nbytes > self._max_message:
            self._fail_peer(peer, f"it announced a message of {nbytes} bytes (tag {tag}), more "
                            f"than COLLS_MAX_MESSAGE_BYTES={self._max_message} allows")
        else:
            self._start_body(peer, tag, nbytes)

    def _start_body(self, peer: Peer, tag: int, nbytes: int) -> None:
        """Route the body of a message whose header just arrived."""
        mismatched = None
        channel = self._channel_for(peer.rank)
        done: Completions = []
        inbox = self._inbox
        holds = self._holds
        with inbox.lock:
            if channel is not None:  # ring entries sent before this message come first
                self._hosts.drain(channel, done, force=True)
            op = self._table.match_arrival(peer.rank, tag)
            stale, conflict = inbox.tracker.on_arrival(peer.rank, tag, op is not None, self._table)
            hold = op is None and not stale and holds.must_hold(peer.rank, nbytes)
            if not hold:
                inbox.count_arrival(peer.rank)
            if hold:
                holds.hold(peer, tag, nbytes)
            elif op is None:
                peer.rx_msg = self._table.add_unexpected(peer.rank, tag, nbytes)
                target = memoryview(peer.rx_msg.buffer)
            elif op.view.nbytes != nbytes:
                mismatched = op
            else:
                peer.rx_op = op
                target = op.view
        finish(done)
        if hold:
            return
        for stale_op in stale:  # a receive this message proves can never match
            stale_op.work.set_exception(BackendError(f"{stale_op.work.description}: {conflict}"))
        if mismatched is not None:
            mismatched.work.set_exception(wrong_size(mismatched, peer.rank, nbytes))
            peer.reset_rx()
            if nbytes:
                peer.rx_mode, peer.rx_left = RX_DRAIN, nbytes  # keep the stream in step
        elif nbytes == 0:
            self._finish_body(peer)  # recv_into on an empty view would look like EOF
        else:
            peer.rx_mode, peer.rx_view, peer.rx_pos = RX_BODY, target, 0

    def _finish_body(self, peer: Peer) -> None:
        op, message = peer.rx_op, peer.rx_msg
        peer.reset_rx()
        if op is not None:
            op.work.set_result(peer.rank)
            return
        assert message is not None  # one of the two is always set in body mode
        with self._lock:
            message.done = True
            waiter = message.waiter
        if waiter is not None:
            self._complete_from(waiter, message)

    # --------------------------------------------------------------------------- failure
    def _fail_peer(self, peer: Peer, cause: str, *, orderly: bool = False) -> None:
        """Mark ``peer`` dead and fail the work that depended on it (progress thread)."""
        if peer.dead is not None:
            return
        # what it wrote into its ring before it left is delivered
        unread = self._hosts.peer_lost(peer.rank)
        error = NetworkError(
            f"tcp: connection to rank {peer.rank} ({peer.address}) lost: {cause}"
        )
        peer.dead = error
        self._holds.leases.end(peer)
        listener = self._on_peer_lost
        if not orderly and listener is not None:
            listener(peer.rank, error)  # colls.health breaks the group before works fail
        with peer.send_lock:
            sends = list(peer.send_queue)
            peer.send_queue.clear()
            if self._poller is not None:
                self._poller.forget(peer)
            peer.sock.close()
        inbox = self._inbox
        with inbox.lock:
            inbox.held.discard(peer)
            if not orderly and self._abrupt is None:
                self._abrupt = error
            recvs = self._table.remove_from(peer.rank) + self._rx_pending(peer)
            if not orderly or self._all_gone():
                recvs += self._table.remove_any_source()
        peer.reset_rx()
        log = logger.info if orderly else logger.warning
        log("tcp: rank %d: %s", self.rank, error)
        for op in [*sends, *recvs, *unread]:
            op.work.set_exception(error)

    def _rx_pending(self, peer: Peer) -> list[RecvOp]:
        """Return the receive ``peer``'s half-read message was for (lock held)."""
        if peer.rx_op is not None:
            return [peer.rx_op]
        if peer.rx_msg is not None:
            if peer.rx_msg.waiter is not None:
                return [peer.rx_msg.waiter]
            self._table.discard(peer.rx_msg)
        return []

    def _release_all(self, *, goodbye: bool) -> list[Any]:
        """Close every connection and return every pending send and receive (after the loop)."""
        pending: list[Any] = []
        self._links.close()
        if self._acceptor is not None:
            self._acceptor.close()  # its handshakes and the listener
        elif self._mesh is not None:
            self._mesh.close()
        pending.extend(self._hosts.close())  # before the remote sends' arrays may be freed
        peers = self._links.snapshot()
        for peer in peers:
            with peer.send_lock:
                pending.extend(peer.send_queue)
                mid_frame = bool(peer.send_queue) and peer.send_queue[0].started
                peer.send_queue.clear()
                if peer.dead is None:
                    if goodbye and not mid_frame:
                        try:
                            peer.sock.send(_GOODBYE, SEND_FLAGS)
                        except OSError:
                            pass
                    peer.dead = NetworkError(f"tcp: connection to rank {peer.rank} closed")
                    peer.sock.close()
        with self._lock:
            for peer in peers:
                pending.extend(self._rx_pending(peer))
            pending.extend(self._table.remove_all())
        return pending
