"""Point-to-point between the ranks of one host through their shared memory.

Every ordered pair of host ranks (p, q) has a ring in p's segment (pair area q, see
:mod:`colls_plugins.tcp.shm.segment`): p alone writes it and advances its ``head`` word; q reads
it and advances the ``consumed`` word of its own pair area p. One writer and one reader per word, no
locks: a single-producer single-consumer channel on x86-64's total store order (the sender's
entry is visible before the head that covers it; the reader's loads of an entry happen before its
store of ``consumed``, so the sender never overwrites an entry being read).

**What goes where.** A message of at most :data:`INLINE_MAX_BYTES` goes through the ring when the
ring has room: one entry, a 24-byte header (tag, size, ``sockets_before``) and the payload, so
an 8-byte message and its header share one cache line. A larger one goes as a *remote entry*
where the receiver can read the sender's memory: the entry names the array, and the receiver
copies it from there straight into its receive buffer (:mod:`colls_plugins.tcp.shm.remote`).
Anything else (the ring is full because the receiver is behind, no remote read) goes over the
pair's TCP connection as before. A send through the ring is complete once written, so a sender
never waits for the receiver; a remote one once the receiver has read it.

**Order across the two transports.** MPI's rule is that two messages from one rank to another
that both match a receive are received in send order. Each ring entry carries
``sockets_before``: how many socket messages its sender had sent to this receiver before it (the
sender counts under a per-peer lock, so the count and the stream order agree). The receiver
counts the socket messages from that rank that reached its match table. An entry enters the
match table only once that count reaches its ``sockets_before`` (the socket messages before it
are in); and before the engine matches a socket message from a host peer, it moves every ring
entry that may enter into the table first (those were written before the socket message was
sent, so they are visible by the time its header is read). A socket message the engine holds
unread (:mod:`colls_plugins.tcp.engine`) is counted only when it is released, so no later ring
entry can overtake it. It follows that every unexpected message queued from a rank was sent
before every entry still in that rank's ring: a receive looks at the queue first, is posted,
and then takes ring entries (the one it matches is copied straight into its buffer).

A rank writes into a peer's ring only once that peer's engine has attached its rings (a word
in the peer's control page): before, the peer's engine matched socket messages without looking
at the rings. Socket messages are counted on both sides from the start, so the messages a rank
sent over the socket while its peer was still attaching count too.

**Buffering.** The ring itself is bounded. Entries leave it for the unexpected queue only when
they must (a receive for that rank is posted, or a socket message behind them arrives) or while
the unexpected bytes stay under the engine's :data:`~colls_plugins.tcp.engine.MAX_UNEXPECTED_BYTES`.

**Progress.** Whoever looks first moves entries: a thread posting a receive, a thread waiting for
one (:class:`PollingFuture`: as the collectives' waits of :mod:`~colls_plugins.tcp.shm.group`, it
spins on the rings briefly when every rank has a core, then polls them with ``sched_yield``,
then blocks until a writer wakes it), the backend's ``poll`` hook, and the progress thread,
which looks every :data:`TICK_SECONDS` while a receive is posted (and a little longer:
:data:`TICK_LINGER_SECONDS`; a receive posted after that wakes it), so a receive completes
without anyone waiting for it.
"""

from __future__ import annotations

import os
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from colls.completion import Completion
from colls_plugins.tcp.shm import remote as shm_remote
from colls_plugins.tcp.shm.group import ShmGroup
from colls_plugins.tcp.shm.segment import P2P_RING_BYTES, SEGMENT_MAGIC

#: Largest message that goes through the ring (half of it: one such message and small ones), on
#: a host of at most LARGE_RINGS_MAX_RANKS ranks (:func:`~.segment.p2p_ring_bytes`;
#: a channel's own limit is :attr:`Channel.inline_max`).
INLINE_MAX_BYTES = P2P_RING_BYTES // 2
#: Placement: an entry of at most SMALL_BYTES of payload stays within the first SMALL_SPAN bytes
#: of the ring, and a writer past them that finds the ring empty starts again at its beginning
#: (the compiled ``ring_put`` has the same rule). Pages are backed once written, so a pair that
#: only exchanges small messages keeps using the same few pages, as with the 64 KiB rings of
#: before; the rest of the ring is touched only by pairs that send large messages.
SMALL_BYTES = 16 << 10
SMALL_SPAN = 64 << 10

