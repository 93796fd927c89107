"""The tcp progress engine: one thread per backend moves every byte, and sleeps while idle.

Threads and what they touch:

* Caller threads run :meth:`Engine.isend` and :meth:`Engine.irecv`. A send first tries to hand its
  header and payload straight to the kernel (one non-blocking ``sendmsg``, under the connection's
  send lock, only when nothing is queued before it); whatever does not fit is queued and the
  progress thread is woken through a socketpair to watch the socket for writability. A receive
  either takes an unexpected message that already arrived or is posted in the match table.
* The progress thread blocks in ``selector.select()`` (no timeout, so no CPU while idle). For each
  readable peer it runs a small state machine: read the 16-byte header, find the receive that
  matches (src, tag) and ``recv_into`` the receive's own memory; with no receive posted it reads
  a small message into a new buffer queued as unexpected, but *holds* a large one
  (:data:`HOLD_MIN_BYTES`), collective or user-tagged, and any message once the unexpected ones
  fill :data:`MAX_UNEXPECTED_BYTES`: the connection is not read until a receive is posted, so the
  sender's kernel buffer fills and its send waits. A rank running ahead of a slower one, or a
  flood of sends nobody receives, thus cannot make it buffer without bound, and the body lands
  straight in the receive buffer (no extra copy). A receive for another tag from that rank, or
  from any rank, turns a held message into an ordinary unexpected one, so no message can block
  the stream behind it. The holder tells the sender (a ``HOLD_TAG`` frame) when a hold starts and
  ends, so that the sender's kernel does not take the closed window for a vanished host
  (:func:`colls.sockets.bound_unacknowledged`), and renews it while the hold lasts: a sender that
  hears nothing for a keepalive bound takes the holder for gone
  (:mod:`colls_plugins.tcp._holds`). A header announcing more than
  ``COLLS_MAX_MESSAGE_BYTES`` loses the connection (a NetworkError naming the peer) before any
  memory is reserved. For each
  writable peer it flushes the send queue with gathered ``sendmsg`` calls. ``recv_into`` and
  ``sendmsg`` release the GIL, so a reduction running on another thread overlaps with the
  transfer.

Locks (never held while completing a Work, so completion callbacks may post more work):
``_lock`` guards the match table, the held peers and the closed state; each peer's ``send_lock``
guards its socket writes, send queue and selector registration; ``_wake_lock`` guards the set of
peers waiting for write interest.

Failure: any OSError or EOF on a connection marks that peer dead and fails, with a
:class:`~colls.errors.NetworkError` naming the rank and address, every pending send to it, every
pending receive from it and (unless the peer left in an orderly way) every pending any-source
receive; later operations with a dead peer fail at once. An exception escaping the progress loop
fails all pending work. :meth:`Engine.close` fails whatever is still pending with
``BackendError("tcp backend closed")``.

Host peers: once the backend's shared memory is up (:meth:`Engine.use_shm`), small messages to
and from the ranks of this host go through rings in shared memory
(:mod:`colls_plugins.tcp.shm.p2p`, which also explains how the order of messages that take
different transports is kept); the engine matches their entries in the same table, under the
same lock.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from colls import env
from colls.errors import BackendError, CollsError, NetworkError
from colls.matching import (
    MESSAGE_OVERHEAD_BYTES,
    MatchTable,
    Message,
    RecvOp,
    copy_bytes,
    size_error,
)
from colls.sockets import bound_unacknowledged
from colls.work import Work
from colls_plugins.tcp._frames import GOODBYE_TAG, HEADER, HOLD_TAG, HelloError, byte_view
from colls_plugins.tcp._holds import Leases, Renewals
from colls_plugins.tcp._links import Links
from colls_plugins.tcp._mismatch import (
    PROBE_AFTER_S,
    PROBE_TAG,
    Tracker,
    probe_field,
    probed_tag,
)
from colls_plugins.tcp._peer import RX_BODY, RX_DRAIN, RX_HELD, Peer, SendOp, consume, gather
from colls_plugins.tcp.connections import Connection, Incoming, Mesh, peer_name
from colls_plugins.tcp.shm.group import SPIN_ITERATION_SECONDS
from colls_plugins.tcp.shm.p2p import (
    DRIVEN_TICK_SECONDS,
    SMALL_BYTES,
    TICK_LINGER_SECONDS,
    TICK_SECONDS,
    YIELD_SECONDS,
    Channel,
    Channels,
    PollingFuture,
    poll_briefly,
)
from colls_plugins.tcp.shm.remote import REMOTE_FLAG

logger = logging.getLogger("colls.tcp")

#: At most this many ``recv_into`` calls per readiness event, so one busy peer cannot starve
#: the others (the selector is level-triggered and reports it again).
READ_BUDGET = 64

#: A collective message at least this large that arrives before its receive is posted is held
#: unread (module docstring). Smaller ones are buffered: holding costs the sender a stall and
#: both sides a wake-up, which only pays for itself on large messages.
HOLD_MIN_BYTES = 1 << 16

#: Most bytes that unexpected messages (bodies plus matching.MESSAGE_OVERHEAD_BYTES each) may
#: hold; a message that would pass it waits in the socket like a large one. A few receives'
#: worth of small messages, so latency-bound exchanges never stall on it.
MAX_UNEXPECTED_BYTES = 16 << 20

#: Size of the scratch buffer that discards the body of a message whose receive failed.
DRAIN_CHUNK_BYTES = 1 << 20

#: Seconds close() waits for the progress thread to exit.
JOIN_TIMEOUT_SECONDS = 10.0

#: How long a blocking send that a host peer reads from this rank's memory (shm_remote) polls
#: for the peer's acknowledgement before it waits as a receive does (seconds): the peer copies
#: a 1 MiB message in about 0.2 ms.
REMOTE_SPIN_SECONDS = 0.0005

#: How long a thread about to wait for a receive reads the sockets itself (seconds), and how
#: many polls it makes between two ``sched_yield`` calls.
CALLER_POLL_SECONDS = 0.0002
CALLER_POLLS_PER_YIELD = 8

_SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)
_GOODBYE = HEADER.pack(GOODBYE_TAG, 0)


class Engine:
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
        self._lock = threading.Lock()
        self._rx_lock = threading.Lock()  # held by whichever thread reads the sockets
        self._table = MatchTable()
        self._closed = False
        self._broken: BackendError | None = None
        # fail-fast hooks (colls.health): mismatch tracking and the peer-lost listener
        self._tracker = Tracker()
        self._on_peer_lost: Callable[[int, BaseException], None] | None = None
        self._abrupt: NetworkError | None = None
        self._links = Links(rank, connections, mesh, timeout, self._register, self._refusal)
        self._peers = self._links.peers  # read freely; changed under the links' lock only
        self._incoming: dict[socket.socket, Incoming] = {}  # handshakes (progress thread)
        self._held: set[Peer] = set()  # peers in RX_HELD (guarded by _lock)
        self._renewals = Renewals()  # when this rank next renews its holds (tcp._holds)
        self._leases: Leases[Peer] = Leases()  # peers that hold a message of this rank
        self._scratch: memoryview | None = None
        self._max_message = int(env.get("COLLS_MAX_MESSAGE_BYTES"))
        self._thread: threading.Thread | None = None
        # Host peers reached through shared memory (use_shm). A channel is made when it is first
        # needed (:meth:`_channel_for`): by a send to the peer, a receive from it, a socket
        # message from it, or its first ring entry (:meth:`_open_announced`).
        self._host_peers: frozenset[int] = frozenset()
        self._channels: dict[int, Channel] = {}  # the channels made so far, by group rank
        self._channel_list: list[Channel] = []  # the same; replaced, never changed in place
        self._silent: list[tuple[int, Callable[[], bool]]] = []  # host peers with no channel
        self._channel_maker: Channels | None = None
        self._channel_lock = threading.Lock()  # guards making channels (no other lock inside)
        self._shm_group: Any = None  # the host's ShmGroup once use_shm ran
        self._inline_max = 0  # the largest message a ring entry holds, once use_shm ran
        self._arrivals: dict[int, int] = {}  # socket messages per rank that reached the table
        # What a send written into a ring returns: it is complete and can never fail, so one
        # finished Work serves them all (a new one costs a future and a lock per send).
        self._delivered = Work.completed(description="tcp send (written into shared memory)")
        self._long_sleep = False  # the progress thread sleeps without looking at the rings
        self._ring_post_at = 0.0  # when a receive a ring may complete was last posted
        self._drivers: set[PollingFuture] = set()  # receives whose waiter polls the rings now
        # Channels with sends their peer is still to read from this rank's memory (shm_remote);
        # changed under the channel's send_lock.
        self._remote_channels: set[Channel] = set()
        if self._world_size == 1:
            return  # a group of one: local delivery only, no sockets, no thread
        self._wake_lock = threading.Lock()
        self._wake_sent = False
        self._want_write: set[Peer] = set()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        if mesh is not None:
            mesh.listener.setblocking(False)
            self._selector.register(mesh.listener, selectors.EVENT_READ, mesh)
        self._links.start()
        self._thread = threading.Thread(
            target=self._run, name=f"colls-tcp[{name}:{rank}]", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------------------ public API
    def isend(self, array: Any, dst: int, tag: int) -> Work:
        """Start sending ``array`` to ``dst``; the Work completes once the kernel has every byte."""
        view = byte_view(array, name="array", writable=False)
        if view.nbytes > self._max_message:
            raise ValueError(
                f"tcp: rank {self.rank}: send to rank {dst}: array has {view.nbytes} bytes, more "
                f"than COLLS_MAX_MESSAGE_BYTES={self._max_message} allows"
            )
        channel = self._channel_for(dst)
        if channel is not None:
            with channel.send_lock:  # the ring and the socket count stay in send order
                if self._may_write_ring(dst):
                    if channel.try_send(view, tag):
                        return self._delivered
                    if view.nbytes > SMALL_BYTES and channel.remote_ready():  # large, or full
                        work = self._remote_work(dst, tag)
                        if channel.try_send_remote(view, tag, array, work):
                            self._remote_channels.add(channel)
                            if self._long_sleep:  # it ticks while remote sends are pending
                                self._wake()
                            return work
                channel.sockets_sent += 1
                return self._send_socket(self._send_work(dst, tag), view, dst, tag, array)
        work = self._send_work(dst, tag)
        if dst == self.rank:
            return self._send_local(work, view, tag)
        return self._send_socket(work, view, dst, tag, array)

    def _may_write_ring(self, dst: int) -> bool:
        """Whether a message to host peer ``dst`` may go into its ring (its ``send_lock`` held,
        or the channel :attr:`~Channel.lock_free`): not once this engine refuses work or knows
        ``dst`` gone."""
        peer = self._peers.get(dst)
        return self._refusal() is None and (peer is None or peer.dead is None)

    def _remote_work(self, dst: int, tag: int) -> Work:
        """The Work of a send the peer reads from this rank's memory (shm_remote): waiting for
        it polls the rings (also for a message the peer sends this rank meanwhile) and the
        acknowledgements."""
        future = PollingFuture(self._poll_sends, self._shm_group, self._drivers)
        return Work(future, description=f"tcp send to rank {dst} tag {tag}",
                    default_timeout=self._timeout)

    def _poll_sends(self) -> None:
        """Poll the rings and complete the remote sends their receivers have read."""
        self.poll_rings()
        if self._remote_channels:
            self._reap_remote()

    def _reap_remote(self) -> None:
        """Complete the remote sends (shm_remote) that their receivers have acknowledged."""
        for channel in list(self._remote_channels):
            with channel.send_lock:
                done = channel.acknowledged()
                if not channel.remote_sends:
                    self._remote_channels.discard(channel)
            for sent in done:
                sent.work.set_result(None)

    def _send_work(self, dst: int, tag: int) -> Work:
        return Work(description=f"tcp send to rank {dst} tag {tag}", default_timeout=self._timeout)

    def _send_socket(self, work: Work, view: memoryview, dst: int, tag: int, array: Any
                     ) -> Work:
        """Send over ``dst``'s connection (opened now if needed)."""
        peer = self._peers.get(dst)
        if peer is None:
            try:
                peer = self._open(dst)
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
                    sent = peer.sock.sendmsg(list(op.buffers), (), _SEND_FLAGS)
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
        takes) is taken at once, and the Work returned complete: no future or posted receive.
        """
        view = byte_view(array, name="array", writable=True)
        origin = "any rank" if src is None else f"rank {src}"
        description = f"tcp recv from {origin} tag {tag}"
        channel = None if src is None or tag < 0 else self._channel_for(src)
        if channel is not None and self._try_take(channel, view, tag):
            return Work.completed(src, description=description)
        rings = self._rings_for(src)
        polls = self._rings_may_serve(src)  # a ring may bring it, also one with no channel yet
        future = PollingFuture(self.poll_rings, self._shm_group, self._drivers) if polls else None
        work = Work(future, description=description, default_timeout=self._timeout)
        op = RecvOp(work, view, src, tag)
        bound = False
        released: Sequence[Peer] = ()
        done: list[tuple[RecvOp, Any]] = []
        with self._lock:
            refusal = self._refusal()
            # A queued unexpected message from a rank came before everything still in that
            # rank's ring (shm_p2p, "Order"), so the queue is looked at first.
            message = None if refusal else self._table.take_unexpected(src, tag)
            if refusal is None and message is None and self._held:
                bound, released = self._release_held(op)
                if not bound:  # a held message turned unexpected may be the one
                    message = self._table.take_unexpected(src, tag)
            if refusal is None and message is None and not bound:
                refusal = self._recv_refusal(src)
                conflict = None if refusal else self._tracker.on_post(src, tag, time.monotonic())
                if conflict is not None:
                    refusal = BackendError(f"{work.description}: {conflict}")
                if refusal is None:
                    self._table.post(op)
                    # No wake-up here: waking the progress thread on every receive costs the
                    # caller a GIL hand-off (about a scheduler tick on a busy host). The thread
                    # never sleeps longer than PROBE_AFTER_S (_probe_timeout), so a due probe
                    # goes out at most that late.
                    self._tracker.wake_needed = False
                    for channel in rings:  # an entry for this receive lands in place
                        self._drain(channel, done, force=True)
            if message is not None and not message.done:
                if len(message.buffer) == view.nbytes:
                    message.waiter = op  # completes when the rest of the body is in
                    message = None
                else:
                    refusal = self._size_error(op, message.src, len(message.buffer))
        for peer in released:
            self._sync_read_interest(peer)
        if polls:
            self._ring_post_at = time.monotonic()
            if self._long_sleep:  # read after posting: see _select_timeout
                self._wake()
        self._finish(done)
        if refusal is not None:
            work.set_exception(refusal)
        elif message is not None:
            self._complete_from(op, message)
        return work

    # -- blocking calls of small host arrays, without a Work ---------------------------------
    def send(self, array: np.ndarray, dst: int, tag: int) -> None:
        """Send a C-contiguous ``array`` to ``dst``; return once the kernel or the ring has it.

        A message small enough for the ring of a host peer is written there (no Work, no
        byte view: the compiled piece reads the array itself); anything else is :meth:`isend`.
        """
        channel = self._channel_for(dst)
        if channel is not None and array.nbytes <= channel.inline_max:
            if channel.lock_free:  # one compiled write (Channel says why no lock is needed)
                if self._may_write_ring(dst) and channel.try_send(array, tag):
                    return
            else:
                with channel.send_lock:
                    if self._may_write_ring(dst) and channel.try_send(array, tag):
                        return
        work = self.isend(array, dst, tag)
        if work is self._delivered:
            return
        if channel is not None and self._remote_channels and self._shm_group.spin_iterations:
            # A send the peer reads from this memory (shm_remote) ends when the peer has read
            # it: while every rank has a core, look for that (and for the peer's own messages)
            # without yielding first, as a blocking receive spins on the ring.
            until = time.perf_counter() + REMOTE_SPIN_SECONDS
            while not work.is_completed() and time.perf_counter() < until:
                self._poll_sends()
        work.wait()

    def recv(self, array: np.ndarray, src: int | None, tag: int) -> int:
        """Receive into a C-contiguous ``array`` from ``src`` (None: any); return the sender.

        A blocking receive of a user message small enough for the ring, from a host peer, takes
        the message straight into ``array`` when it is next, in the unexpected queue or in the
        ring, now or while this thread polls as a receive's waiter would
        (:func:`poll_briefly`): no Work, future or posted receive. Everything else, and a
        message that is not there by then, goes through :meth:`irecv` and its rules.
        """
        channel = None if src is None or tag < 0 else self._channel_for(src)
        if channel is not None and array.nbytes <= channel.inline_max:
            taken = self._try_take(channel, array, tag)  # already there: no poll loop
            if taken is None:
                taken = self._await_ring(channel, array, tag)
            if taken:
                return channel.rank
        return self.irecv(array, src, tag).source_rank()

    def _await_ring(self, channel: Channel, array: np.ndarray, tag: int) -> bool:
        """Take message ``tag`` for ``array`` from ``channel``'s peer once it comes (within a
        waiter's polls); False: leave it to irecv."""
        group = self._shm_group
        if group.spin_iterations:
            # Spin on the ring alone: a message that comes over the socket meanwhile (a rare
            # path for a ring-sized one) is found by the polls below.
            if channel.spin_for_news(group.spin_iterations * SPIN_ITERATION_SECONDS):
                outcome = self._take_next(channel, array, tag)
                if outcome is not None:
                    return outcome
        taken = False

        def settled() -> bool:
            nonlocal taken
            outcome = self._try_take(channel, array, tag)
            if outcome is None:
                return False
            taken = outcome
            return True

        poll_briefly(settled, 0, YIELD_SECONDS)
        return taken

    def _try_take(self, channel: Channel, array: np.ndarray | memoryview, tag: int
                  ) -> bool | None:
        """:meth:`_take_next` if the ring or the unexpected queue holds something from the peer.

        A poll looks only there. What else makes a blocking receive give way (a receive posted
        by another thread, a broken group) is found by :meth:`_take_next` when something comes,
        or by irecv once the polls are over.
        """
        if channel.has_news() or self._table.queued(channel.rank, tag):
            return self._take_next(channel, array, tag)
        return None

    def _take_next(self, channel: Channel, array: np.ndarray | memoryview, tag: int
                   ) -> bool | None:
        """Copy the message a receive ``tag`` from ``channel``'s peer takes next into ``array``.

        Returns False when that is not for this call to do (irecv decides: a posted receive
        comes first, the message is still arriving or has another size, the group is broken)
        and None when there is no message yet.
        """
        src = channel.rank
        table = self._table
        with self._lock:
            # _refusal()'s test, without building its error
            if self._closed or self._broken is not None or self._held:
                return False
            if table.empty():  # the common case: nothing posted, nothing queued
                return channel.take(array, tag, self._arrivals.get(src, 0))
            if table.expects(src, tag):
                return False
            message = table.first_unexpected(src, tag)
            if message is None:
                return channel.take(array, tag, self._arrivals.get(src, 0))
            if not message.done or len(message.buffer) != array.nbytes:
                return False
            table.take_unexpected(src, tag)
            copy_bytes(byte_view(array, name="array", writable=True), message.buffer)
            table.recycle(message.buffer)
        return True

    # --------------------------------------------------------------------------- host peers
    def use_shm(self, channels: Channels) -> None:
        """Send to and receive from the host peers in ``channels`` through shared memory.

        Called once, right after the backend mapped the host's memory and before any
        point-to-point call.
        """
        with self._lock:
            self._channel_maker = channels
            self._host_peers = frozenset(channels.ranks)
            self._silent = [(rank, channels.announced(rank)) for rank in channels.ranks]
            self._shm_group = channels.group
            self._inline_max = channels.group.segments[channels.group.rank].ring_bytes // 2
        self._long_sleep = True  # the thread went to sleep before it had rings to look at
        # Only now may peers write into our rings: a socket message read before this point was
        # matched without looking at them (shm_p2p, "Order").
        channels.group.p2p_open()

    def _count_arrival(self, src: int) -> None:
        """Count a socket message from ``src`` that reached the match table (lock held).

        Counted for every rank from the start, before the host's memory is attached: a host
        peer that attached first may already have sent over the socket, and its ring entries
        count those messages too.
        """
        self._arrivals[src] = self._arrivals.get(src, 0) + 1

    def ring_serves(self, src: int | None, nbytes: int) -> bool:
        """Whether a user message of ``nbytes`` from ``src`` comes through a host peer's ring."""
        return src is not None and nbytes <= self._inline_max and src in self._host_peers

    def _rings_may_serve(self, src: int | None) -> bool:
        """Whether a receive from ``src`` (None: any rank) may take its message from a ring."""
        return bool(self._host_peers) if src is None else src in self._host_peers

    def _rings_for(self, src: int | None) -> list[Channel]:
        """Return the rings whose entries a receive from ``src`` (None: any rank) may take now:
        ``src``'s, or every channel whose peer has written to this rank."""
        if src is not None:
            channel = self._channel_for(src)
            return [channel] if channel is not None else []
        if self._silent:
            self._open_announced()
        return self._channel_list

    def _channel_for(self, rank: int) -> Channel | None:
        """Return the channel to ``rank``, made now if it is a host peer without one yet; None
        for a rank reached only over its socket."""
        channel = self._channels.get(rank)
        if channel is None and rank in self._host_peers:
            channel = self._open_channel(rank)
        return channel

    def _open_channel(self, rank: int) -> Channel:
        """Make the channel to host peer ``rank`` (once, whichever thread asks first)."""
        with self._channel_lock:
            channel = self._channels.get(rank)
            if channel is None:
                assert self._channel_maker is not None  # rank is a host peer: use_shm ran
                channel = self._channel_maker.make(rank)
                self._channels[rank] = channel
                self._channel_list = [*self._channel_list, channel]
                self._silent = [entry for entry in self._silent if entry[0] != rank]
            return channel

    def _open_announced(self) -> None:
        """Make the channels of the host peers that have announced they write to this rank."""
        for rank, announced in self._silent:
            if announced():
                self._open_channel(rank)

    def _drain(self, channel: Channel, done: list[tuple[RecvOp, Any]], *, force: bool) -> None:
        """Move ``channel``'s ring entries into the match table, in order (lock held).

        An entry waits while socket messages sent before it are still to come. An entry no
        receive takes becomes unexpected; without ``force`` only while the unexpected bytes stay
        under MAX_UNEXPECTED_BYTES (it waits in the ring otherwise, which bounds it), unless a
        receive from that rank is posted: the message it waits for may be behind this one (as
        no socket message is held then). ``force``: a receive is being posted, or a socket
        message behind these entries is being matched.
        Completions (op, source rank or exception) are appended to ``done`` for after the lock.
        """
        src = channel.rank
        while True:
            entry = channel.peek()
            if entry is None:
                return
            tag, nbytes, before = entry
            if before >= REMOTE_FLAG:  # a message to read from the sender's memory
                if not self._drain_remote(channel, done, force, tag, nbytes,
                                          before ^ REMOTE_FLAG):
                    return
                continue
            if before > self._arrivals.get(src, 0):
                return
            op = self._table.match_arrival(src, tag)
            if op is None and not force and not self._table.awaits(src):
                buffered = self._table.unexpected_bytes + nbytes + MESSAGE_OVERHEAD_BYTES
                if buffered > MAX_UNEXPECTED_BYTES:
                    return
            stale, conflict = self._tracker.on_arrival(src, tag, op is not None, self._table)
            for stale_op in stale:  # a receive this message proves can never match
                done.append((stale_op, BackendError(f"{stale_op.work.description}: {conflict}")))
            if op is not None and op.view.nbytes == nbytes and channel.take(op.view, tag, before):
                done.append((op, src))  # copied in place and consumed
                continue
            payload = channel.payload(nbytes)
            if op is None:
                message = self._table.add_unexpected(src, tag, nbytes)
                copy_bytes(message.buffer, payload)
                message.done = True
            elif op.view.nbytes != nbytes:
                done.append((op, self._size_error(op, src, nbytes)))
            else:  # an entry take() would not copy (its header is out of bounds): as before
                copy_bytes(op.view, payload)
                done.append((op, src))
            payload.release()
            channel.pop(nbytes)

    def _drain_remote(self, channel: Channel, done: list[tuple[RecvOp, Any]], force: bool,
                      tag: int, entry_nbytes: int, before: int) -> bool:
        """Move the remote entry next in ``channel`` into the match table, reading its message
        from the sender's memory (shm_remote; lock held). False: it waits, as :meth:`_drain`
        lets an entry wait."""
        src = channel.rank
        if before > self._arrivals.get(src, 0):
            return False
        address, nbytes, ticket = channel.remote_entry(entry_nbytes)
        op = self._table.match_arrival(src, tag)
        if op is None and not force and not self._table.awaits(src):
            buffered = self._table.unexpected_bytes + nbytes + MESSAGE_OVERHEAD_BYTES
            if buffered > MAX_UNEXPECTED_BYTES:
                return False
        stale, conflict = self._tracker.on_arrival(src, tag, op is not None, self._table)
        for stale_op in stale:
            done.append((stale_op, BackendError(f"{stale_op.work.description}: {conflict}")))
        if op is None:
            message = self._table.add_unexpected(src, tag, nbytes)
            failure = channel.read_remote(address, message.buffer)
            if failure is None:
                message.done = True
            else:
                self._table.discard(message)
                logger.warning("tcp: rank %d dropped a message of %d bytes from rank %d: %s",
                               self.rank, nbytes, src, failure)
        elif op.view.nbytes != nbytes:
            done.append((op, self._size_error(op, src, nbytes)))
        else:
            failure = channel.read_remote(address, op.view)
            done.append((op, src if failure is None else NetworkError(
                f"{op.work.description}: rank {src}: {failure}")))
        channel.pop(entry_nbytes)
        channel.acknowledge(ticket)
        return True

    def poll_rings(self) -> bool:
        """Move what the host peers' rings hold into the match table (any thread).

        Returns whether some receive completed.
        """
        if self._closed:
            return False
        if self._silent:
            self._open_announced()
        news = [channel for channel in self._channel_list if channel.has_news()]
        if not news:
            return False
        done: list[tuple[RecvOp, Any]] = []
        with self._lock:
            if self._refusal() is not None:
                return False
            for channel in news:
                self._drain(channel, done, force=False)
        self._finish(done)
        return bool(done)

    @staticmethod
    def _finish(done: list[tuple[RecvOp, Any]]) -> None:
        """Complete the receives :meth:`_drain` matched (no lock held)."""
        for op, value in done:
            if isinstance(value, BaseException):
                op.work.set_exception(value)
            else:
                op.work.set_result(value)

    def join(self, *, ring: bool = True) -> None:
        """Publish this rank's address and connect to its two ring neighbours (blocking).

        Every other connection opens when first needed. The ring is opened at once because a
        rank that dies must be seen by someone: its neighbours see its connections drop and
        break the group (colls.health), which every other rank then learns from the store. It
        also makes group creation fail, naming the rank, when a neighbour never comes. Rank
        ``r`` dials ``r - 1`` and waits for ``r + 1`` (modulo the size); of two ranks, rank 1
        dials and rank 0 waits, so each pair is opened from one side. ``ring=False`` (every
        member of the group alike) only publishes: a subgroup of a tcp world, whose ring
        already watches every rank.

        Raises:
            CollsTimeoutError: a neighbour did not publish, connect or answer within the group
                timeout (named).
            NetworkError / BackendError: a connection failed or was refused.
        """
        if self._mesh is None or self._world_size == 1:
            return
        deadline = time.monotonic() + self._timeout
        self._mesh.publish()
        if not ring:
            return
        n = self._world_size
        if self.rank > 0 or n > 2:
            self._links.connect((self.rank - 1) % n, deadline)
        self._links.wait_for((self.rank + 1) % n, deadline)

    def connected_ranks(self) -> list[int]:
        """Return the ranks this rank holds a connection to (dead ones included), sorted."""
        return sorted(self._peers)

    def _open(self, dst: int) -> Peer:
        """Dial ``dst`` for a send (caller thread); a failure breaks the group, naming it.

        Raises:
            BackendError: the group is closed or broken.
            NetworkError: ``dst`` never published, accepted or answered (names it).
        """
        refusal = self._refusal()
        if refusal is not None:
            raise refusal
        try:
            return self._links.connect(dst)
        except CollsError as exc:
            if self._refusal() is not None:
                raise
            # A NetworkError, not the CollsTimeoutError itself: Work.wait() takes a
            # TimeoutError raised by its future for its own timeout.
            error = NetworkError(f"tcp: rank {self.rank} cannot reach rank {dst}: {exc}")
            error.__cause__ = exc
            listener = self._on_peer_lost
            if listener is not None:
                listener(dst, error)
            raise error from exc

    def _register(self, peer: Peer) -> None:
        """Watch a new peer's socket for reading (Links calls it under its lock)."""
        if self._world_size == 1:
            return
        peer.sock.setblocking(False)
        self._selector.register(peer.sock, selectors.EVENT_READ, peer)
        peer.events = selectors.EVENT_READ

    def peer_error(self, rank: int) -> BaseException | None:
        """Return why waiting for ``rank`` is pointless (closed, broken, peer lost), or None.

        Used by the shared-memory collectives, which learn of a dead peer from its connection.
        They call it while they sleep, so it also moves ring entries into the match table: a
        host peer blocked in a send this rank is to read from its memory (shm_remote) must not
        wait for this rank's collective to end, which may need that peer.
        """
        if self._channel_list:
            self.poll_rings()
        refusal = self._refusal()
        if refusal is not None:
            return refusal
        peer = self._peers.get(rank)
        return peer.dead if peer is not None else None

    # -- fail-fast hooks (colls.health) --------------------------------------------------------
    def set_failure_listener(self, callback: Callable[[int, BaseException], None]) -> None:
        """Call ``callback(rank, error)`` (progress thread) when a peer vanishes abruptly."""
        self._on_peer_lost = callback

    def abort(self, error: BackendError) -> None:
        """Fail every pending operation with ``error`` and refuse new ones. Idempotent.

        The group is broken: connections stay open (peers learn the cause from colls.health,
        not from a dropped connection) until close(). Buffers of failed receives are undefined.
        """
        with self._lock:
            if self._closed or self._broken is not None:
                return
            self._broken = error
            pending: list[Any] = self._table.remove_all()
            peers = self._links.snapshot()
            for peer in peers:
                pending.extend(self._rx_pending(peer))
        for peer in peers:
            with peer.send_lock:
                pending.extend(peer.send_queue)
        for op in pending:
            op.work.set_exception(error)

    def _probe_timeout(self) -> float:
        """Seconds the progress thread may sleep: until the next probe, at most PROBE_AFTER_S.

        The bound lets a receive posted while the thread sleeps get its probe in time without
        waking the thread (an idle engine wakes twice a second: no measurable CPU).
        """
        due = self._tracker.next_probe
        if due is None:
            return PROBE_AFTER_S
        return min(PROBE_AFTER_S, max(0.0, due - time.monotonic()))

    def _send_probes(self) -> None:
        """Ask peers about collective receives pending too long (progress thread)."""
        with self._lock:
            due = self._tracker.due_probes(time.monotonic(), self._table)
        for src, tag in due:
            peer = self._peers.get(src)
            if peer is not None:
                self._send_probe(peer, tag)
            elif self._mesh is not None:  # dialling blocks: not on the progress thread
                threading.Thread(target=self._dial_and_probe, args=(src, tag),
                                 name=f"colls-tcp-probe:{self.rank}", daemon=True).start()

    def _dial_and_probe(self, src: int, tag: int) -> None:
        """Connect to ``src``, which this rank only receives from, to probe it (own thread)."""
        try:
            peer = self._links.connect(src)
        except CollsError as exc:  # the receive itself fails by timeout or the broken group
            logger.info("tcp: rank %d could not probe rank %d: %s", self.rank, src, exc)
            return
        self._send_probe(peer, tag)

    def _send_probe(self, peer: Peer, tag: int) -> None:
        header = memoryview(HEADER.pack(PROBE_TAG, probe_field(tag)))
        with peer.send_lock:
            if peer.dead is not None:
                return
            peer.send_queue.append(SendOp(Work(), deque([header]), None))
        self._flush(peer)

    def _send_control(self, peer: Peer, tag: int, field: int) -> None:
        """Queue a header-only control frame for the progress thread to send (any thread).

        Called under ``_lock`` by hold and release, so the frames leave in the order of the
        changes they announce.
        """
        with peer.send_lock:
            if peer.dead is not None:
                return
            peer.send_queue.append(SendOp(Work(), deque([memoryview(HEADER.pack(tag, field))]),
                                          None))
        self._request_write(peer)

    def _on_probe(self, peer: Peer, expected: int) -> None:
        with self._lock:
            stale, conflict, answer = self._tracker.on_probe(peer.rank, expected, self._table)
        for op in stale:
            op.work.set_exception(BackendError(f"{op.work.description}: {conflict}"))
        if answer is not None:
            self._send_probe(peer, answer)  # the prober learns of the conflict too

    def close(self) -> None:
        """Stop the thread, say goodbye to peers, close sockets, fail pending work. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread is not None:
            self._wake()
            self._thread.join(JOIN_TIMEOUT_SECONDS)
            if self._thread.is_alive():
                logger.warning("tcp: progress thread %s did not exit", self._thread.name)
        closed = BackendError("tcp backend closed")
        works = [op.work for op in self._release_all(goodbye=True)]
        if self._thread is not None:
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()
        for work in works:
            work.set_exception(closed)

    # --------------------------------------------------------------------------- refusals
    def _refusal(self) -> BackendError | None:
        if self._closed:
            return BackendError("tcp backend closed")
        return self._broken

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

    def _all_gone(self) -> bool:
        """Whether every other rank has connected and left (no any-source message can come).

        A group of one has no other rank: a receive there waits for its timeout, as in torch.
        """
        peers = self._links.snapshot()
        return bool(peers) and len(peers) == self._world_size - 1 and all(p.dead for p in peers)

    @staticmethod
    def _size_error(op: RecvOp, src: int, nbytes: int) -> BackendError:
        return size_error(op.work.description, src, op.tag, nbytes, op.view.nbytes)

    # --------------------------------------------------------------------------- completion
    def _complete_from(self, op: RecvOp, message: Message) -> None:
        """Complete ``op`` by copying a fully received unexpected ``message``."""
        if len(message.buffer) != op.view.nbytes:
            op.work.set_exception(self._size_error(op, message.src, len(message.buffer)))
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
            op.work.set_exception(self._size_error(op, self.rank, view.nbytes))
        elif op is not None:
            copy_bytes(op.view, view)
            op.work.set_result(self.rank)
        work.set_result(None)
        return work

    # --------------------------------------------------------------------------- wake-ups
    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (a wake-up is already pending) or closed
            pass

    def _request_write(self, peer: Peer) -> None:
        """Ask the progress thread to flush ``peer``'s send queue."""
        with self._wake_lock:
            self._want_write.add(peer)
            send = not self._wake_sent
            self._wake_sent = True
        if send:
            self._wake()

    def _on_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        with self._wake_lock:
            peers = list(self._want_write)
            self._want_write.clear()
            self._wake_sent = False
        for peer in peers:
            self._flush(peer)

    # --------------------------------------------------------------------------- progress thread
    def _run(self) -> None:
        try:
            while not self._closed:
                if self._tracker.next_probe is not None:
                    self._send_probes()
                if self._held and self._renewals.due():
                    self._renew_holds()
                if self._leases.due:
                    self._drop_silent_holders()
                for key, mask in self._selector.select(self._select_timeout()):
                    peer = key.data
                    if peer is None:
                        self._on_wake()
                        continue
                    if not isinstance(peer, Peer):
                        self._on_handshake(key)
                        continue
                    if mask & selectors.EVENT_WRITE and peer.dead is None:
                        self._flush(peer)
                    if mask & selectors.EVENT_READ and peer.dead is None:
                        with self._rx_lock:
                            self._on_readable(peer)
                        if peer.rx_mode == RX_HELD:
                            self._sync_read_interest(peer)
                if self._incoming:
                    self._drop_half_open()
                if self._host_peers:
                    self.poll_rings()
                    if self._remote_channels:
                        self._reap_remote()
        except BaseException as exc:  # never die silently: fail everything pending
            self._crash(exc)

    # --------------------------------------------------------------------------- accepting
    def _select_timeout(self) -> float:
        """Sleep until the next probe is due or the next handshake times out."""
        timeout = self._probe_timeout()
        if self._host_peers:
            # Set before looking at the table: a receive posted after the look sees the flag
            # and wakes the thread. Ticking lingers after the last receive so that a stream of
            # receives does not wake the thread once each.
            self._long_sleep = True
            now = time.monotonic()
            with self._lock:  # caller threads post and take receives meanwhile
                posted = self._table.posted_count()
            if posted or self._remote_channels or now - self._ring_post_at < TICK_LINGER_SECONDS:
                self._long_sleep = False
                # A ring entry wakes no one: look (rarely while a waiter polls the rings).
                tick = DRIVEN_TICK_SECONDS if self._drivers else TICK_SECONDS
                timeout = min(timeout, tick)
        if self._incoming:
            first = min(state.deadline for state in self._incoming.values())
            timeout = min(timeout, max(0.0, first - time.monotonic()))
        return timeout

    def _on_handshake(self, key: selectors.SelectorKey) -> None:
        """Accept a connection on the listener, or read a hello on an accepted one."""
        assert self._mesh is not None  # only a lazy group registers handshakes
        if key.data is self._mesh:
            accepted = self._mesh.accept()
            if accepted is not None:
                sock, state = accepted
                self._incoming[sock] = state
                self._selector.register(sock, selectors.EVENT_READ, state)
            return
        sock = key.fileobj
        assert isinstance(sock, socket.socket)
        try:
            hello = self._mesh.read_hello(sock, key.data)
        except (HelloError, OSError) as exc:
            logger.warning("tcp: rank %d refused a connection from %s: %s",
                           self.rank, peer_name(sock), exc)
            self._end_handshake(sock)
            sock.close()
            return
        if hello is not None:
            self._end_handshake(sock)
            self._links.on_hello(sock, hello)

    def _end_handshake(self, sock: socket.socket) -> None:
        self._selector.unregister(sock)
        del self._incoming[sock]

    def _drop_half_open(self) -> None:
        """Close connections that sent no valid hello within COLLS_HANDSHAKE_TIMEOUT."""
        now = time.monotonic()
        for sock, state in list(self._incoming.items()):
            if state.deadline <= now:
                logger.warning("tcp: rank %d dropped a half-open connection from %s: no valid "
                               "hello within %.1f s", self.rank, peer_name(sock),
                               self._mesh.handshake_s if self._mesh else 0.0)
                self._end_handshake(sock)
                sock.close()

    def _crash(self, exc: BaseException) -> None:
        logger.exception("tcp: progress thread of rank %d failed", self.rank)
        error = BackendError(f"tcp: progress thread of rank {self.rank} failed: {exc!r}")
        error.__cause__ = exc
        with self._lock:
            self._broken = error
        for op in self._release_all(goodbye=False):
            op.work.set_exception(error)

    def _set_write_interest(self, peer: Peer, on: bool) -> None:
        """Watch ``peer`` for writability or stop (``send_lock`` held)."""
        peer.want_write = on
        self._watch(peer)

    def _watch(self, peer: Peer) -> None:
        """Make the selector watch what ``peer`` needs now (``send_lock`` held).

        Reading stops while a message is held, writing is watched while sends are queued. Any
        thread may call this: the selector tolerates changes while another thread selects.
        """
        events = (0 if peer.rx_mode == RX_HELD else selectors.EVENT_READ) | (
            selectors.EVENT_WRITE if peer.want_write else 0
        )
        if events == peer.events or peer.dead is not None:
            return
        if not events:
            self._selector.unregister(peer.sock)
        elif not peer.events:
            self._selector.register(peer.sock, events, peer)
        else:
            self._selector.modify(peer.sock, events, peer)
        peer.events = events

    def _sync_read_interest(self, peer: Peer) -> None:
        """Stop or resume reading ``peer`` after its message was held or released.

        The state is read under ``send_lock`` by whichever thread changed it last, so a pause
        racing a release always ends with the release's choice.
        """
        with peer.send_lock:
            self._watch(peer)

    def _must_hold(self, src: int, nbytes: int) -> bool:
        """Return whether a message from ``src`` nobody receives yet stays in the socket.

        Never while a receive that could take a later message from ``src`` is posted: that
        message may be behind this one on the stream (:meth:`_release_held` reads past held
        messages for the same reason). Called with the lock held.
        """
        if nbytes == 0:
            # Nothing to hold back, and a held message is released into a body read, where
            # reading an empty body (recv_into of an empty view returns 0) looks like EOF: the
            # connection was lost when the unexpected messages filled their budget.
            return False
        if nbytes < HOLD_MIN_BYTES:
            buffered = self._table.unexpected_bytes + nbytes + MESSAGE_OVERHEAD_BYTES
            if buffered <= MAX_UNEXPECTED_BYTES:
                return False
        return not self._table.awaits(src)

    def _hold(self, peer: Peer, tag: int, nbytes: int) -> None:
        """Leave the body of ``peer``'s message unread until its receive is posted (lock held)."""
        peer.held_tag, peer.held_nbytes = tag, nbytes
        peer.rx_mode = RX_HELD
        self._renewals.started(holding_before=bool(self._held))
        self._held.add(peer)
        self._send_control(peer, HOLD_TAG, 1)

    def _renew_holds(self) -> None:
        """Tell every peer whose message this rank still holds that it does (progress thread)."""
        with self._lock:  # under the lock, so a renewal never follows the release it would undo
            for peer in self._held:
                self._send_control(peer, HOLD_TAG, 1)

    def _drop_silent_holders(self) -> None:
        """Fail the peers that held a message of ours and stopped renewing (progress thread)."""
        for peer in self._leases.expired(deaf_to=lambda held: held.rx_mode == RX_HELD):
            self._fail_peer(peer, f"it held a message of rank {self.rank} unread and sent no "
                            f"word for {self._leases.length_s:.0f} s (COLLS_KEEPALIVE_*): its "
                            "host is gone or the link to it is down")

    def _release_held(self, op: RecvOp) -> tuple[bool, list[Peer]]:
        """Let receive ``op`` take a held message, or release those that could block it.

        A held message from ``op``'s source with ``op``'s tag and size is bound to ``op``: its
        body is read straight into ``op.view``. Any other held message that ``op`` might be
        waiting behind (same source, or any source for an any-source receive) becomes an
        ordinary unexpected message, read into a buffer of its own. Called with the lock held;
        returns whether ``op`` was bound and the peers to read again.
        """
        if op.src is None:
            peers = list(self._held)
        else:
            peers = [p for p in self._held if p.rank == op.src]
        bound = False
        for peer in peers:
            self._held.discard(peer)
            self._send_control(peer, HOLD_TAG, 0)
            tag, nbytes = peer.held_tag, peer.held_nbytes
            if not bound and tag == op.tag and nbytes == op.view.nbytes:
                bound = True
                peer.rx_op, target = op, op.view
            else:
                peer.rx_msg = self._table.add_unexpected(peer.rank, tag, nbytes)
                target = memoryview(peer.rx_msg.buffer)
            peer.rx_view, peer.rx_pos = target, 0
            peer.rx_mode = RX_BODY  # last: a reader checks the mode without the lock
            self._count_arrival(peer.rank)
        return bound, peers

    def _flush(self, peer: Peer) -> None:
        """Write as much of ``peer``'s send queue as the kernel takes (progress thread)."""
        finished: list[SendOp] = []
        error: OSError | None = None
        with peer.send_lock:
            if peer.dead is not None:
                return
            try:
                while peer.send_queue:
                    iov = gather(peer.send_queue)
                    offered = sum(map(len, iov))
                    sent = peer.sock.sendmsg(iov, (), _SEND_FLAGS)
                    partial = sent < offered
                    while peer.send_queue:
                        head = peer.send_queue[0]
                        head.started = head.started or sent > 0
                        sent = consume(head.buffers, sent)
                        if head.buffers:
                            break
                        finished.append(peer.send_queue.popleft())
                    if partial:
                        break  # the kernel buffer is full: wait for writability
            except BlockingIOError:
                pass
            except OSError as exc:
                error = exc
            if error is None:
                self._set_write_interest(peer, bool(peer.send_queue))
        for op in finished:
            op.work.set_result(None)
        if error is not None:
            self._fail_peer(peer, f"send failed: {error}")

    def poll_until(self, work: Work, seconds: float = CALLER_POLL_SECONDS) -> None:
        """Read the sockets on the calling thread until ``work`` completes or ``seconds`` pass.

        A thread about to wait for a receive calls this first: when the message comes within
        the budget, it is read and completed right here, without waking the progress thread
        and then the waiter (two scheduler wake-ups and GIL hand-offs per message). Only one
        thread reads at a time (``_rx_lock``); a connection error is left to the progress
        thread to report.
        """
        if self._thread is None:
            return
        peers = list(self._peers.values())
        deadline = time.perf_counter() + seconds
        polls = 0
        rings = bool(self._host_peers)
        while not work.is_completed():
            if rings:
                self.poll_rings()
            if self._rx_lock.acquire(blocking=False):
                try:
                    for peer in peers:
                        if peer.dead is None:
                            self._on_readable(peer, caller=True)
                finally:
                    self._rx_lock.release()
            if work.is_completed() or time.perf_counter() >= deadline:
                return
            polls += 1
            if polls % CALLER_POLLS_PER_YIELD == 0:
                os.sched_yield()  # ranks may outnumber cores: let the sender run

    def _on_readable(self, peer: Peer, *, caller: bool = False) -> int:
        """Read what ``peer``'s socket holds, a bounded number of calls (``_rx_lock`` held).

        Returns the bytes read. ``caller``: a waiting thread polls (:meth:`poll_until`); it
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
            self._advance_rx(peer, n)
            if peer.dead is not None:
                return total
        return total

    def _scratch_view(self) -> memoryview:
        if self._scratch is None:
            self._scratch = memoryview(bytearray(DRAIN_CHUNK_BYTES))
        return self._scratch

    def _advance_rx(self, peer: Peer, n: int) -> None:
        if peer.rx_mode == RX_DRAIN:
            peer.rx_left -= n
            if peer.rx_left == 0:
                peer.reset_rx()
            return
        peer.rx_pos += n
        if peer.rx_pos < len(peer.rx_view):
            return
        if peer.rx_mode == RX_BODY:
            self._finish_body(peer)
            return
        tag, nbytes = HEADER.unpack(peer.rx_header)
        if tag == GOODBYE_TAG:
            self._fail_peer(peer, "peer closed its backend", orderly=True)
        elif tag == PROBE_TAG:
            peer.reset_rx()
            self._on_probe(peer, probed_tag(nbytes))
        elif tag == HOLD_TAG:  # the peer holds our message unread (1) or no longer (0)
            peer.reset_rx()
            if nbytes:
                self._leases.grant(peer)
            else:
                self._leases.end(peer)
            bound_unacknowledged(peer.sock, on=nbytes == 0)
        elif nbytes > self._max_message:
            self._fail_peer(peer, f"it announced a message of {nbytes} bytes (tag {tag}), more "
                            f"than COLLS_MAX_MESSAGE_BYTES={self._max_message} allows")
        else:
            self._start_body(peer, tag, nbytes)

    def _start_body(self, peer: Peer, tag: int, nbytes: int) -> None:
        """Route the body of a message whose header just arrived."""
        mismatched = None
        channel = self._channel_for(peer.rank)
        done: list[tuple[RecvOp, Any]] = []
        with self._lock:
            if channel is not None:  # ring entries sent before this message come first
                self._drain(channel, done, force=True)
            op = self._table.match_arrival(peer.rank, tag)
            stale, conflict = self._tracker.on_arrival(peer.rank, tag, op is not None, self._table)
            hold = op is None and not stale and self._must_hold(peer.rank, nbytes)
            if not hold:
                self._count_arrival(peer.rank)
            if hold:
                self._hold(peer, tag, nbytes)
            elif op is None:
                peer.rx_msg = self._table.add_unexpected(peer.rank, tag, nbytes)
                target = memoryview(peer.rx_msg.buffer)
            elif op.view.nbytes != nbytes:
                mismatched = op
            else:
                peer.rx_op = op
                target = op.view
        self._finish(done)
        if hold:
            return
        for stale_op in stale:  # a receive this message proves can never match
            stale_op.work.set_exception(BackendError(f"{stale_op.work.description}: {conflict}"))
        if mismatched is not None:
            mismatched.work.set_exception(self._size_error(mismatched, peer.rank, nbytes))
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
        channel = self._channel_for(peer.rank)
        unread: list[Any] = []
        if channel is not None:  # what it wrote into its ring before it left is delivered
            delivered: list[tuple[RecvOp, Any]] = []
            with self._lock:
                if self._refusal() is None:
                    self._drain(channel, delivered, force=True)
            self._finish(delivered)
            unread = self._unread_remote(channel, withdraw=False)
        error = NetworkError(
            f"tcp: connection to rank {peer.rank} ({peer.address}) lost: {cause}"
        )
        peer.dead = error
        self._leases.end(peer)
        listener = self._on_peer_lost
        if not orderly and listener is not None:
            listener(peer.rank, error)  # colls.health breaks the group before works fail
        with peer.send_lock:
            sends = list(peer.send_queue)
            peer.send_queue.clear()
            if peer.events:
                self._selector.unregister(peer.sock)
                peer.events = 0
            peer.sock.close()
        with self._lock:
            self._held.discard(peer)
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

    def _unread_remote(self, channel: Channel, *, withdraw: bool) -> list[Any]:
        """Complete ``channel``'s remote sends its peer has read; remove and return the others
        (their Works are to fail). ``withdraw``: tell the peer not to read them any more."""
        with channel.send_lock:
            read = channel.acknowledged()
            unread = list(channel.remote_sends.values())
            channel.remote_sends.clear()
            self._remote_channels.discard(channel)
            if unread and withdraw:
                channel.withdraw()
        for sent in read:
            sent.work.set_result(None)
        return unread

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
        for sock in list(self._incoming):
            sock.close()
        self._incoming.clear()
        if self._mesh is not None:
            self._mesh.close()
        for channel in list(self._channel_list):  # before their arrays may be freed
            pending.extend(self._unread_remote(channel, withdraw=True))
        peers = self._links.snapshot()
        for peer in peers:
            with peer.send_lock:
                pending.extend(peer.send_queue)
                mid_frame = bool(peer.send_queue) and peer.send_queue[0].started
                peer.send_queue.clear()
                if peer.dead is None:
                    if goodbye and not mid_frame:
                        try:
                            peer.sock.send(_GOODBYE, _SEND_FLAGS)
                        except OSError:
                            pass
                    peer.dead = NetworkError(f"tcp: connection to rank {peer.rank} closed")
                    peer.sock.close()
        with self._lock:
            for peer in peers:
                pending.extend(self._rx_pending(peer))
            pending.extend(self._table.remove_all())
        return pending
