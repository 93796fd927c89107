"""The thread that completes a backend's point-to-point Works without the caller polling.

MPI completes a nonblocking request only when someone calls into MPI (MPICH has no progress
thread of its own by default), and a colls :class:`~colls.work.Work` must complete while its
owner waits on it, computes, or forgets it. So each backend has one :class:`Progress` thread:
``isend``/``irecv`` post the MPI request on the caller's thread (nonblocking), test it once
(small messages are often done at once, and then no thread is involved at all), and hand the
rest to this thread, which ``Test``\\ s its pending requests and completes their Works.

Latency and CPU: a thread that waits on a Work tests its request itself for a while (like
``MPI_Wait``, see :class:`DrivenFuture`), so a waited-on message is seen at once, and the
progress thread leaves every request alone while any waiter drives one (the waiter's MPI calls
progress them all; the thread's tests would only contend for the GIL and MPI's lock). The
blocking ``send``/``recv`` of the backend skip Works and this thread altogether. The progress
thread never spins: while requests are pending it polls with a back-off from :data:`MIN_SLEEP`
to :data:`MAX_SLEEP`; for :data:`LINGER_S` after the last one it looks every :data:`LINGER_LOOK_S`
without being woken per request (being woken took the GIL from the caller every message), then
sleeps on a condition until woken. A Work nobody waits on therefore completes at most about
``LINGER_LOOK_S`` after MPI finished it, and a receive pending for minutes costs a wake-up per
millisecond, not a core.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from colls.completion import Completion
from colls.errors import BackendError
from colls.work import Work

#: Seconds the thread leaves a new request alone. A thread that waits on the Work drives it
#: itself (:class:`DrivenFuture`); a second thread testing at the same time would only contend
#: for the GIL and for MPI's internal lock (that made a ping-pong 20x slower than raw mpi4py).
FIRST_LOOK: Final = 100e-6
#: First and longest sleep between polls while requests are pending (seconds).
MIN_SLEEP: Final = 20e-6
MAX_SLEEP: Final = 1e-3
#: Seconds the thread keeps looking for new requests every MAX_SLEEP after the last one
#: completed, before it sleeps until woken: a program exchanging messages in a loop is not
#: woken per message (each wake-up took the GIL from the caller), an idle one costs nothing.
LINGER_S: Final = 0.5
#: Seconds between the thread's looks while it lingers, or while a waiter drives a request.
#: Each look takes the GIL; on a crowded host the OS may preempt the thread holding it, which
#: stalled the caller for milliseconds: a look per millisecond made isend/irecv + wait ten times
#: slower than MPI's under load, as tcp's progress thread did (docs/benchmarks.md).
LINGER_LOOK_S: Final = 20e-3
#: How long close() waits for the thread to leave MPI.
JOIN_TIMEOUT: Final = 5.0
#: A thread that waits on a request tests it back to back this many times, then yields the CPU
#: between tests (as MPI's own blocking wait does): pure spinning starves a peer process that
#: shares the core (4 ranks on 2 cores ran 3x slower than MPICH's blocking call).
YIELD_AFTER_TESTS: Final = 20
#: Seconds a thread waiting on a point-to-point Work drives its request itself (like MPI_Wait,
#: without a thread hand-off; yielding the CPU between tests after the first few) before
#: leaving it to the progress thread and sleeping. 5 ms was too short on a loaded host: a peer
#: descheduled for longer sent the wait to the thread, whose polls and GIL hand-offs then cost
#: hundreds of microseconds per message (isend/irecv ping-pong: +125..600 us -> +43..120 us).
DRIVE_SECONDS: Final = 1.0


@dataclass(eq=False)
class Pending:
    """One posted request: its MPI request, Work, buffer (kept alive) and completion step.

    ``finish(status)`` returns the Work's value or raises the failure to report; it runs on
    whichever thread saw the request complete. ``describe(exc, status)`` turns an MPI error
    raised by ``Test`` into the exception to report. ``lock`` makes one thread at a time test
    the request (MPI forbids concurrent tests of one request); ``done`` records completion (a
    completed request becomes MPI_REQUEST_NULL, which tests as complete with an empty status).
    """

    request: Any
    work: Work
    buffer: Any
    finish: Callable[[Any], Any]
    describe: Callable[[Exception, Any], BaseException]
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False
    driven: bool = False  # a thread waiting on the Work is testing the request itself


def test_once(item: Pending, status: Any) -> bool:
    """Test ``item``'s request; complete its Work and return True if the request is done.

    Returns False, without waiting, while another thread is testing the same request.
    """
    if item.done:
        return True
    if not item.lock.acquire(blocking=False):
        return False
    try:
        if item.done:
            return True
        try:
            complete = item.request.Test(status)
        except Exception as exc:  # mpi4py raises MPI.Exception (a RuntimeError subclass)
            item.work.set_exception(item.describe(exc, status))
            _complete(item)
            return True
        if not complete:
            return False
        try:
            value = item.finish(status)
        except BaseException as exc:  # delivered through the Work, never lost
            item.work.set_exception(exc)
        else:
            item.work.set_result(value)
        # Done only once the Work is: a waiter that sees ``done`` returns the Work's value at
        # once. Marked first, a waiter found it done while this thread (the progress thread)
        # still had to set the result, blocked on the Work, and waited for this thread to get
        # the GIL back: hundreds of microseconds per message on a loaded host.
        _complete(item)
        return True
    finally:
        item.lock.release()


def _complete(item: Pending) -> None:
    item.done = True
    item.buffer = None  # MPI is done with it


class DrivenFuture(Completion):
    """A Future whose ``result()`` first drives its MPI request on the waiting thread.

    Waiting on a point-to-point Work then costs what ``MPI_Wait`` costs, with no hand-off to and
    from the progress thread, for up to :data:`DRIVE_SECONDS`; after that the waiter sleeps and
    the progress thread finishes the request, so a long wait does not burn a core.

    Args:
        new_status: makes an ``MPI.Status`` for the waiting thread.
        spin_tests: tests made back to back before the waiter yields the CPU between tests
            (the backend's: more when every rank has a core of its own, as for collectives).
    """

    def __init__(self, new_status: Callable[[], Any], spin_tests: int = YIELD_AFTER_TESTS,
                 progress: Progress | None = None) -> None:
        super().__init__()
        self.item: Pending | None = None
        self._new_status = new_status
        self._spin_tests = spin_tests
        self._progress = progress

    def result(self, timeout: float | None = None) -> Any:
        """Drive the request for a while, then wait for the result as a Future does."""
        item = self.item
        if item is None or item.done or self.done():
            return super().result(timeout)
        start = time.monotonic()
        limit = DRIVE_SECONDS if timeout is None else min(timeout, DRIVE_SECONDS)
        status = self._new_status()
        tests = 0
        item.driven = True  # the progress thread backs off meanwhile: no fight over the GIL
        spin = self._spin_tests
        progress = self._progress
        if progress is not None:
            progress.driving(1)
        try:
            # test_once is True once the request is done, whoever saw it (item.done): no
            # Future lock per test, and the clock read only while yielding.
            while not test_once(item, status):
                tests += 1
                if tests > spin:
                    os.sched_yield()
                    if time.monotonic() - start > limit:
                        break
        finally:
            item.driven = False
            if progress is not None:
                progress.driving(-1)
        remaining = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
        return super().result(remaining)


class Progress:
    """Complete pending point-to-point requests on one daemon thread (started on first use).

    Args:
        name: thread name suffix (the group name), for debuggers.
        new_status: makes an ``MPI.Status`` (one per thread: a Status is not thread-safe).
    """

    def __init__(self, name: str, new_status: Callable[[], Any]) -> None:
        self._name = name
        self._new_status = new_status
        self._cond = threading.Condition()
        self._incoming: list[Pending] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        #: Whether the thread waits without a timeout (idle for LINGER_S): add() must wake it.
        self._deep_sleep = False
        #: Threads driving a request now (DrivenFuture): while one does, its MPI calls progress
        #: every request, and the thread's tests would only contend for the GIL and MPI's lock.
        self._drivers = 0
        self._drivers_lock = threading.Lock()

    def driving(self, change: int) -> None:
        """Count a waiter that starts (+1) or stops (-1) driving its request."""
        with self._drivers_lock:
            self._drivers += change

    def add(self, item: Pending) -> None:
        """Hand a posted request to the thread.

        Raises:
            BackendError: the backend has been closed.
        """
        with self._cond:
            if self._closed:
                raise BackendError(f"mpi backend of group {self._name!r} has been closed")
            self._incoming.append(item)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name=f"colls-mpi-progress-{self._name}", daemon=True
                )
                self._thread.start()
            elif self._deep_sleep:
                self._cond.notify()
            # Else the thread naps and looks within MAX_SLEEP: waking it for every message
            # made it take the GIL from the caller, who usually drives the request itself.

    def close(self, reason: str) -> list[Pending]:
        """Stop the thread; return the requests still pending (their Works are failed).

        Idempotent. The caller decides what to do with the MPI requests (cancel or leave).
        """
        with self._cond:
            self._closed = True
            thread = self._thread
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(JOIN_TIMEOUT)
        with self._cond:
            left, self._incoming = self._incoming, []
        for item in left:
            item.work.set_exception(BackendError(reason))
        return left

    def _loop(self) -> None:
        status = self._new_status()
        active: list[Pending] = []
        sleep = MIN_SLEEP
        idle_since = time.monotonic()
        while True:
            with self._cond:
                while not active and not self._incoming and not self._closed:
                    if time.monotonic() - idle_since < LINGER_S:
                        self._cond.wait(LINGER_LOOK_S)  # light sleep: add() does not notify
                        continue
                    self._deep_sleep = True
                    try:
                        self._cond.wait()
                    finally:
                        self._deep_sleep = False
                    idle_since = time.monotonic()
                if self._closed:
                    self._incoming[:0] = active  # close() fails them
                    return
                new, self._incoming = self._incoming, []
            if new:
                active.extend(new)
                sleep = MIN_SLEEP
                self._nap(FIRST_LOOK)  # a waiter usually drives it meanwhile, alone in MPI
            if self._drivers:  # a waiter is in MPI: it progresses these too
                self._nap(LINGER_LOOK_S)
                continue
            still = [item for item in active if item.driven or not test_once(item, status)]
            if len(still) < len(active):
                sleep = MIN_SLEEP
            active = still
            if active:
                self._nap(sleep)
                sleep = min(sleep * 2, MAX_SLEEP)
            else:
                idle_since = time.monotonic()

    def _nap(self, seconds: float) -> None:
        """Sleep ``seconds``, waking early when a request is added or the thread must stop."""
        with self._cond:
            if not self._incoming and not self._closed:
                self._cond.wait(seconds)