#: Header of a ring entry: tag, payload bytes (SKIP: the rest of the ring is unused, start
#: again at 0), socket messages the sender had sent to the receiver before this one.
ENTRY = struct.Struct("<qqq")
SKIP = -1
_ALIGN = 8  # entries start on 8-byte boundaries: the header words are whole loads

#: How long a waiting thread polls the rings with ``sched_yield`` between polls, after its spin
#: and before it blocks (seconds). Measured under load on 2 cores (8-byte ping-pong): blocking
#: at once cost 300 us per message, polling with yields for 2 ms 60-240 us; the peer answers
#: within this budget whenever it is running.
YIELD_SECONDS = 0.002
#: Ring polls between two ``sched_yield`` calls. With more ranks than cores a poll that finds
#: nothing is better followed by a yield at once: 8-byte ping-pong at N=4 on 2 cores took
#: 24-28 us with 1 and 28-34 us with 4 (pp4, alternating runs).
POLLS_PER_YIELD = 1
#: Longest single block of a waiting thread before it looks at the rings again (seconds).
BLOCK_SLICE_SECONDS = 0.01

#: How often the progress thread looks at the rings while a receive is posted (seconds).
TICK_SECONDS = 0.001
#: How often it looks while a caller's thread polls the rings itself (:class:`PollingFuture`):
#: then its look is redundant, and each one takes the GIL from the spinning caller (about 10 us
#: of an 8-byte round trip at 1 ms). It still looks, for receives nobody is waiting on.
DRIVEN_TICK_SECONDS = 0.02
#: How long it goes on looking after the last receive was posted (seconds): posting a receive
#: wakes a thread that has stopped looking, which costs a system call and a thread hand-off.
TICK_LINGER_SECONDS = 0.2


def poll_briefly(settled: Callable[[], bool], spins: int, seconds: float) -> bool:
    """Call ``settled()`` until it returns True; return False if it never did.

    It is called ``spins`` times back to back (a waiter's spin, while every rank has a core),
    then for ``seconds`` with a ``sched_yield`` after every :data:`POLLS_PER_YIELD` calls, so
    that a peer sharing this core can run and write. After that the caller blocks or takes a
    slower path.
    """
    for _ in range(spins):
        if settled():
            return True
    until = time.perf_counter() + seconds
    polls = 0
    while time.perf_counter() < until:
        if settled():
            return True
        polls += 1
        if polls % POLLS_PER_YIELD == 0:
            os.sched_yield()
    return False


