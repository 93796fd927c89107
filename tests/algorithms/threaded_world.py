"""An in-process transport for testing colls.algorithms: n ranks as n threads.

:class:`ThreadedWorld` is a thread-safe mailbox matching messages by (src, dst, tag) in FIFO order,
with any-source receives. Each rank's comm is a real :class:`colls.backend.Backend` subclass, so
calling ``comm.all_reduce(...)`` goes through the Backend's default methods into
:mod:`colls.algorithms`, exactly as a transport plugin would.

The transport is deliberately strict, to expose algorithm bugs that a forgiving one would hide:

* Sends are *rendezvous*: the bytes are copied when the matching receive exists, on a separate
  delivery thread, so a send buffer modified before its Work completes, or a receive buffer read
  before its Work completes, shows up as wrong data. ``delay`` adds random latency per message.
* A send buffer changed before its send completed fails the send (the bytes are compared with a
  snapshot taken at ``isend``), and a receive buffer is filled with poison bytes when posted, so
  reading it before the receive completes gives garbage.
* A size or dtype mismatch between a send and its receive fails both Works (BackendError).
* Arrays must be 1-D and C-contiguous, as the Backend contract promises.

:func:`run_ranks` runs ``fn(comm)`` on n threads, re-raises the first failure (after failing every
pending message so the other ranks stop at once) and fails the test on a hang.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from _support import run_threads

from colls.backend import Backend
from colls.errors import BackendError
from colls.options import BackendOptions
from colls.work import Work

#: Byte written over every posted receive buffer (0b10100101: odd, negative, NaN-ish).
POISON = 0xA5


@dataclass
class _Post:
    peer: int | None  # sender for a receive (None: any source), receiver for a send
    tag: int
    array: np.ndarray
    work: Work
    snapshot: bytes = b""


@dataclass
class _Stats:
    sends: list[tuple[int, int, int]] = field(default_factory=list)  # (dst, tag, nbytes)


class ThreadComm(Backend):
    """One rank of a :class:`ThreadedWorld`; a Backend with only point-to-point implemented."""

    def __init__(self, world: ThreadedWorld, rank: int, world_size: int, timeout: float) -> None:
        options = BackendOptions(
            timeout=timeout, group_name="threaded", global_ranks=tuple(range(world_size))
        )
        super().__init__(None, rank, world_size, options)  # type: ignore[arg-type]
        self._world = world
        self.stats = _Stats()

    def isend(self, array: np.ndarray, dst: int, tag: int) -> Work:
        """Post a send; it completes once a matching receive has copied it."""
        self.stats.sends.append((dst, tag, array.nbytes))
        return self._world.post_send(self.rank, array, dst, tag)

    def irecv(self, array: np.ndarray, src: int | None, tag: int) -> Work:
        """Post a receive; its result is the sender's rank."""
        return self._world.post_recv(self.rank, array, src, tag)


