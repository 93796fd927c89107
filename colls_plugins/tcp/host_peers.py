"""Host peers: point-to-point with the ranks of this host through rings in shared memory.

Once the backend's shared memory is up (:meth:`HostPeers.use`), small messages to and from the
ranks of this host go through rings in shared memory (:mod:`colls_plugins.tcp.shm.p2p`, which
also explains how the order of messages that take different transports is kept), and larger ones
are read from the sender's memory where the host allows it (:mod:`colls_plugins.tcp.shm.remote`).
Ring entries are matched in the engine's table, under the same lock, by the same rules as socket
messages: :class:`HostPeers` works on the engine's :class:`~colls_plugins.tcp._matching.Inbox`.

A channel to a host peer is made when it is first needed (:meth:`HostPeers.channel_for`): by a
send to the peer, a receive from it, a socket message from it, or its first ring entry.

Nothing wakes a thread when an entry lands in its ring. A waiter polls the rings itself
(:class:`~colls_plugins.tcp.shm.p2p.PollingFuture`), and the progress thread looks at them on a
short tick while receives that a ring may complete are posted (:meth:`HostPeers.timeout`); it
sleeps without looking otherwise, and a receive posted then wakes it.

A blocking receive of a ring-sized message (:meth:`HostPeers.try_take`,
:meth:`HostPeers.await_ring`) takes it straight into the caller's array when it is next: no
Work, future or posted receive.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from colls.errors import BackendError, NetworkError
from colls.matching import MESSAGE_OVERHEAD_BYTES, RecvOp, copy_bytes
from colls.work import Work
from colls_plugins.tcp._frames import byte_view
from colls_plugins.tcp._matching import (
    MAX_UNEXPECTED_BYTES,
    Completions,
    Inbox,
    finish,
    wrong_size,
)
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

#: How long a blocking send that a host peer reads from this rank's memory (shm_remote) polls
#: for the peer's acknowledgement before it waits as a receive does (seconds): the peer copies
#: a 1 MiB message in about 0.2 ms.
REMOTE_SPIN_SECONDS = 0.0005


class HostPeers:
    """The channels to the ranks of this host, and their ring entries' way into the match table.

    Args:
        rank: this rank (for logs).
        inbox: the engine's matching state, shared with the socket path.
        timeout: default ``wait()`` timeout of the Works of remote sends.
        wake: wakes the progress thread (it may sleep without looking at the rings).
    """

    def __init__(self, rank: int, inbox: Inbox, timeout: float, wake: Callable[[], None]
                 ) -> None:
        self._rank = rank
        self._inbox = inbox
        self._timeout = timeout
        self._wake = wake
        #: The host peers' group ranks (empty until :meth:`use`).
        self.ranks: frozenset[int] = frozenset()
        self._channels: dict[int, Channel] = {}  # the channels made so far, by group rank
        self._channel_list: list[Channel] = []  # the same; replaced, never changed in place
        self._silent: list[tuple[int, Callable[[], bool]]] = []  # host peers with no channel
        self._maker: Channels | None = None
        self._channel_lock = threading.Lock()  # guards making channels (no other lock inside)
        self.group: Any = None  #: the host's ShmGroup once use() ran
        self._inline_max = 0  # the largest message a ring entry holds, once use() ran
        #: What a send written into a ring returns: it is complete and can never fail, so one
        #: finished Work serves them all (a new one costs a future and a lock per send).
        self.delivered = Work.completed(description="tcp send (written into shared memory)")
        self._long_sleep = False  # the progress thread sleeps without looking at the rings
        self._ring_post_at = 0.0  # when a receive a ring may complete was last posted
        #: Receives whose waiter polls the rings now.
        self.drivers: set[PollingFuture] = set()
        # Channels with sends their peer is still to read from this rank's memory (shm_remote);
        # changed under the channel's send_lock.
        self._remote_channels: set[Channel] = set()

    def use(self, channels: Channels) -> None:
        """Send to and receive from the host peers in ``channels`` through shared memory.

        Called once, right after the backend mapped the host's memory and before any
        point-to-point call.
        """
        with self._inbox.lock:
            self._maker = channels
            self.ranks = frozenset(channels.ranks)
            self._silent = [(rank, channels.announced(rank)) for rank in channels.ranks]
            self.group = channels.group
            self._inline_max = channels.group.segments[channels.group.rank].ring_bytes // 2
        self._long_sleep = True  # the thread went to sleep before it had rings to look at
        # Only now may peers write into our rings: a socket message read before this point was
        # matched without looking at them (shm_p2p, "Order").
        channels.group.p2p_open()

    # -- channels -------------------------------------------------------------------------------
    def serves(self, src: int | None, nbytes: int) -> bool:
        """Whether a user message of ``nbytes`` from ``src`` comes through a host peer's ring."""
        return src is not None and nbytes <= self._inline_max and src in self.ranks

    def may_serve(self, src: int | None) -> bool:
        """Whether a receive from ``src`` (None: any rank) may take its message from a ring."""
        return bool(self.ranks) if src is None else src in self.ranks

    def rings_for(self, src: int | None) -> list[Channel]:
        """Return the rings whose entries a receive from ``src`` (None: any rank) may take now:
        ``src``'s, or every channel whose peer has written to this rank."""
        if src is not None:
            channel = self.channel_for(src)
            return [channel] if channel is not None else []
        if self._silent:
            self._open_announced()
        return self._channel_list

    def channel_for(self, rank: int) -> Channel | None:
        """Return the channel to ``rank``, made now if it is a host peer without one yet; None
        for a rank reached only over its socket, and for a new one once the engine is closed
        (the host's memory may be unmapped: the socket path reports the closed engine)."""
        channel = self._channels.get(rank)
        if channel is None and rank in self.ranks and not self._inbox.closed:
            channel = self._open_channel(rank)
        return channel

    def _open_channel(self, rank: int) -> Channel:
        """Make the channel to host peer ``rank`` (once, whichever thread asks first)."""
        with self._channel_lock:
            channel = self._channels.get(rank)
            if channel is None:
                assert self._maker is not None  # rank is a host peer: use() ran
                channel = self._maker.make(rank)
                self._channels[rank] = channel
                self._channel_list = [*self._channel_list, channel]
                self._silent = [entry for entry in self._silent if entry[0] != rank]
            return channel

    def _open_announced(self) -> None:
        """Make the channels of the host peers that have announced they write to this rank."""
        for rank, announced in self._silent:
            if announced():
                self._open_channel(rank)

    # -- sends read from this rank's memory (shm_remote) ----------------------------------------
    def send_remote(self, channel: Channel, view: memoryview, tag: int, array: Any
                    ) -> Work | None:
        """Offer ``channel``'s peer a send to read from this rank's memory (its ``send_lock``
        held): a large message, or one the ring has no room for. None: not this one, or not now
        (the send goes over the socket)."""
        if view.nbytes <= SMALL_BYTES or not channel.remote_ready():
            return None
        future = PollingFuture(self._poll_sends, self.group, self.drivers)
        work = Work(future, description=f"tcp send to rank {channel.rank} tag {tag}",
                    default_timeout=self._timeout)
        if not channel.try_send_remote(view, tag, array, work):
            return None
        self._remote_channels.add(channel)
        if self._long_sleep:  # it ticks while remote sends are pending
            self._wake()
        return work

    def spin_for_remote(self, work: Work) -> None:
        """Before a blocking send waits for ``work``: when it is one the peer reads from this
        memory and every rank has a core, look for the peer's acknowledgement (and its own
        messages) for a moment without yielding, as a blocking receive spins on the ring."""
        if not self._remote_channels or not self.group.spin_iterations:
            return
        until = time.perf_counter() + REMOTE_SPIN_SECONDS
        while not work.is_completed() and time.perf_counter() < until:
            self._poll_sends()

    def _poll_sends(self) -> None:
        """Poll the rings and complete the remote sends their receivers have read."""
        self.poll()
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

    # -- receives -------------------------------------------------------------------------------
    def future(self) -> PollingFuture:
        """The future of a receive a ring may complete: its waiter polls the rings."""
        return PollingFuture(self.poll, self.group, self.drivers)

    def posted(self) -> None:
        """A receive a ring may complete was posted: have the progress thread tick."""
        self._ring_post_at = time.monotonic()
        if self._long_sleep:  # read after posting: see timeout()
            self._wake()

    def drain(self, channel: Channel, done: Completions, *, force: bool) -> None:
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
        inbox = self._inbox
        table = inbox.table
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
            if before > inbox.arrivals.get(src, 0):
                return
            op = table.match_arrival(src, tag)
            if op is None and not force and not inbox.awaits(src):
                buffered = table.unexpected_bytes + nbytes + MESSAGE_OVERHEAD_BYTES
                if buffered > MAX_UNEXPECTED_BYTES:
                    return
            self._stale(src, tag, op, done)
            if op is not None and op.view.nbytes == nbytes and channel.take(op.view, tag, before):
                done.append((op, src))  # copied in place and consumed
                continue
            payload = channel.payload(nbytes)
            if op is None:
                message = table.add_unexpected(src, tag, nbytes)
                copy_bytes(message.buffer, payload)
                message.done = True
            elif op.view.nbytes != nbytes:
                done.append((op, wrong_size(op, src, nbytes)))
            else:  # an entry take() would not copy (its header is out of bounds): as before
                copy_bytes(op.view, payload)
                done.append((op, src))
            payload.release()
            channel.pop(nbytes)

    def _drain_remote(self, channel: Channel, done: Completions, force: bool,
                      tag: int, entry_nbytes: int, before: int) -> bool:
        """Move the remote entry next in ``channel`` into the match table, reading its message
        from the sender's memory (shm_remote; lock held). False: it waits, as :meth:`drain`
        lets an entry wait."""
        src = channel.rank
        inbox = self._inbox
        table = inbox.table
        if before > inbox.arrivals.get(src, 0):
            return False
        address, nbytes, ticket = channel.remote_entry(entry_nbytes)
        op = table.match_arrival(src, tag)
        if op is None and not force and not inbox.awaits(src):
            buffered = table.unexpected_bytes + nbytes + MESSAGE_OVERHEAD_BYTES
            if buffered > MAX_UNEXPECTED_BYTES:
                return False
        self._stale(src, tag, op, done)
        if op is None:
            message = table.add_unexpected(src, tag, nbytes)
            failure = channel.read_remote(address, message.buffer)
            if failure is None:
                message.done = True
            else:
                table.discard(message)
                logger.warning("tcp: rank %d dropped a message of %d bytes from rank %d: %s",
                               self._rank, nbytes, src, failure)
        elif op.view.nbytes != nbytes:
            done.append((op, wrong_size(op, src, nbytes)))
        else:
            failure = channel.read_remote(address, op.view)
            done.append((op, src if failure is None else NetworkError(
                f"{op.work.description}: rank {src}: {failure}")))
        channel.pop(entry_nbytes)
        channel.acknowledge(ticket)
        return True

    def _stale(self, src: int, tag: int, op: RecvOp | None, done: Completions) -> None:
        """Fail the receives an arrival of ``tag`` from ``src`` proves can never match."""
        inbox = self._inbox
        stale, conflict = inbox.tracker.on_arrival(src, tag, op is not None, inbox.table)
        for stale_op in stale:
            done.append((stale_op, BackendError(f"{stale_op.work.description}: {conflict}")))

    def poll(self) -> bool:
        """Move what the host peers' rings hold into the match table (any thread).

        Returns whether some receive completed.
        """
        inbox = self._inbox
        if inbox.closed:
            return False
        if self._silent:
            self._open_announced()
        news = [channel for channel in self._channel_list if channel.has_news()]
        if not news:
            return False
        done: Completions = []
        with inbox.lock:
            if inbox.refusal() is not None:
                return False
            for channel in news:
                self.drain(channel, done, force=False)
        finish(done)
        return bool(done)

    # -- blocking receives of ring-sized messages, without a Work -------------------------------
    def await_ring(self, channel: Channel, array: np.ndarray, tag: int) -> bool:
        """Take message ``tag`` for ``array`` from ``channel``'s peer once it comes (within a
        waiter's polls); False: leave it to irecv."""
        group = self.group
        if group.spin_iterations:
            # Spin on the ring alone: a message that comes over the socket meanwhile (a rare
            # path for a ring-sized one) is found by the polls below.
            if channel.spin_for_news(group.spin_iterations * SPIN_ITERATION_SECONDS):
                outcome = self.take_next(channel, array, tag)
                if outcome is not None:
                    return outcome
        taken = False

        def settled() -> bool:
            nonlocal taken
            outcome = self.try_take(channel, array, tag)
            if outcome is None:
                return False
            taken = outcome
            return True

        poll_briefly(settled, 0, YIELD_SECONDS)
        return taken

    def try_take(self, channel: Channel, array: np.ndarray | memoryview, tag: int
                 ) -> bool | None:
        """:meth:`take_next` if the ring or the unexpected queue holds something from the peer.

        A poll looks only there. What else makes a blocking receive give way (a receive posted
        by another thread, a broken group) is found by :meth:`take_next` when something comes,
        or by irecv once the polls are over.
        """
        if self.may_take(channel, tag):
            return self.take_next(channel, array, tag)
        return None

    def may_take(self, channel: Channel, tag: int) -> bool:
        """Whether the ring or the unexpected queue holds something from ``channel``'s peer
        that a receive of ``tag`` may take (a look without the lock)."""
        return channel.has_news() or self._inbox.table.queued(channel.rank, tag)

    def take_next(self, channel: Channel, array: np.ndarray | memoryview, tag: int
                  ) -> bool | None:
        """Copy the message a receive ``tag`` from ``channel``'s peer takes next into ``array``.

        Returns False when that is not for this call to do (irecv decides: a receive posted or
        left to its waiter comes first, the message is still arriving or has another size, the
        group is broken) and None when there is no message yet.
        """
        inbox = self._inbox
        with inbox.lock:
            if inbox.deferred and (channel.rank, tag) in inbox.deferred:
                return False  # receives made before this one come first (tcp._deferred)
            return self.take_locked(channel, array, tag)

    def take_locked(self, channel: Channel, array: np.ndarray | memoryview, tag: int
                    ) -> bool | None:
        """:meth:`take_next` for a receive whose turn it is (inbox lock held)."""
        src = channel.rank
        inbox = self._inbox
        table = inbox.table
        # Inbox.refusal()'s test, without building its error; a held socket message may
        # be the one
        if inbox.closed or inbox.broken is not None or inbox.held:
            return False
        if table.empty():  # the common case: nothing posted, nothing queued
            return channel.take(array, tag, inbox.arrivals.get(src, 0))
        if table.expects(src, tag):
            return False
        message = table.first_unexpected(src, tag)
        if message is None:
            return channel.take(array, tag, inbox.arrivals.get(src, 0))
        if not message.done or len(message.buffer) != array.nbytes:
            return False
        table.take_unexpected(src, tag)
        copy_bytes(byte_view(array, name="array", writable=True), message.buffer)
        table.recycle(message.buffer)
        return True

    # -- the progress thread, failure and close -------------------------------------------------
    def timeout(self, timeout: float) -> float:
        """Return how long the progress thread may sleep, ``timeout`` at most (progress thread).

        While receives a ring may complete are posted, or remote sends wait, it ticks: a ring
        entry wakes no one, so the thread looks (rarely while a waiter polls the rings itself).
        Ticking lingers after the last receive so that a stream of receives does not wake the
        thread once each.
        """
        if not self.ranks:
            return timeout
        # Set before looking at the table: a receive posted after the look sees the flag and
        # wakes the thread.
        self._long_sleep = True
        now = time.monotonic()
        with self._inbox.lock:  # caller threads post and take receives meanwhile
            posted = self._inbox.table.posted_count()
        if posted or self._remote_channels or now - self._ring_post_at < TICK_LINGER_SECONDS:
            self._long_sleep = False
            tick = DRIVEN_TICK_SECONDS if self.drivers else TICK_SECONDS
            timeout = min(timeout, tick)
        return timeout

    def progress(self) -> None:
        """Match what the rings hold and complete acknowledged remote sends (progress thread)."""
        if self.ranks:
            self.poll()
            if self._remote_channels:
                self._reap_remote()

    def peer_lost(self, rank: int) -> list[Any]:
        """Deliver what host peer ``rank`` wrote into its ring before it left; return its
        unread remote sends (their Works are to fail)."""
        channel = self.channel_for(rank)
        if channel is None:
            return []
        delivered: Completions = []
        inbox = self._inbox
        with inbox.lock:
            if inbox.refusal() is None:
                self.drain(channel, delivered, force=True)
        finish(delivered)
        return self._unread_remote(channel, withdraw=False)

    def close(self) -> list[Any]:
        """Withdraw every remote send not read yet and return them, before their arrays may be
        freed (their Works are to fail)."""
        pending: list[Any] = []
        for channel in list(self._channel_list):
            pending.extend(self._unread_remote(channel, withdraw=True))
        return pending