def _bytes_of(data: memoryview | np.ndarray) -> memoryview:
    """Return ``data``'s memory as a flat byte view (it is C-contiguous)."""
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def entry_bytes(nbytes: int) -> int:
    """Return the ring bytes an entry with ``nbytes`` of payload takes."""
    return ENTRY.size + -(-nbytes // _ALIGN) * _ALIGN


#: Whether the compiled ``ring_put`` writes an entry whole with respect to other threads: it
#: is one C call that never releases the GIL. Not so on a build of Python without one.
ATOMIC_RING_PUT = getattr(sys, "_is_gil_enabled", lambda: True)()


class RemoteSend:
    """A send the peer reads from this rank's memory: its Work, and the array kept alive."""

    __slots__ = ("array", "nbytes", "work")

    def __init__(self, work: Any, array: Any, nbytes: int) -> None:
        self.work = work
        self.array = array
        self.nbytes = nbytes


class Channel:
    """Both directions between this rank and one host peer: the ring to it and the ring from it.

    The ring positions live only in the shared words: this rank's head to the peer and what it
    consumed of the peer's ring. Sending (and ``sockets_sent``) is guarded by ``send_lock``;
    receiving by the engine's lock, which also counts the socket messages that arrived. Where
    the compiled piece is built (:attr:`ShmGroup.native_rings`), it does
    :meth:`try_send`'s and :meth:`take`'s steps; the Python ones here are the fallback.

    A blocking send through the compiled piece skips ``send_lock`` (:attr:`lock_free`): its
    write is one call the GIL keeps whole, and the count of socket messages it carries is
    read before it. Another thread's socket send may count itself before or after that read;
    either order is a valid order for two threads' sends, and a thread's own sends keep theirs.
    The lock costs a quarter of a microsecond, a sixth of an 8-byte ping-pong's half round trip.
    """

    def __init__(self, rank: int, group: ShmGroup, me: int, peer: int) -> None:
        self.rank = rank  # the peer's group rank
        self._group = group
        self._index = peer  # its host rank
        self._native = group.native_rings
        # [0] my head to it, [1] what I consumed of its ring; and the ring I write
        self._out_ctrl, self._out = group.segments[me].pair(peer)
        # [0] its head to me, [1] what it consumed of mine; and the ring it writes
        self._in_ctrl, self._in = group.segments[peer].pair(me)
        self._ring_bytes = group.segments[me].ring_bytes
        #: Bytes of the ring to this peer: the most its entries can hold.
        self.ring_bytes = self._ring_bytes
        #: Largest message that goes through the ring: half of it.
        self.inline_max = self._ring_bytes // 2
        self._announced = group.announced_by(peer)  # whether to look at _in_ctrl at all
        self._heard = False  # it announced itself (seen once, then remembered)
        self.send_lock = threading.Lock()
        #: Whether a send may write the ring without ``send_lock`` (:attr:`ATOMIC_RING_PUT`).
        self.lock_free = self._native is not None and ATOMIC_RING_PUT
        self.sockets_sent = 0
        self._open = False  # the peer has attached its rings (seen once, then remembered)
        # Messages read from this rank's memory by the peer (shm_remote), by ticket.
        self.remote_sends: dict[int, RemoteSend] = {}
        self._next_ticket = 0
        self.remote_sent = 0  # how many went that way (the tests look)
        peer_ctrl = group.segments[peer].ctrl
        self._pid = int(peer_ctrl[shm_remote.W_PID])
        if shm_remote.can_read(peer_ctrl, SEGMENT_MAGIC):  # the peer may then send that way
            self._out_ctrl[shm_remote.W_CAN_READ] = 1

    @property
    def head(self) -> int:
        """Ring bytes this rank has written to the peer, in all (its shared head word)."""
        return self._out_ctrl[0]

    @property
    def consumed(self) -> int:
        """Ring bytes this rank has consumed of the peer's ring, in all (its shared word)."""
        return self._out_ctrl[1]

    # -- sending -------------------------------------------------------------------------------
    def try_send(self, data: memoryview | np.ndarray, tag: int) -> bool:
        """Write one message into the ring if it fits and there is room (``send_lock`` held).

        ``data``: a byte view, or a C-contiguous NumPy array (the blocking send's).
        """
        nbytes = data.nbytes
        if nbytes > self.inline_max:
            return False
        if not self._open:
            if not self._group.p2p_is_open(self._index):
                return False  # its engine would match our later socket messages first
            self._group.announce_sender(self._index)  # before the first entry is published
            self._open = True
        if self._native is not None:
            written = self._native.ring_put(self._index, data, tag, self.sockets_sent)
            if written == 2:  # a thread of the peer sleeps
                self._group.wake_peer(self._index)
            return written != 0
        return self._put(data, nbytes, tag, self.sockets_sent)

    def _put(self, data: memoryview | np.ndarray | bytes, nbytes: int, tag: int, before: int
             ) -> bool:
        """Write one entry in Python: :meth:`try_send`'s fallback (``send_lock`` held)."""
        size = entry_bytes(nbytes)
        head = self._out_ctrl[0]
        ring_bytes = self._ring_bytes
        pos = head % ring_bytes
        left = ring_bytes - pos
        consumed = self._in_ctrl[1]
        waste = 0
        if left < size or (pos and nbytes <= SMALL_BYTES and pos + size > SMALL_SPAN):
            waste = left
        elif pos >= SMALL_SPAN and head == consumed and size <= pos:
            # empty, and a large message took the writer past the span: start again at the
            # beginning (the wrap marker stays intact). Not from within the span: until the
            # reader passes the marker, the rest of the ring counts as used.
            waste = left
        if head + waste + size - consumed > ring_bytes:
            return False  # the receiver is behind: the socket takes it (order kept by count)
        ring = self._out
        if waste:
            if left >= ENTRY.size:
                ENTRY.pack_into(ring, pos, 0, SKIP, 0)
            head += waste
            pos = 0
        ENTRY.pack_into(ring, pos, tag, nbytes, before)
        if nbytes:
            ring[pos + ENTRY.size : pos + ENTRY.size + nbytes] = (
                data if isinstance(data, bytes) else _bytes_of(data))
        self._out_ctrl[0] = head + size  # last: publishes the entry (TSO)
        self._group.p2p_wake(self._index)  # a system call only when a thread of it sleeps
        return True

    # -- messages read from the sender's memory (shm_remote) ---------------------------------
    def remote_ready(self) -> bool:
        """Whether the peer has shown it can read this rank's memory (no lock needed)."""
        return self._in_ctrl[shm_remote.W_CAN_READ] == 1

    def try_send_remote(self, view: memoryview, tag: int, array: Any, work: Any) -> bool:
        """Write a remote entry for ``view`` (more than a ring entry holds) if a ticket and the
        ring have room; ``array`` stays referenced and ``work`` pending until the peer read it
        (``send_lock`` held)."""
        ticket = self._next_ticket
        if ticket - shm_remote.ACK_SLOTS in self.remote_sends:
            return False  # every acknowledgement word is in use: the socket takes it
        if not self._open:
            if not self._group.p2p_is_open(self._index):
                return False
            self._group.announce_sender(self._index)
            self._open = True
        payload = shm_remote.REMOTE.pack(shm_remote.address_of(view), view.nbytes, ticket)
        self.remote_sends[ticket] = RemoteSend(work, array, view.nbytes)  # before it is visible
        before = self.sockets_sent | shm_remote.REMOTE_FLAG
        if self._native is not None:
            written = self._native.ring_put(self._index, payload, tag, before)
            if written == 2:
                self._group.wake_peer(self._index)
        else:
            written = self._put(payload, len(payload), tag, before)
        if not written:
            del self.remote_sends[ticket]
            return False
        self._next_ticket = ticket + 1
        self.remote_sent += 1
        return True

    def acknowledged(self) -> list[RemoteSend]:
        """Remove and return the remote sends the peer has read (``send_lock`` held)."""
        ctrl = self._in_ctrl
        done = [t for t in self.remote_sends
                if ctrl[shm_remote.W_ACK + t % shm_remote.ACK_SLOTS] == t + 1]
        return [self.remote_sends.pop(t) for t in done]

    def withdraw(self) -> None:
        """Tell the peer that this rank's unread remote messages may no longer be read."""
        self._out_ctrl[shm_remote.W_WITHDRAWN] = 1

    def remote_entry(self, nbytes: int) -> tuple[int, int, int]:
        """Return (address, bytes, ticket) of the remote entry :meth:`peek` returned."""
        payload = self.payload(nbytes)
        try:
            return shm_remote.REMOTE.unpack_from(payload)
        finally:
            payload.release()

    def read_remote(self, address: int, into: memoryview) -> str | None:
        """Copy the peer's message at ``address`` into ``into``; return why not, or None.

        Checked after the read: a peer that withdrew its messages (it closed) may have freed
        the memory before or during the read.
        """
        try:
            shm_remote.read(self._pid, address, into)
        except OSError as exc:
            return f"reading its message failed: {exc}"
        if self._in_ctrl[shm_remote.W_WITHDRAWN]:
            return "it closed its backend before its message was read"
        return None

    def acknowledge(self, ticket: int) -> None:
        """Tell the peer that its remote message ``ticket`` was read (wakes it if it sleeps)."""
        self._out_ctrl[shm_remote.W_ACK + ticket % shm_remote.ACK_SLOTS] = ticket + 1
        self._group.p2p_wake(self._index)

    # -- receiving (engine lock held) ----------------------------------------------------------
    def has_news(self) -> bool:
        """Whether the peer wrote something not consumed yet (no lock needed).

        A peer that never announced itself as a sender (:meth:`ShmGroup.announce_sender`) has
        written nothing: its control line is not read, so its page is never mapped in here.
        """
        if not self._heard:
            if not self._announced():
                return False
            self._heard = True
        return self._in_ctrl[0] != self._out_ctrl[1]

    def spin_for_news(self, seconds: float) -> bool:
        """Busy-poll :meth:`has_news` for at most ``seconds``; return it (no lock needed).

        Compiled, the loop reads the peer's word between pauses with the GIL held, and sees a
        message within tens of nanoseconds: a Python loop around :meth:`has_news` takes a few
        hundred per look.
        """
        if self._native is not None:
            return self._native.ring_wait(self._index, seconds)
        until = time.perf_counter() + seconds
        while not self.has_news():
            if time.perf_counter() >= until:
                return False
        return True

    def take(self, data: memoryview | np.ndarray, tag: int, max_before: int) -> bool | None:
        """Copy the next entry into ``data`` and consume it if it is the one a receive takes.

        That is: it carries ``tag``, fills ``data`` (a writable byte view or C-contiguous NumPy
        array) exactly and counts at most ``max_before`` socket messages before it. Returns None
        when the ring is empty and False when the next entry is another (it stays for
        :meth:`peek`).
        """
        if self._native is not None:
            taken = self._native.ring_take(self._index, data, tag, max_before)
            return None if taken == 0 else taken > 0
        entry = self.peek()
        if entry is None:
            return None
        found, nbytes, before = entry
        if found != tag or nbytes != data.nbytes or before > max_before:
            return False
        payload = self.payload(nbytes)
        _bytes_of(data)[:] = payload
        payload.release()
        self.pop(nbytes)
        return True

    def peek(self) -> tuple[int, int, int] | None:
        """Return the next entry (tag, nbytes, sockets_before) or None; skips wrap markers."""
        if self._native is not None:
            return self._native.ring_peek(self._index)
        while True:
            consumed = self._out_ctrl[1]
            if self._in_ctrl[0] == consumed:
                return None
            pos = consumed % self._ring_bytes
            left = self._ring_bytes - pos
            if left >= ENTRY.size:
                tag, nbytes, before = ENTRY.unpack_from(self._in, pos)
                if nbytes != SKIP:
                    return tag, nbytes, before
            self._out_ctrl[1] = consumed + left

    def payload(self, nbytes: int) -> memoryview:
        """Return the payload of the entry :meth:`peek` returned (valid until :meth:`pop`)."""
        start = self._out_ctrl[1] % self._ring_bytes + ENTRY.size
        return self._in[start : start + nbytes]

    def pop(self, nbytes: int) -> None:
        """Consume the entry :meth:`peek` returned; the sender may reuse its bytes."""
        self._out_ctrl[1] += entry_bytes(nbytes)


class Channels:
    """Makes this rank's channels to its host peers, by group rank, when the engine needs them.

    A rank of a 256-rank host would make 255 channels at startup and talk to few of them; made
    on demand, they cost nothing until used (making them all was an eighth of a rank's CPU time
    to the first barrier).

    Args:
        group: the host's shared memory (its segments carry pair areas).
        ranks: the group rank of each host rank, by local index (``ranks[group.rank]`` is this
            rank).
    """

    def __init__(self, group: ShmGroup, ranks: Sequence[int]) -> None:
        self.group = group
        self._index = {ranks[q]: q for q in range(group.size) if q != group.rank}

    @property
    def ranks(self) -> list[int]:
        """The group ranks of the host peers, in host order."""
        return list(self._index)

    def make(self, rank: int) -> Channel:
        """Return a new channel to host peer ``rank`` (its group rank)."""
        return Channel(rank, self.group, self.group.rank, self._index[rank])

    def announced(self, rank: int) -> Callable[[], bool]:
        """Return a test of whether host peer ``rank`` has said it writes to this rank."""
        return self.group.announced_by(self._index[rank])

    @staticmethod
    def available(group: ShmGroup | None) -> bool:
        """Whether ``group``'s segments carry pair areas (they do when shm_setup made them)."""
        return group is not None and all(seg.ranks == group.size for seg in group.segments)


class PollingFuture(Completion):
    """The future of a receive a host peer may complete: waiting for it polls the rings first.

    ``poll()`` moves whatever the rings hold into the engine (and completes receives). A waiter
    spins on it briefly while every rank has a core, polls it with ``sched_yield`` for
    :data:`YIELD_SECONDS`, then blocks on the host memory's wake-up
    socket, having counted itself as a sleeper: a peer that writes into a ring after that
    sends one datagram, and whoever completes this future while the waiter sleeps (the
    progress thread, for a socket message) wakes it the same way. Each block is bounded by
    :data:`BLOCK_SLICE_SECONDS`, so a lost datagram costs at most a slice.

    Args:
        poll: moves the rings' entries into the match table
            (:meth:`~colls_plugins.tcp.host_peers.HostPeers.poll`, or a send's poll that also
            reaps acknowledged remote sends).
        group: the host's memory.
        drivers: the host peers' set of futures whose waiter is polling now (the progress
            thread then looks every :data:`DRIVEN_TICK_SECONDS` only).
    """

    def __init__(self, poll: Callable[[], None], group: ShmGroup, drivers: set[Any]) -> None:
        super().__init__()
        self._poll = poll
        self._group = group
        self._drivers = drivers
        self._sleeping = False

    def _drive(self, timeout: float | None) -> None:
        self._drivers.add(self)  # set.add and discard are atomic: no lock for a hint
        try:
            self._poll_then_sleep(timeout)
        finally:
            self._drivers.discard(self)

    def _poll_then_sleep(self, timeout: float | None) -> None:
        poll, done = self._poll, self.done

        def settled() -> bool:
            poll()
            return done()  # the progress thread may have completed it (a socket message)

        budget = YIELD_SECONDS if timeout is None else min(timeout, YIELD_SECONDS)
        if poll_briefly(settled, self._group.spin_iterations, budget):
            return
        poll = self._poll
        deadline = None if timeout is None else time.monotonic() + timeout
        group = self._group
        self._sleeping = True
        group.p2p_sleepers(+1)
        try:
            while True:
                poll()
                if self.done():
                    return
                left = BLOCK_SLICE_SECONDS if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    return  # the plain wait below reports the timeout
                group.p2p_sleep(min(left, BLOCK_SLICE_SECONDS))
        finally:
            group.p2p_sleepers(-1)
            self._sleeping = False

    def set_result(self, result: Any) -> None:
        """Complete the receive and wake its waiter if it sleeps."""
        super().set_result(result)
        if self._sleeping:
            self._group.wake_self()

    def set_exception(self, exception: BaseException | None) -> None:
        """Fail the receive and wake its waiter if it sleeps."""
        super().set_exception(exception)
        if self._sleeping:
            self._group.wake_self()

    def result(self, timeout: float | None = None) -> Any:
        """Poll the rings for a moment, then wait as a plain future does, within ``timeout``."""
        return super().result(self._driven(timeout))

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Poll the rings for a moment, then wait as a plain future does, within ``timeout``."""
        return super().exception(self._driven(timeout))

    def _driven(self, timeout: float | None) -> float | None:
        """Drive the receive unless it is over; return what is left of ``timeout`` for the wait.

        The drive may use the whole timeout; the plain wait after it then only reports it.
        """
        if self.done():
            return timeout
        start = time.monotonic()
        self._drive(timeout)
        return None if timeout is None else max(0.0, timeout - (time.monotonic() - start))


__all__ = [
    "DRIVEN_TICK_SECONDS", "INLINE_MAX_BYTES", "TICK_LINGER_SECONDS", "TICK_SECONDS",
    "YIELD_SECONDS", "Channel", "Channels", "PollingFuture", "RemoteSend", "poll_briefly",
]
