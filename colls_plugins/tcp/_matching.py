"""Receive matching of the tcp backend: posted receives and unexpected messages.

Messages are matched by ``(source, tag)``, first come first served, as MPI does:

* When a message header arrives from ``src`` with ``tag``, it goes to the earliest *posted*
  receive that accepts it: the head of the ``(src, tag)`` queue or the head of the any-source
  ``tag`` queue, whichever was posted first.
* When no receive is posted, the message becomes *unexpected*: its body is read into a buffer of
  its own and queued. A later receive takes the earliest unexpected message it accepts (for an
  any-source receive, the earliest arrival over all sources).

An unexpected message may still be arriving when a receive takes it; the receive then becomes the
message's ``waiter`` and completes when the last byte is in.

This module is a plain data structure with no locking and no I/O: the engine holds its lock around
every call.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import numpy as np

from colls.work import Work


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


class MatchTable:
    """Posted receives and unexpected messages, matched per ``(src, tag)`` in FIFO order."""

    def __init__(self) -> None:
        self._spare: dict[int, list[memoryview]] = {}  # nbytes -> recycled message buffers
        self._spare_bytes = 0
        self._posted_src: dict[tuple[int, int], deque[RecvOp]] = {}
        self._posted_any: dict[int, deque[RecvOp]] = {}
        self._unexpected: dict[int, dict[int, deque[Message]]] = {}  # tag -> src -> messages
        self._seq = itertools.count()

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
        self._unexpected.setdefault(tag, {}).setdefault(src, deque()).append(message)
        return message

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
        return message

    def discard(self, message: Message) -> None:
        """Remove ``message`` from the unexpected queue if it is still there."""
        by_src = self._unexpected.get(message.tag, {})
        queue = by_src.get(message.src)
        if queue is None or message not in queue:
            return
        queue.remove(message)
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
        return removed

    def has_unexpected(self) -> bool:
        """Return whether any unexpected message is queued."""
        return bool(self._unexpected)

    def posted_count(self) -> int:
        """Return how many receives are posted and waiting."""
        return sum(map(len, self._posted_src.values())) + sum(map(len, self._posted_any.values()))


def _pop(table: dict, key: object) -> RecvOp:  # type: ignore[type-arg]
    queue = table[key]
    op = queue.popleft()
    if not queue:
        del table[key]
    return op
