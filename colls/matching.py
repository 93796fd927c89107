"""Receive matching, written once for every transport: posted receives against arrived messages.

Every backend needs the same machinery between "bytes arrived from peer p" and the receives its
users posted: lists of posted receives and of messages nobody has asked for yet, matching in
order per ``(source, tag)``, receives from any source, delivery into the receive's array with the
size check the contract demands, and failing what is pending when a peer is lost or the backend
closes. This module offers it at two levels:

* :class:`Matcher` - for a transport that hands over *whole messages*. Its ``irecv`` is
  :meth:`Matcher.post`; its reader calls :meth:`Matcher.arrived` with each message's bytes;
  :meth:`Matcher.peer_lost` and :meth:`Matcher.close` fail what is pending. Thread-safe. With it a
  backend writes only "send these bytes" and "bytes arrived from peer p" (docs/plugins.md).
* :class:`MatchTable` - the queues underneath, without locking or I/O, for a transport that
  streams message bodies straight into the receive's memory once the header is in (the tcp
  engine, which holds its own lock around every call and reads the bodies itself).

Matching follows MPI's rule:

* When a message arrives from ``src`` with ``tag``, it goes to the earliest *posted* receive that
  accepts it: the head of the ``(src, tag)`` queue or the head of the any-source ``tag`` queue,
  whichever was posted first.
* When no receive is posted, the message becomes *unexpected* and is queued. A later receive
  takes the earliest unexpected message it accepts (for an any-source receive, the earliest
  arrival over all sources).

A streamed unexpected message may still be arriving when a receive takes it; the receive then
becomes the message's ``waiter`` and completes when the last byte is in.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from colls.errors import BackendError
from colls.work import Work

#: Copies at least this large go through NumPy, which releases the GIL while it copies.
NUMPY_COPY_BYTES = 1 << 16


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """Copy ``src`` into ``dst`` (byte views of one size); large copies release the GIL."""
    if dst.nbytes >= NUMPY_COPY_BYTES:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
    else:
        dst[:] = src


def size_error(description: str, src: int, tag: int, nbytes: int, expected: int) -> BackendError:
    """Return the error of a receive whose message has the wrong size (names both sizes)."""
    return BackendError(
        f"{description}: the message from rank {src} with tag {tag} has {nbytes} bytes but the "
        f"receive buffer has {expected} bytes"
    )


@dataclass(eq=False)
class RecvOp:
    """A posted receive: where the bytes go and which Work to complete."""

    work: Work
    view: memoryview
    src: int | None
    tag: int
    seq: int = 0


@dataclass(eq=False)
class Message:
    """An unexpected message: its bytes, whether they are all in, and who waits for them."""

    src: int
    tag: int
    buffer: memoryview  # unsigned bytes, not zero-filled (the body overwrites them)
    seq: int
    done: bool = False
    waiter: RecvOp | None = None


#: Bodies of unexpected messages at least this large are read into recycled buffers (fresh
#: megabytes cost a page fault per 4 KiB page); at most RECYCLE_MAX_BYTES are kept.
RECYCLE_MIN_BYTES = 1 << 16
RECYCLE_MAX_BYTES = 8 << 20

#: What one queued unexpected message costs beyond its body (its objects and queue slot), so
#: that :attr:`MatchTable.unexpected_bytes` also grows with a flood of empty messages.
MESSAGE_OVERHEAD_BYTES = 256


class MatchTable:
    """Posted receives and unexpected messages, matched per ``(src, tag)`` in FIFO order.

    A plain data structure: no locking, no I/O, no Work completion. The caller holds its own
    lock around every call and completes the Works it gets back after releasing it.
    """

    def __init__(self) -> None:
        self._spare: dict[int, list[memoryview]] = {}  # nbytes -> recycled message buffers
        self._spare_bytes = 0
        self._posted_src: dict[tuple[int, int], deque[RecvOp]] = {}
        self._posted_any: dict[int, deque[RecvOp]] = {}
        self._unexpected: dict[int, dict[int, deque[Message]]] = {}  # tag -> src -> messages
        self._seq = itertools.count()
        #: Bytes the queued unexpected messages hold (bodies plus MESSAGE_OVERHEAD_BYTES each).
        self.unexpected_bytes = 0

    # -- receives -----------------------------------------------------------------------------
    def post(self, op: RecvOp) -> None:
        """Queue ``op`` until a matching message arrives."""
        op.seq = next(self._seq)
        if op.src is None:
            self._posted_any.setdefault(op.tag, deque()).append(op)
        else:
            self._posted_src.setdefault((op.src, op.tag), deque()).append(op)

    def match_arrival(self, src: int, tag: int) -> RecvOp | None:
        """Remove and return the earliest posted receive accepting a message (src, tag)."""
        specific = self._posted_src.get((src, tag))
        anysrc = self._posted_any.get(tag)
        if specific and (not anysrc or specific[0].seq < anysrc[0].seq):
            return _pop(self._posted_src, (src, tag))
        if anysrc:
            return _pop(self._posted_any, tag)
        return None

    # -- unexpected messages --------------------------------------------------------------------
    def add_unexpected(self, src: int, tag: int, nbytes: int) -> Message:
        """Queue a new unexpected message of ``nbytes`` (its body is still to be read)."""
        spare = self._spare.get(nbytes)
        if spare:
            buffer = spare.pop()
            self._spare_bytes -= nbytes
        else:
            buffer = memoryview(np.empty(nbytes, np.uint8))
        message = Message(src, tag, buffer, next(self._seq))
        self._queue(message)
        return message

    def add_arrived(self, src: int, tag: int, payload: memoryview) -> Message:
        """Queue a whole unexpected message that keeps ``payload`` (no copy is made)."""
        message = Message(src, tag, payload, next(self._seq), done=True)
        self._queue(message)
        return message

    def _queue(self, message: Message) -> None:
        self._unexpected.setdefault(message.tag, {}).setdefault(message.src, deque()).append(
            message
        )
        self.unexpected_bytes += len(message.buffer) + MESSAGE_OVERHEAD_BYTES

    def recycle(self, buffer: memoryview) -> None:
        """Keep the body buffer of a delivered unexpected message for a later one."""
        nbytes = len(buffer)
        if nbytes >= RECYCLE_MIN_BYTES and self._spare_bytes + nbytes <= RECYCLE_MAX_BYTES:
            self._spare.setdefault(nbytes, []).append(buffer)
            self._spare_bytes += nbytes

    def take_unexpected(self, src: int | None, tag: int) -> Message | None:
        """Remove and return the earliest unexpected message a receive (src, tag) accepts."""
        by_src = self._unexpected.get(tag)
        if not by_src:
            return None
        if src is None:
            src = min(by_src, key=lambda s: by_src[s][0].seq)
        elif src not in by_src:
            return None
        queue = by_src[src]
        message = queue.popleft()
        if not queue:
            del by_src[src]
            if not by_src:
                del self._unexpected[tag]
        self.unexpected_bytes -= len(message.buffer) + MESSAGE_OVERHEAD_BYTES
        return message

    def discard(self, message: Message) -> None:
        """Remove ``message`` from the unexpected queue if it is still there."""
        by_src = self._unexpected.get(message.tag, {})
        queue = by_src.get(message.src)
        if queue is None or message not in queue:
            return
        queue.remove(message)
        self.unexpected_bytes -= len(message.buffer) + MESSAGE_OVERHEAD_BYTES
        if not queue:
            del by_src[message.src]
            if not by_src:
                del self._unexpected[message.tag]

    # -- failure and shutdown -------------------------------------------------------------------
    def remove_from(self, src: int) -> list[RecvOp]:
        """Remove and return every posted receive that names ``src``."""
        removed: list[RecvOp] = []
        for key in [k for k in self._posted_src if k[0] == src]:
            removed.extend(self._posted_src.pop(key))
        return removed

    def awaits(self, src: int) -> bool:
        """Return whether any posted receive accepts some message from ``src``."""
        return bool(self._posted_any) or any(key[0] == src for key in self._posted_src)

    def has_posted(self, src: int, tag: int) -> bool:
        """Return whether a receive for exactly ``(src, tag)`` is posted."""
        return (src, tag) in self._posted_src

    def remove_collective(self) -> list[RecvOp]:
        """Remove and return every posted receive with a collective (negative) tag."""
        removed: list[RecvOp] = []
        for key in [k for k in self._posted_src if k[1] < 0]:
            removed.extend(self._posted_src.pop(key))
        for tag in [t for t in self._posted_any if t < 0]:
            removed.extend(self._posted_any.pop(tag))
        return removed

    def remove_any_source(self) -> list[RecvOp]:
        """Remove and return every posted any-source receive."""
        removed = [op for queue in self._posted_any.values() for op in queue]
        self._posted_any.clear()
        return removed

    def remove_all(self) -> list[RecvOp]:
        """Remove every posted receive and unexpected message; return the receives to fail."""
        removed = [op for queue in self._posted_src.values() for op in queue]
        self._posted_src.clear()
        removed.extend(self.remove_any_source())
        self._unexpected.clear()
        self.unexpected_bytes = 0
        return removed

    def expects(self, src: int, tag: int) -> bool:
        """Return whether a posted receive accepts a message ``(src, tag)`` (it takes it first)."""
        return (src, tag) in self._posted_src or tag in self._posted_any

    def empty(self) -> bool:
        """Return whether no receive is posted and no unexpected message is queued (then a
        message goes to whoever receives it next: a blocking receive's common case)."""
        return not (self._posted_src or self._posted_any or self._unexpected)

    def queued(self, src: int, tag: int) -> bool:
        """Return whether an unexpected message ``(src, tag)`` is queued (a hint without the
        caller's lock: one dict lookup each, which another thread's change cannot break)."""
        return src in self._unexpected.get(tag, ())

    def first_unexpected(self, src: int, tag: int) -> Message | None:
        """Return the queued message a receive ``(src, tag)`` takes next, leaving it queued."""
        by_src = self._unexpected.get(tag)
        queue = None if by_src is None else by_src.get(src)
        return None if queue is None else queue[0]

    def has_unexpected(self) -> bool:
        """Return whether any unexpected message is queued."""
        return bool(self._unexpected)

    def posted_count(self) -> int:
        """Return how many receives are posted and waiting."""
        return sum(map(len, self._posted_src.values())) + sum(map(len, self._posted_any.values()))


class Matcher:
    """The receive side of a transport that delivers whole messages (module docstring).

    A backend's ``irecv`` returns :meth:`post`; whatever reads its transport calls
    :meth:`arrived` once per message addressed to this rank, in the order the sender sent them
    (per sender and tag: that order is the FIFO rule); it calls :meth:`peer_lost` when it learns
    that a peer is gone and :meth:`close` from the backend's ``close()``. Every method may be
    called from any thread. Works are completed after the lock is released, so their callbacks
    may post more receives.

    Args:
        timeout: the default ``wait()`` timeout of the receive Works (the backend's timeout).
        name: how Work descriptions and errors name the backend ("mailbox").
    """

    def __init__(self, timeout: float | None, *, name: str = "backend") -> None:
        self.timeout = timeout
        self.name = name
        self._lock = threading.Lock()
        self._table = MatchTable()
        self._closed: BackendError | None = None
        self._lost: dict[int, BaseException] = {}

    def post(self, array: Any, src: int | None, tag: int) -> Work:
        """Receive into ``array`` from ``src`` (None: any rank); return its Work.

        The Work's result is the sender's rank. It fails with a BackendError naming both sizes
        when the message's size differs from ``array.nbytes``, with the peer's error when
        ``src`` was lost, and with the close error once the matcher is closed.
        """
        origin = "any rank" if src is None else f"rank {src}"
        work = Work(description=f"{self.name} recv from {origin} tag {tag}",
                    default_timeout=self.timeout)
        op = RecvOp(work, memoryview(array.view(np.uint8)), src, tag)
        with self._lock:
            refusal = self._closed if src is None else self._closed or self._lost.get(src)
            message = None if refusal is not None else self._table.take_unexpected(src, tag)
            if refusal is None and message is None:
                self._table.post(op)
        if refusal is not None:
            work.set_exception(refusal)
        elif message is not None:
            _deliver(op, message.src, message.buffer)
        return work

    def arrived(self, src: int, tag: int, payload: bytes | bytearray | memoryview) -> None:
        """Hand over a whole message from rank ``src`` with ``tag``.

        ``payload`` is kept, not copied, until a receive takes it: do not reuse its memory.

        It completes the earliest posted receive that accepts it, or waits for one. After
        :meth:`close` it is dropped: nobody can receive it any more.
        """
        view = memoryview(payload)
        if view.format != "B":  # an array's own format: compare and copy it as bytes
            view = memoryview(np.frombuffer(view, np.uint8))
        with self._lock:
            if self._closed is not None:
                return
            op = self._table.match_arrival(src, tag)
            if op is None:
                self._table.add_arrived(src, tag, view)
                return
        _deliver(op, src, view)

    def peer_lost(self, src: int, error: BaseException) -> None:
        """Fail with ``error`` every receive from ``src`` and every any-source receive.

        Later receives from ``src`` fail at once with ``error``; later any-source receives are
        still posted (other peers may send). ``error`` should be a NetworkError naming the
        rank (docs/plugins.md).
        """
        with self._lock:
            if self._closed is not None:
                return
            self._lost.setdefault(src, error)
            failed = self._table.remove_from(src) + self._table.remove_any_source()
        for op in failed:
            op.work.set_exception(error)

    def close(self, error: BackendError | None = None) -> None:
        """Fail every posted receive (default: ``BackendError("<name> backend closed")``).

        Later receives fail at once with the same error; unexpected messages are dropped.
        Idempotent: only the first call fails anything.
        """
        with self._lock:
            if self._closed is not None:
                return
            self._closed = error or BackendError(f"{self.name} backend closed")
            failed = self._table.remove_all()
        for op in failed:
            op.work.set_exception(self._closed)

    def pending(self) -> int:
        """Return how many posted receives are waiting for a message."""
        with self._lock:
            return self._table.posted_count()


def _deliver(op: RecvOp, src: int, payload: memoryview) -> None:
    """Complete ``op`` with a whole message from ``src`` (or fail it: wrong size)."""
    if payload.nbytes != op.view.nbytes:
        op.work.set_exception(
            size_error(op.work.description, src, op.tag, payload.nbytes, op.view.nbytes))
        return
    copy_bytes(op.view, payload)
    op.work.set_result(src)


def _pop(table: dict, key: object) -> RecvOp:  # type: ignore[type-arg]
    queue = table[key]
    op = queue.popleft()
    if not queue:
        del table[key]
    return op
