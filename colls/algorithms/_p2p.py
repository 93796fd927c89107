"""Point-to-point plumbing shared by every algorithm in :mod:`colls.algorithms`.

The algorithms only ever see a *comm*: an object with ``rank``, ``world_size``, ``timeout``,
``isend(array, dst, tag)`` and ``irecv(array, src, tag)`` (a :class:`~colls.backend.Backend`).
This module turns that into the few shapes the algorithms need:

* :class:`Pending` - the sends and receives of one step, waited together with the group's timeout;
  zero-sized messages are skipped (both sides derive sizes from the same numbers, so both skip).
* :class:`RecvPipeline` - a stream of receives kept a few messages ahead of the consumer, so the
  network fills the next buffer while the caller reduces the current one.
* chunk / segment arithmetic and scratch allocation that works for NumPy and CuPy alike (and
  takes scratch from the backend when it offers some: :func:`empty_like`).

Waiting uses :func:`colls.work.all_done`, so a step fails as soon as any of its messages fails (a
dead peer is reported at once, not at the timeout). A comm with a ``poll(work)`` method (the tcp
backend) is given the chance to make progress on the waiting thread first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from colls.errors import CollsTimeoutError
from colls.work import Work, all_done

Array = Any  # numpy.ndarray (CPU) or cupy.ndarray (CUDA): C-contiguous and 1-D

#: Receives a pipeline keeps posted ahead of the one being consumed. Two or more lets the next
#: segment arrive while the current one is reduced; more than a few only adds scratch memory.
PIPELINE_DEPTH = 4


class Comm(Protocol):
    """What the algorithms need from a backend: its place in the group and point-to-point."""

    rank: int
    world_size: int

    @property
    def timeout(self) -> float | None: ...

    def isend(self, array: Array, dst: int, tag: int) -> Work: ...

    def irecv(self, array: Array, src: int | None, tag: int) -> Work: ...


def wait_all(comm: Comm, works: Sequence[Work], what: str, *, poll: bool = True) -> None:
    """Wait for every Work in ``works`` with the group's timeout; fail on the first failure.

    Args:
        comm: the group's backend (its ``timeout`` bounds the wait).
        works: the Works to wait for (may be empty).
        what: the step, for the timeout message ("all_reduce ring: receive from rank 3").
        poll: let the backend make progress on this thread before it sleeps (its ``poll``).

    Raises:
        CollsTimeoutError: the works did not all finish within ``comm.timeout``.
        Exception: the first failure of any of the works (e.g. BackendError naming a dead peer).
    """
    if not works:
        return
    combined = works[0] if len(works) == 1 else all_done(list(works), description=what)
    progress = getattr(comm, "poll", None) if poll else None
    if progress is not None and not combined.is_completed():
        progress(combined)  # the backend may make progress on this thread before it sleeps
    try:
        combined.wait(comm.timeout)
    except CollsTimeoutError:
        if combined.is_completed():
            raise  # the operation itself failed with a timeout: keep the backend's message
        who = getattr(comm, "who", None) or f"rank {comm.rank}"  # a sub-group names its parent
        raise CollsTimeoutError(
            f"{who}: {what} did not complete within {comm.timeout:.1f} s"
        ) from None


class Pending:
    """The sends and receives of one algorithm step, waited together.

    Zero-sized arrays are not posted: every size an algorithm sends is computed identically by
    sender and receiver, so both sides skip the same messages and FIFO matching stays aligned.
    """

    __slots__ = ("_comm", "_tag", "_what", "_works")

    def __init__(self, comm: Comm, tag: int, what: str) -> None:
        self._comm = comm
        self._tag = tag
        self._what = what
        self._works: list[Work] = []

    def send(self, array: Array, dst: int) -> None:
        """Post a send of ``array`` to ``dst`` (nothing for an empty array)."""
        if array.size:
            self._works.append(self._comm.isend(array, dst, self._tag))

    def recv(self, array: Array, src: int) -> None:
        """Post a receive into ``array`` from ``src`` (nothing for an empty array)."""
        if array.size:
            self._works.append(self._comm.irecv(array, src, self._tag))

    def wait(self) -> None:
        """Wait for everything posted so far, then forget it."""
        works, self._works = self._works, []
        wait_all(self._comm, works, self._what)


def sendrecv(
    comm: Comm, send: Array, dst: int, recv: Array, src: int, tag: int, what: str
) -> None:
    """Send ``send`` to ``dst`` and receive ``recv`` from ``src`` concurrently; wait for both."""
    step = Pending(comm, tag, what)
    step.recv(recv, src)
    step.send(send, dst)
    step.wait()


class RecvPipeline:
    """A sequence of receives consumed in order, kept ``depth`` messages ahead of the consumer.

    Receive ``i`` comes from ``sources[i]`` into ``target(i)``; ``target`` is called when the
    receive is posted, so a caller that recycles ``depth + 1`` scratch buffers can hand out
    buffer ``i % (depth + 1)``: when receive ``i + depth`` is posted, the only other buffers in use
    are those of the receives still in flight and of the one being consumed.

    Every target must be non-empty (callers list only non-empty segments).
    """

    __slots__ = ("_comm", "_tag", "_what", "_sources", "_target", "_next", "_posted")

    def __init__(
        self,
        comm: Comm,
        tag: int,
        sources: Sequence[int],
        target: Callable[[int], Array],
        what: str,
        depth: int = PIPELINE_DEPTH,
    ) -> None:
        self._comm = comm
        self._tag = tag
        self._what = what
        self._sources = sources
        self._target = target
        self._next = 0
        self._posted: deque[Work] = deque()
        for _ in range(min(depth, len(sources))):
            self._post()

    def _post(self) -> None:
        index = self._next
        self._next += 1
        self._posted.append(
            self._comm.irecv(self._target(index), self._sources[index], self._tag)
        )

    def next(self) -> None:
        """Wait for the oldest outstanding receive, then post the next one before returning.

        Posting before the caller consumes the arrived buffer is what overlaps the network with
        the reduction.
        """
        work = self._posted.popleft()
        # Poll only for the last receive in flight: while more stream in behind it, the backend's
        # progress thread is busy with them anyway, and a polling caller competes with it.
        wait_all(self._comm, [work], self._what, poll=not self._posted)
        if self._next < len(self._sources):
            self._post()


def chunk_bounds(count: int, parts: int) -> list[tuple[int, int]]:
    """Split ``count`` elements into ``parts`` contiguous chunks, the first ``count % parts``
    one element longer (chunks may be empty when ``count < parts``)."""
    base, extra = divmod(count, parts)
    bounds = []
    start = 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def segments(start: int, stop: int, size: int) -> list[tuple[int, int]]:
    """Cut ``[start, stop)`` into consecutive pieces of at most ``size`` elements."""
    return [(lo, min(lo + size, stop)) for lo in range(start, stop, size)]


def empty_like(array: Array, count: int, comm: Comm | None = None) -> Array:
    """Return ``count`` uninitialised elements of ``array``'s dtype on ``array``'s device.

    A comm with a ``scratch(like, count)`` method (the tcp backend: a reused, huge-page-backed
    arena, so large collectives do not pay page faults on every call) provides the memory;
    otherwise ``np.empty_like``, which dispatches through ``__array_function__``, so a CuPy array
    gets CuPy scratch.
    """
    scratch = getattr(comm, "scratch", None)
    if scratch is not None:
        return scratch(array, count)
    return np.empty_like(array, shape=(count,))


def offsets(splits: Sequence[int]) -> list[int]:
    """Return the start offset of each split (exclusive prefix sum)."""
    starts = []
    total = 0
    for size in splits:
        starts.append(total)
        total += size
    return starts
