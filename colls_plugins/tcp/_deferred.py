"""Receives left to their waiters: a host peer's message taken from its ring by its waiter.

Posting a receive costs its caller a table entry and a drain of the peer's ring, and its
completion a match, a hand-off through the receive's future and a wake-up of its waiter. Most
receives of a latency-bound program (a halo exchange, a ping-pong written with ``irecv``) are
waited for soon after they are made, by the thread that made them, and their message comes
through the sender's ring in shared memory. Such a receive is not posted: it is queued here
("deferred"), and its waiter takes the message straight into its array when it is next, as a
blocking ``recv`` does (:meth:`HostPeers.take_locked
<colls_plugins.tcp.host_peers.HostPeers.take_locked>`).

Matching stays what it would have been had the receive been posted when it was made:

* Only a receive into a NumPy array from one host peer, with a user tag, whose message may come
  through the ring (at most :attr:`~colls_plugins.tcp.shm.p2p.Channel.inline_max` bytes), is
  deferred.
* Receives of one source and tag wait in one queue, in the order they were made. Only the first
  may take a message; waiting on a later one posts those before it, then it.
* A receive made while the queue of its source and tag is not empty joins the queue, or, when
  it may not be deferred, is posted after the queue is (``engine._post_locked``). An any-source
  receive posts every queue of its tag first. :meth:`HostPeers.take_next
  <colls_plugins.tcp.host_peers.HostPeers.take_next>` (a blocking ``recv``) leaves a message
  alone while a queue of its source and tag waits.
* A message that arrives meanwhile stays in the ring, or waits in the unexpected queue (a socket
  message, or a ring entry that another receive's drain moved), where the take looks as well.
* Whatever learns of completion without waiting posts the receive first (a done-callback,
  :func:`concurrent.futures.wait`); ``is_completed()`` makes one attempt to take the message.
* A waiter that does not find its message within a waiter's polls
  (:data:`~colls_plugins.tcp.shm.p2p.YIELD_SECONDS`) posts it and waits as for any receive:
  it sleeps, and whoever matches the message completes it. So does one whose take is not its
  own to make (a held socket message may be the one) or is refused (the engine is closed or
  broken, the peer is gone): posting then fails it with the engine's error.

The queues live in the engine's :class:`~colls_plugins.tcp._matching.Inbox` and change under its
lock only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from colls.matching import RecvOp
from colls.work import Work
from colls_plugins.tcp._frames import byte_view
from colls_plugins.tcp._matching import Inbox
from colls_plugins.tcp.host_peers import HostPeers
from colls_plugins.tcp.shm.group import SPIN_ITERATION_SECONDS
from colls_plugins.tcp.shm.p2p import YIELD_SECONDS, Channel, PollingFuture, poll_briefly


class DeferredReceive(PollingFuture):
    """The future of a receive left to its waiter; once posted, a :class:`PollingFuture`."""

    def __init__(self, receives: Deferred, channel: Channel, array: np.ndarray, tag: int
                 ) -> None:
        hosts = receives.hosts
        super().__init__(hosts.poll, hosts.group, hosts.drivers)
        self.receives = receives
        self.channel = channel
        self.array = array
        self.tag = tag
        self.work: Work | None = None  #: the Work that holds this future (set once made)
        #: Whether it waits in its queue, not posted, and whether it is first there (both
        #: changed under the inbox lock; read without it by the waiter's polls).
        self.deferred = True
        self.first = False

    def posted(self) -> RecvOp:
        """Return the receive to post in its place (inbox lock held; out of its queue)."""
        self.deferred = False
        work, self.work = self.work, None  # the Work and its future stop holding each other
        assert work is not None
        view = byte_view(self.array, name="array", writable=True)
        return RecvOp(work, view, self.channel.rank, self.tag)

    def done(self) -> bool:
        """Return whether the receive ended; a deferred one looks for its message once."""
        if self.deferred:
            self.receives.attempt(self)
        return super().done()

    def add_done_callback(self, fn: Callable[[Any], Any]) -> None:
        """Call ``fn`` when the receive ends: it is posted, so that it ends without a waiter."""
        if self.deferred:
            self.receives.post(self)
        super().add_done_callback(fn)

    @property  # type: ignore[override]
    def _condition(self) -> Any:
        # concurrent.futures.wait() and as_completed() block on it: post first (as above).
        if self.deferred:
            self.receives.post(self)
        return PollingFuture._condition.fget(self)  # type: ignore[attr-defined]

    def result(self, timeout: float | None = None) -> Any:
        """Take the message as a waiter (see the module docstring), then wait as a
        :class:`PollingFuture` does for whatever is left of ``timeout``."""
        if self.deferred:
            timeout = self.receives.await_message(self, timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """As :meth:`result`, returning the exception instead."""
        if self.deferred:
            timeout = self.receives.await_message(self, timeout)
        return super().exception(timeout)


class Deferred:
    """The receives left to their waiters, and the moves that take or post them.

    Args:
        inbox: the engine's matching state (its ``deferred`` queues, its lock).
        hosts: the host peers, whose rings and unexpected messages a take reads.
        timeout: the default ``wait()`` timeout of the Works made here.
        post: posts receives taken out of their queue, in order (inbox lock held); returns
            what is left for after the lock.
        after: does that, once the lock is released.
        lost: whether a rank is known gone (a receive from it is then posted, and fails).
    """

    def __init__(self, inbox: Inbox, hosts: HostPeers, timeout: float,
                 post: Callable[[Sequence[DeferredReceive]], Any],
                 after: Callable[[Any], None], lost: Callable[[int], bool]) -> None:
        self._inbox = inbox
        self.hosts = hosts
        self._timeout = timeout
        self._post = post
        self._after = after
        self._lost = lost
        #: The one completed Work of every receive from a rank that took its message at once
        #: (as the engine's one Work of every send written into a ring): nothing about it can
        #: change, and a halo exchange takes one per neighbour and iteration.
        self._taken: dict[int, Work] = {}

    def take_or_defer(self, channel: Channel, array: np.ndarray, tag: int, description: Any
                      ) -> Work | None:
        """Take message ``tag`` from ``channel``'s peer into writable C-contiguous ``array``
        now, or leave the receive to its waiter; return its Work, or None when it is to be
        posted (engine.irecv posts it)."""
        key = (channel.rank, tag)
        hosts = self.hosts
        inbox = self._inbox
        taken = None
        with inbox.lock:
            if inbox.closed or inbox.broken is not None:
                return None  # posting fails it, with the engine's error
            queue = inbox.deferred.get(key)
            if queue is None and hosts.may_take(channel, tag):
                taken = hosts.take_locked(channel, array, tag)
            if taken is None:
                if array.nbytes > channel.inline_max:
                    return None  # posted, after this queue (engine._post_locked)
                receive = DeferredReceive(self, channel, array, tag)
                work = receive.work = Work(receive, description=description,
                                           default_timeout=self._timeout)
                if queue is None:
                    receive.first = True
                    inbox.deferred[key] = deque((receive,))
                else:
                    queue.append(receive)
                return work
        return self._taken_work(channel.rank) if taken else None

    def _taken_work(self, src: int) -> Work:
        """Return the completed Work of a receive from ``src`` that took its message at once."""
        work = self._taken.get(src)
        if work is None:
            work = self._taken[src] = Work.completed(
                src, description=f"tcp recv from rank {src} (taken at once)")
        return work

    def attempt(self, receive: DeferredReceive) -> None:
        """Take ``receive``'s message if it is there and next; post it when the take is not
        its own to make or is refused. Does nothing while the message has not come, nor while
        another thread holds the inbox lock: ``is_completed()`` calls this, also from a flight
        recorder dump in a signal handler, which must not wait for a lock its own thread may
        hold."""
        if not receive.deferred:
            return
        channel, tag = receive.channel, receive.tag
        if receive.first and not self._refused(channel) and not self.hosts.may_take(channel, tag):
            return  # first in its turn and nothing has come: a look without the lock
        lock = self._inbox.lock
        if not lock.acquire(blocking=False):
            return
        try:
            if not receive.deferred:
                return
            key = (channel.rank, tag)
            queue = self._inbox.deferred[key]
            taken = None
            if receive.first:
                taken = self.hosts.take_locked(channel, receive.array, tag)
                if taken is None and not self._lost(channel.rank):
                    return
            if taken:
                self._take_through(receive, queue, key)
                receive.deferred = False
                receive.work = None  # the Work and its future stop holding each other
                posting = None
            else:
                posting = self._post(self._take_through(receive, queue, key))
        finally:
            lock.release()
        if posting is None:
            receive.set_result(channel.rank)
        else:
            self._after(posting)

    def await_message(self, receive: DeferredReceive, timeout: float | None) -> float | None:
        """Take ``receive``'s message as a waiter would, within a waiter's polls (and
        ``timeout``), and post it if it has not come by then; return what is left of
        ``timeout``."""
        if self._refused(receive.channel):
            self.post(receive)  # which fails it
            return timeout
        spins = self.hosts.group.spin_iterations
        if spins and receive.channel.spin_for_news(spins * SPIN_ITERATION_SECONDS):
            self.attempt(receive)
            if not receive.deferred:
                return timeout
        budget = YIELD_SECONDS if timeout is None else min(timeout, YIELD_SECONDS)

        def settled() -> bool:
            self.attempt(receive)
            return not receive.deferred

        if poll_briefly(settled, 0, budget):
            return timeout
        self.post(receive)
        return None if timeout is None else max(0.0, timeout - budget)

    def _refused(self, channel: Channel) -> bool:
        """Whether a receive from ``channel``'s peer is refused (the engine is closed or broken,
        or the peer is gone): its rings may be unmapped already, and posting says why."""
        inbox = self._inbox
        return inbox.closed or inbox.broken is not None or self._lost(channel.rank)

    def post(self, receive: DeferredReceive) -> None:
        """Post ``receive``, after the receives before it in its queue."""
        inbox = self._inbox
        with inbox.lock:
            if not receive.deferred:
                return
            key = (receive.channel.rank, receive.tag)
            posting = self._post(self._take_through(receive, inbox.deferred[key], key))
        self._after(posting)

    def overtaken_by(self, src: int | None, tag: int) -> list[DeferredReceive]:
        """Take out of their queues, in order, the receives that a receive from ``src`` (None:
        any rank) of ``tag``, about to be posted, would overtake (inbox lock held)."""
        queues = self._inbox.deferred
        if src is not None:
            queue = queues.pop((src, tag), None)
            return list(queue) if queue else []
        keys = [key for key in queues if key[1] == tag]
        return [receive for key in keys for receive in queues.pop(key)]

    def _take_through(self, receive: DeferredReceive, queue: deque[DeferredReceive],
                      key: tuple[int, int]) -> list[DeferredReceive]:
        """Take ``receive`` and those before it out of ``queue`` (inbox lock held)."""
        taken = []
        while True:
            earlier = queue.popleft()
            taken.append(earlier)
            if earlier is receive:
                break
        if queue:
            queue[0].first = True
        else:
            del self._inbox.deferred[key]
        return taken