class ThreadedWorld:
    """A mailbox shared by ``world_size`` thread ranks (see the module docstring)."""

    def __init__(self, world_size: int, timeout: float = 10.0, delay: float = 0.0) -> None:
        self.world_size = world_size
        self.delay = delay
        self._lock = threading.Lock()
        self._sends: list[list[tuple[int, _Post]]] = [[] for _ in range(world_size)]
        self._recvs: list[list[_Post]] = [[] for _ in range(world_size)]
        self._failure: BaseException | None = None
        self._deliveries: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._random = random.Random(world_size)
        self._deliverer = threading.Thread(target=self._deliver_loop, daemon=True)
        self._deliverer.start()
        self.comms = [ThreadComm(self, rank, world_size, timeout) for rank in range(world_size)]

    # -- posting ----------------------------------------------------------------------------------

    def _check(self, rank: int, array: Any, peer: int | None, tag: int, kind: str) -> None:
        if not isinstance(array, np.ndarray) or array.ndim != 1 or not array.flags.c_contiguous:
            raise BackendError(f"rank {rank}: {kind} needs a C-contiguous 1-D numpy array")
        if peer is not None and not 0 <= peer < self.world_size:
            raise BackendError(f"rank {rank}: {kind} peer {peer} out of range")
        if not isinstance(tag, int):
            raise BackendError(f"rank {rank}: {kind} tag must be an int, got {tag!r}")

    def post_send(self, src: int, array: np.ndarray, dst: int, tag: int) -> Work:
        """Match a send against posted receives, or queue it."""
        self._check(src, array, dst, tag, "isend")
        work = Work(description=f"send {src}->{dst} tag {tag}")
        post = _Post(dst, tag, array, work, array.tobytes())
        with self._lock:
            if self._failure is not None:
                work.set_exception(self._failure)
                return work
            pending = self._recvs[dst]
            for index, recv in enumerate(pending):
                if recv.tag == tag and recv.peer in (None, src):
                    del pending[index]
                    self._deliveries.put((src, dst, post, recv))
                    return work
            self._sends[dst].append((src, post))
        return work

    def post_recv(self, dst: int, array: np.ndarray, src: int | None, tag: int) -> Work:
        """Match a receive against queued sends, or post it."""
        self._check(dst, array, src, tag, "irecv")
        work = Work(description=f"recv {src}->{dst} tag {tag}")
        array.view(np.uint8)[...] = POISON
        post = _Post(src, tag, array, work)
        with self._lock:
            if self._failure is not None:
                work.set_exception(self._failure)
                return work
            queued = self._sends[dst]
            for index, (sender, send) in enumerate(queued):
                if send.tag == tag and src in (None, sender):
                    del queued[index]
                    self._deliveries.put((sender, dst, send, post))
                    return work
            self._recvs[dst].append(post)
        return work

    # -- delivery ---------------------------------------------------------------------------------

    def _deliver_loop(self) -> None:
        while True:
            item = self._deliveries.get()
            if item is None:
                return
            if self.delay:
                time.sleep(self._random.uniform(0, self.delay))
            src, dst, send, recv = item
            a, b = send.array, recv.array
            if a.nbytes != b.nbytes or a.dtype != b.dtype:
                exc = BackendError(
                    f"message {src}->{dst} tag {send.tag}: sent {a.nbytes} bytes of {a.dtype}, "
                    f"receive buffer holds {b.nbytes} bytes of {b.dtype}"
                )
                send.work.set_exception(exc)
                recv.work.set_exception(exc)
                continue
            if a.tobytes() != send.snapshot:
                exc = BackendError(
                    f"message {src}->{dst} tag {send.tag}: the send buffer changed before the "
                    "send completed"
                )
                send.work.set_exception(exc)
                recv.work.set_exception(exc)
                continue
            b.view(np.uint8)[...] = a.view(np.uint8)
            send.work.set_result(None)
            recv.work.set_result(src)

    def abort(self, exc: BaseException) -> None:
        """Fail every pending and future message with ``exc`` (a rank died)."""
        with self._lock:
            if self._failure is None:
                self._failure = exc
            pending = [p for q in self._recvs for p in q] + [p for q in self._sends for _, p in q]
            for q in self._recvs:
                q.clear()
            for q in self._sends:
                q.clear()
        for post in pending:
            post.work.set_exception(exc)

    def unmatched(self) -> int:
        """Return how many posted sends and receives are still waiting for a partner."""
        with self._lock:
            return sum(len(q) for q in self._recvs) + sum(len(q) for q in self._sends)

    def close(self) -> None:
        """Stop the delivery thread (after the queued deliveries)."""
        self._deliveries.put(None)
        self._deliverer.join(timeout=5)


def run_ranks(
    world_size: int,
    fn: Callable[[ThreadComm], Any],
    timeout: float = 30.0,
    *,
    comm_timeout: float = 10.0,
    delay: float = 0.0,
    world: ThreadedWorld | None = None,
) -> list[Any]:
    """Run ``fn(comm)`` on ``world_size`` thread ranks and return their results by rank.

    Re-raises the first failure (every other rank's pending messages are failed at once so it
    stops quickly), fails the test if a rank is still running after ``timeout`` seconds, and
    fails it if a message was left unmatched (an algorithm sent more than its peers received).
    """
    world = world or ThreadedWorld(world_size, comm_timeout, delay)

    def stop_the_others(rank: int, exc: BaseException) -> None:
        world.abort(BackendError(f"rank {rank} failed: {exc!r}"))

    run = run_threads(lambda rank: fn(world.comms[rank]), world_size, timeout,
                      on_error=stop_the_others)
    if run.hung:  # wake them; run.errors was taken before, so it holds only their own failures
        world.abort(BackendError("test timed out"))
    world.close()
    if run.errors:
        raise run.errors[0][1]
    if run.hung:
        pytest.fail(f"ranks {run.hung} of {world_size} still running after {timeout} s (hang)")
    leftover = world.unmatched()
    if leftover:
        pytest.fail(f"{leftover} messages left unmatched after every rank returned")
    return run.results
