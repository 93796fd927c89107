"""The tcp progress engine: one thread per backend moves every byte, and sleeps while idle.

The engine keeps the posting of sends and receives and the matching of socket messages, and
mixes in the progress thread's half (:mod:`~colls_plugins.tcp._progress`: the loop, what
arrives on the sockets, failure and shutdown); each other job is a room of its own, composed
here and handed the state it works on in the open:

* :mod:`~colls_plugins.tcp.host_peers`: the ranks of this host, through rings in shared memory;
* :mod:`~colls_plugins.tcp._holds`: holding large unmatched messages in the socket, and the
  leases on this rank's held messages (keepalive);
* :mod:`~colls_plugins.tcp._probes`: fail-fast probes of collective receives pending too long;
* :mod:`~colls_plugins.tcp._accepting`: peers' connections on a lazy group's listener;
* :mod:`~colls_plugins.tcp._poller`: the selector the progress thread sleeps on, and its wake-ups;
* :mod:`~colls_plugins.tcp._reading`: the sockets' receive state machine;
* :mod:`~colls_plugins.tcp._links`: opening connections; :mod:`~colls_plugins.tcp._matching`:
  the :class:`~colls_plugins.tcp._matching.Inbox` they all match against.

Threads and what they touch:

* Caller threads run :meth:`Engine.isend` and :meth:`Engine.irecv`. A send first tries to hand its
  header and payload straight to the kernel (one non-blocking ``sendmsg``, under the connection's
  send lock, only when nothing is queued before it); whatever does not fit is queued and the
  progress thread is woken through a socketpair to watch the socket for writability. A receive
  either takes an unexpected message that already arrived or is posted in the match table.
* The progress thread sleeps in ``select()`` (:mod:`~colls_plugins.tcp._poller`; no CPU while
  idle). It reads each readable peer through its receive state machine (``_reading``): a header,
  then the body straight into the matching receive's memory, or into a buffer queued as
  unexpected, or left in the socket (``_holds``). A header announcing more than
  ``COLLS_MAX_MESSAGE_BYTES`` loses the connection before any memory is reserved. It flushes
  each writable peer's send queue with gathered ``sendmsg`` calls. ``recv_into`` and ``sendmsg``
  release the GIL, so a reduction running on another thread overlaps with the transfer.

Locks (never held while completing a Work, so completion callbacks may post more work): the
inbox's ``lock`` guards the match table, the held peers and the closed state; each peer's
``send_lock`` guards its socket writes, send queue and selector registration.

Failure and shutdown: :mod:`~colls_plugins.tcp._progress`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from colls import env
from colls.errors import BackendError, CollsError, NetworkError
from colls.matching import Message, RecvOp, copy_bytes
from colls.work import Work
from colls_plugins.tcp._accepting import Acceptor
from colls_plugins.tcp._deferred import Deferred, DeferredReceive
from colls_plugins.tcp._frames import HEADER, byte_view
from colls_plugins.tcp._holds import Holds
from colls_plugins.tcp._links import Links
from colls_plugins.tcp._matching import Completions, Inbox, finish, wrong_size
from colls_plugins.tcp._peer import SEND_FLAGS, Peer, SendOp, consume
from colls_plugins.tcp._poller import Poller
from colls_plugins.tcp._probes import Probes
from colls_plugins.tcp._progress import EngineProgress
from colls_plugins.tcp._reading import Reader
from colls_plugins.tcp._ring_batch import RingBatch
from colls_plugins.tcp.connections import Connection, Mesh
from colls_plugins.tcp.host_peers import HostPeers
from colls_plugins.tcp.shm.p2p import Channel, Channels


class _RecvDescription:
    """A receive's description, formatted only when an error or a repr shows it (one per
    message is too many to format)."""

    __slots__ = ("src", "tag")

    def __init__(self, src: int | None, tag: int) -> None:
        self.src, self.tag = src, tag

    def __str__(self) -> str:
        origin = "any rank" if self.src is None else f"rank {self.src}"
        return f"tcp recv from {origin} tag {self.tag}"


class _Posting:
    """What posting receives leaves for after the inbox lock: receives to complete (with the
    sender or an exception), unexpected messages to copy, held peers to read again, and whether
    a ring may bring one of them."""

    __slots__ = ("done", "copies", "released", "polls")

    def __init__(self) -> None:
        self.done: Completions = []
        self.copies: list[tuple[RecvOp, Message]] = []
        self.released: list[Peer] = []
        self.polls = False


def _nothing(*_args: Any) -> None:
    """What a group of one (no progress thread) does to wake its thread or flush a peer."""


class Engine(EngineProgress):
    """Point-to-point over connections opened on demand, progressed by one background thread.

    Args:
        rank: this rank's group rank.
        connections: connections that exist already (a fixed mesh; empty for a lazy group).
        timeout: default ``wait()`` timeout of the Works it returns, and the bound on opening
            a connection.
        name: a label for the thread and logs (the group name).
        mesh: the listener of a lazily connected group (:class:`Mesh`): its progress thread
            accepts peers' connections, and a send to a rank without a connection dials it.
            None: the group is ``connections`` and this rank (no listener).
    """

    def __init__(
        self, rank: int, connections: dict[int, Connection], timeout: float, name: str,
        mesh: Mesh | None = None,
    ) -> None:
        self.rank = rank
        self._mesh = mesh
        self._world_size = mesh.world_size if mesh is not None else len(connections) + 1
        self._timeout = timeout
        self._inbox = inbox = Inbox()
        # The inbox's parts the engine's own code uses most, under short names (same objects).
        self._lock = inbox.lock
        self._table = inbox.table
        self._refusal = inbox.refusal
        # fail-fast hooks (colls.health): the peer-lost listener, and the first abrupt loss
        self._on_peer_lost: Callable[[int, BaseException], None] | None = None
        self._abrupt: NetworkError | None = None
        self._max_message = int(env.get("COLLS_MAX_MESSAGE_BYTES"))
        self._thread: threading.Thread | None = None
        self._reader = Reader(self._on_header, self._finish_body, self._fail_peer)
        # A group of one delivers locally only: no sockets, no thread, nothing to select on.
        self._poller = Poller() if self._world_size > 1 else None
        self._acceptor: Acceptor | None = None
        self._links = Links(rank, connections, mesh, timeout, self._register, self._refusal)
        self._peers = self._links.peers  # read freely; changed under the links' lock only
        poller = self._poller
        self._hosts = HostPeers(rank, inbox, timeout, poller.wake if poller else _nothing)
        self._channel_for = self._hosts.channel_for  # bound once: the latency path's first call
        self._delivered = self._hosts.delivered
        self._deferred = Deferred(inbox, self._hosts, timeout, self._post_deferred,
                                  self._after_posting, self._lost)
        self._holds = Holds(rank, inbox, poller.request_write if poller else _nothing,
                            self._fail_peer)
        self._probes = Probes(rank, inbox, self._peers,
                              self._links.connect if mesh is not None else None, self._flush)
        if poller is None:
            return
        if mesh is not None:
            self._acceptor = Acceptor(rank, mesh, poller, self._links.on_hello)
        self._links.start()
        self._thread = threading.Thread(
            target=self._run, name=f"colls-tcp[{name}:{rank}]", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------------------ public API
    def isend(self, array: Any, dst: int, tag: int) -> Work:
        """Start sending ``array`` to ``dst``; the Work completes once the kernel has every byte.

        A C-contiguous NumPy array small enough for a host peer's ring is written there whole
        (the compiled piece reads the array itself: no byte view), and the Work returned is the
        one finished Work of every such send.
        """
        channel = self._channel_for(dst)
        if (channel is not None and type(array) is np.ndarray and array.flags.c_contiguous
                and self._ring_send(channel, dst, array, tag)):
            return self._delivered
        view = byte_view(array, name="array", writable=False)
        if view.nbytes > self._max_message:
            raise ValueError(
                f"tcp: rank {self.rank}: send to rank {dst}: array has {view.nbytes} bytes, more "
                f"than COLLS_MAX_MESSAGE_BYTES={self._max_message} allows"
            )
        if channel is not None:
            with channel.send_lock:  # the ring and the socket count stay in send order
                if self._may_write_ring(dst):
                    if channel.try_send(view, tag):
                        return self._delivered
                    work = self._hosts.send_remote(channel, view, tag, array)
                    if work is not None:
                        return work
                channel.sockets_sent += 1
                return self._send_socket(self._send_work(dst, tag), view, dst, tag, array)
        work = self._send_work(dst, tag)
        if dst == self.rank:
            return self._send_local(work, view, tag)
        return self._send_socket(work, view, dst, tag, array)

    def _ring_send(self, channel: Channel, dst: int, array: np.ndarray, tag: int) -> bool:
        """Write C-contiguous ``array`` into host peer ``dst``'s ring if it fits and there is
        room; return whether it did (a message above COLLS_MAX_MESSAGE_BYTES never does:
        :meth:`isend` refuses it)."""
        nbytes = array.nbytes
        if nbytes > channel.inline_max or nbytes > self._max_message:
            return False
        if channel.lock_free:  # one compiled write (Channel says why no lock is needed)
            return self._may_write_ring(dst) and channel.try_send(array, tag)
        with channel.send_lock:
            return self._may_write_ring(dst) and channel.try_send(array, tag)

    def _may_write_ring(self, dst: int) -> bool:
        """Whether a message to host peer ``dst`` may go into its ring (its ``send_lock`` held,
        or the channel :attr:`~Channel.lock_free`): not once this engine refuses work or knows
        ``dst`` gone."""
        peer = self._peers.get(dst)
        inbox = self._inbox
        return (not inbox.closed and inbox.broken is None
                and (peer is None or peer.dead is None))

    def _send_work(self, dst: int, tag: int) -> Work:
        return Work(description=f"tcp send to rank {dst} tag {tag}", default_timeout=self._timeout)

    def _send_socket(self, work: Work, view: memoryview, dst: int, tag: int, array: Any
                     ) -> Work:
        """Send over ``dst``'s connection (opened now if needed)."""
        peer = self._peers.get(dst)
        if peer is None:
            try:
                peer = self._links.dial_for_send(dst, self._on_peer_lost)
            except CollsError as exc:
                work.set_exception(exc)
                return work
        op = SendOp(work, deque([memoryview(HEADER.pack(tag, view.nbytes)), view]), array)
        refusal: BaseException | None = None
        queued = wake = False
        with peer.send_lock:
            refusal = self._refusal() or peer.dead
            if refusal is None and peer.send_queue:
                peer.send_queue.append(op)
                queued = True
            elif refusal is None:
                try:
                    sent = peer.sock.sendmsg(list(op.buffers), (), SEND_FLAGS)
                except OSError:  # would block, or broken: the progress thread sorts it out
                    sent = 0
                consume(op.buffers, sent)
                if op.buffers:
                    op.started = sent > 0
                    peer.send_queue.append(op)
                    queued = wake = True
        if refusal is not None:
            work.set_exception(refusal)
        elif not queued:
            work.set_result(None)
        if wake:
            self._request_write(peer)
        return work

    def irecv(self, array: Any, src: int | None, tag: int) -> Work:
        """Start receiving into ``array`` from ``src`` (None: any); the result is the sender.

        A user message that is already next from a host peer (what a blocking :meth:`recv`
        takes) is taken at once, and the Work returned complete. A receive into a NumPy array
        whose message may still come through the peer's ring is left to its waiter
        (:mod:`~colls_plugins.tcp._deferred`). Either way no receive is posted.
        """
        hosts = self._hosts
        description = _RecvDescription(src, tag)
        channel = None if src is None or tag < 0 else self._channel_for(src)
        # The compiled take reads a writable C-contiguous NumPy array as it is (no byte view).
        if channel is not None and type(array) is np.ndarray and array.flags.carray:
            work = self._deferred.take_or_defer(channel, array, tag, description)
            if work is not None:
                return work
            view = byte_view(array, name="array", writable=True)
        else:
            view = byte_view(array, name="array", writable=True)
            if channel is not None and hosts.try_take(channel, view, tag):
                return Work.completed(src, description=description)
        polls = hosts.may_serve(src)  # a ring may bring it, also one with no channel yet
        work = Work(hosts.future() if polls else None, description=description,
                    default_timeout=self._timeout)
        posting = _Posting()
        rings = hosts.rings_for(src)
        with self._inbox.lock:
            self._post_locked(RecvOp(work, view, src, tag), rings, posting)
        self._after_posting(posting)
        return work

    def _post_locked(self, op: RecvOp, rings: Sequence[Channel], posting: _Posting, *,
                     in_order: bool = False) -> None:
        """Post receive ``op`` (inbox lock held), or match it with an unexpected message that
        is in; ``rings``: the host peers' rings whose entries it may take. What is left for
        after the lock goes to ``posting``. Receives left to their waiters that ``op`` could
        overtake are posted first, unless ``in_order`` (``op`` is one of them, posted in their
        order)."""
        inbox = self._inbox
        table = self._table
        src, tag = op.src, op.tag
        if inbox.deferred and not in_order and tag >= 0:
            self._post_in_order(self._deferred.overtaken_by(src, tag), posting)
        posting.polls = posting.polls or self._hosts.may_serve(src)
        refusal = inbox.refusal()
        # A queued unexpected message from a rank came before everything still in that
        # rank's ring (shm_p2p, "Order"), so the queue is looked at first.
        message = None if refusal else table.take_unexpected(src, tag)
        bound = False
        if refusal is None and message is None and inbox.held:
            bound, released = self._holds.release_for(op)
            posting.released.extend(released)
            if not bound:  # a held message turned unexpected may be the one
                message = table.take_unexpected(src, tag)
        if refusal is None and message is None and not bound:
            refusal = self._recv_refusal(src)
            conflict = None if refusal else inbox.tracker.on_post(src, tag, time.monotonic())
            if conflict is not None:
                refusal = BackendError(f"{op.work.description}: {conflict}")
            if refusal is None:
                table.post(op)
                # No wake-up here: waking the progress thread on every receive costs the
                # caller a GIL hand-off (about a scheduler tick on a busy host). The thread
                # never sleeps longer than PROBE_AFTER_S (Probes.timeout), so a due probe
                # goes out at most that late.
                inbox.tracker.wake_needed = False
                for ring in rings:  # an entry for this receive lands in place
                    self._hosts.drain(ring, posting.done, force=True)
        if message is not None and not message.done:
            if len(message.buffer) == op.view.nbytes:
                message.waiter = op  # completes when the rest of the body is in
                message = None
            else:
                refusal = wrong_size(op, message.src, len(message.buffer))
        if refusal is not None:
            posting.done.append((op, refusal))
        elif message is not None:
            posting.copies.append((op, message))

    def _post_deferred(self, receives: Sequence[DeferredReceive]) -> _Posting:
        """Post ``receives``, left to their waiters until now, in their order (inbox lock held:
        :class:`Deferred` has just taken them out of their queue); return what is left for
        after the lock (:meth:`_after_posting`)."""
        posting = _Posting()
        self._post_in_order(receives, posting)
        return posting

    def _post_in_order(self, receives: Sequence[DeferredReceive], posting: _Posting) -> None:
        """Post ``receives``, taken out of their queues, in their order (inbox lock held)."""
        for receive in receives:
            self._post_locked(receive.posted(), [receive.channel], posting, in_order=True)

    def _after_posting(self, posting: _Posting) -> None:
        """Do what posting receives left for after the inbox lock (no lock held)."""
        if posting.released:
            assert self._poller is not None  # a held message came over a socket
            for peer in posting.released:
                self._poller.sync_read_interest(peer)
        if posting.polls:
            self._hosts.posted()
        finish(posting.done)
        for op, message in posting.copies:
            self._complete_from(op, message)

    # -- blocking calls of small host arrays, without a Work ---------------------------------
    def send(self, array: np.ndarray, dst: int, tag: int) -> None:
        """Send a C-contiguous ``array`` to ``dst``; return once the kernel or the ring has it.

        A message small enough for the ring of a host peer is written there (no Work, no
        byte view: the compiled piece reads the array itself); anything else is :meth:`isend`.
        """
        channel = self._channel_for(dst)
        if channel is not None and self._ring_send(channel, dst, array, tag):
            return
        work = self.isend(array, dst, tag)
        if work is self._delivered:
            return
        if channel is not None:
            self._hosts.spin_for_remote(work)
        work.wait()

    def recv(self, array: np.ndarray, src: int | None, tag: int) -> int:
        """Receive into a C-contiguous ``array`` from ``src`` (None: any); return the sender.

        A blocking receive of a user message small enough for the ring, from a host peer, takes
        the message straight into ``array`` when it is next, in the unexpected queue or in the
        ring, now or while this thread polls as a receive's waiter would
        (:meth:`HostPeers.await_ring`): no Work, future or posted receive. Everything else, and
        a message that is not there by then, goes through :meth:`irecv` and its rules.
        """
        channel = None if src is None or tag < 0 else self._channel_for(src)
        if channel is not None and array.nbytes <= channel.inline_max:
            hosts = self._hosts
            taken = hosts.try_take(channel, array, tag)  # already there: no poll loop
            if taken is None:
                taken = hosts.await_ring(channel, array, tag)
            if taken:
                return channel.rank
        work = self.irecv(array, src, tag)
        future = work.get_future()
        if isinstance(future, DeferredReceive):
            # This thread has polled for it already: it waits as for a posted receive (sleeps)
            # instead of polling again as its waiter.
            self._deferred.post(future)
        return work.source_rank()

    # --------------------------------------------------------------------------- host peers
    def use_shm(self, channels: Channels) -> None:
        """Send to and receive from the host peers in ``channels`` through shared memory.

        Called once, right after the backend mapped the host's memory and before any
        point-to-point call.
        """
        self._hosts.use(channels)

    def ring_batch(self, ops: Sequence[tuple[str, Any, int | None, int]]) -> RingBatch | None:
        """Return a :class:`RingBatch` of checked ``ops`` whose messages all go through host
        peers' rings (C-contiguous NumPy arrays of at most a ring's inline size), or None."""
        sends: list[tuple[int, Channel, int, np.ndarray, int]] = []
        receives: list[tuple[int, Channel, int, np.ndarray, int, _RecvDescription]] = []
        for i, (kind, array, peer, tag) in enumerate(ops):
            if peer is None or not self._hosts.serves(peer, array.nbytes) \
                    or array.nbytes > self._max_message or not array.flags.c_contiguous:
                return None
            channel = self._channel_for(peer)
            if channel is None:
                return None
            if kind == "isend":
                sends.append((i, channel, peer, array, tag))
            elif array.flags.writeable:
                receives.append((i, channel, peer, array, tag, _RecvDescription(peer, tag)))
            else:
                return None
        return RingBatch(self, len(ops), sends, receives)

    def ring_isend(self, channel: Channel, dst: int, array: np.ndarray, tag: int) -> Work:
        """:meth:`isend` of a message a ring serves, its channel known (:class:`RingBatch`)."""
        if self._ring_send(channel, dst, array, tag):
            return self._delivered
        return self.isend(array, dst, tag)  # no room, or refused: isend says what happens

    def ring_irecv(self, channel: Channel, src: int, array: np.ndarray, tag: int,
                   description: Any) -> Work:
        """:meth:`irecv` of a message a ring serves, its channel known (:class:`RingBatch`)."""
        work = self._deferred.take_or_defer(channel, array, tag, description)
        return work if work is not None else self.irecv(array, src, tag)

    def ring_serves(self, src: int | None, nbytes: int) -> bool:
        """Whether a user message of ``nbytes`` from ``src`` comes through a host peer's ring."""
        return self._hosts.serves(src, nbytes)

    def poll_rings(self) -> bool:
        """Move what the host peers' rings hold into the match table (any thread).

        Returns whether some receive completed.
        """
        return self._hosts.poll()

    # --------------------------------------------------------------------------- connections
    def join(self, *, ring: bool = True) -> None:
        """Publish this rank's address and connect to its ring neighbours (:meth:`Links.join`)."""
        self._links.join(ring=ring)

    def connected_ranks(self) -> list[int]:
        """Return the ranks this rank holds a connection to (dead ones included), sorted."""
        return sorted(self._peers)

    def _register(self, peer: Peer) -> None:
        """Watch a new peer's socket for reading (Links calls it under its lock)."""
        if self._poller is not None:
            self._poller.add_peer(peer)

    def _request_write(self, peer: Peer) -> None:
        """Ask the progress thread to flush ``peer``'s send queue (a peer implies a thread)."""
        assert self._poller is not None
        self._poller.request_write(peer)

    # --------------------------------------------------------------------------- refusals
    def _recv_refusal(self, src: int | None) -> BackendError | None:
        """Return why a receive from ``src`` can never complete (lock held), or None."""
        if src is not None:
            peer = self._peers.get(src) if src != self.rank else None
            return peer.dead if peer is not None else None  # not connected: it will connect
        if self._abrupt is not None:
            return self._abrupt
        if self._all_gone():
            return BackendError(f"tcp: rank {self.rank}: every peer has closed its backend")
        return None

    def _lost(self, rank: int) -> bool:
        """Whether ``rank``'s connection is known dead."""
        peer = self._peers.get(rank)
        return peer is not None and peer.dead is not None

    def _all_gone(self) -> bool:
        """Whether every other rank has connected and left (no any-source message can come).

        A group of one has no other rank: a receive there waits for its timeout, as in torch.
        """
        peers = self._links.snapshot()
        return bool(peers) and len(peers) == self._world_size - 1 and all(p.dead for p in peers)

    # --------------------------------------------------------------------------- completion
    def _complete_from(self, op: RecvOp, message: Message) -> None:
        """Complete ``op`` by copying a fully received unexpected ``message``."""
        if len(message.buffer) != op.view.nbytes:
            op.work.set_exception(wrong_size(op, message.src, len(message.buffer)))
            return
        copy_bytes(op.view, message.buffer)
        with self._lock:
            self._table.recycle(message.buffer)
        op.work.set_result(message.src)

    def _send_local(self, work: Work, view: memoryview, tag: int) -> Work:
        """Deliver a send to this rank itself: match it now or keep a copy as unexpected."""
        with self._lock:
            refusal = self._refusal()
            op = None if refusal else self._table.match_arrival(self.rank, tag)
            if refusal is None and op is None:
                message = self._table.add_unexpected(self.rank, tag, view.nbytes)
                copy_bytes(message.buffer, view)
                message.done = True
        if refusal is not None:
            work.set_exception(refusal)
            return work
        if op is not None and op.view.nbytes != view.nbytes:
            op.work.set_exception(wrong_size(op, self.rank, view.nbytes))
        elif op is not None:
            copy_bytes(op.view, view)
            op.work.set_result(self.rank)
        work.set_result(None)
        return work
