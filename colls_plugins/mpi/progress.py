"""The thread that completes a backend's point-to-point Works without the caller polling.

MPI completes a nonblocking request only when someone calls into MPI (MPICH has no progress
thread of its own by default), and a colls :class:`~colls.work.Work` must complete while its
owner waits on it, computes, or forgets it. So each backend has one :class:`Progress` thread:
``isend``/``irecv`` post the MPI request on the caller's thread (nonblocking), test it once
(small messages are often done at once, and then no thread is involved at all), and hand the
rest to this thread, which ``Test``\\ s its pending requests and completes their Works. A request
completed by its waiter leaves the thread's set at once: the thread never holds finished
messages (holding the thousands a ping-pong makes between two of its looks, with their buffers,
cost about 2 us per message in garbage collection and cache misses).

Latency and CPU: a thread that waits on a Work tests its request itself for a while (like
``MPI_Wait``, see :meth:`Pending.drive`), so a waited-on message is seen at once, and the
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

import concurrent.futures
import contextlib
import os
import threading
import time
from typing import Any, Final

from colls.completion import Completion
from colls.errors import BackendError

#: Seconds the thread leaves a new request alone. A thread that waits on the Work drives it
#: itself (:meth:`Pending.drive`); a second thread testing at the same time would only contend
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


class Pending(Completion):
    """One posted isend or irecv, and the future its Work holds.

    Everything a message needs lives in this one object: the MPI request, the buffer (kept
    alive until MPI is done with it), what the message is (``kind``, ``peer``, ``tag``,
    ``nbytes``: the text of its errors is made from them only when one is raised) and its
    ``owner``, the backend: ``owner.progress`` (the :class:`Progress`),
    ``owner.finish(item, status)`` (the value of a completed request: None for a send, the
    sender's group rank for a receive), ``owner.describe(item, exc, status)`` (the exception
    for an MPI error) and ``owner.describe_message(item)`` (the Work's description). A message
    made a request, a future, a Work, a dataclass, a partial and a closure before, and
    formatted its description at once: about 6 us per isend or irecv, as much as MPI's whole
    round trip.

    ``lock`` makes one thread at a time test the request (MPI forbids concurrent tests of one
    request), and that thread fills ``status``, the message's ``MPI.Status`` (None for a send,
    which needs none); ``settled`` records that the request completed and the future is
    settled (a completed request becomes MPI_REQUEST_NULL, which tests as complete with an
    empty status); ``driven`` is True while a waiting thread tests the request itself.
    """

    def __init__(self, owner: Any, request: Any, buffer: Any, kind: str, peer: int | None,
                 tag: int, status: Any = None) -> None:
        super().__init__()
        self.owner = owner
        self.status = status
        self.request = request
        self.buffer = buffer
        self.kind = kind
        self.peer = peer
        self.tag = tag
        self.nbytes = buffer.nbytes
        self.lock = threading.Lock()
        self.settled = False
        self.driven = False

    def __str__(self) -> str:
        """The Work's description: made only when an error or a repr shows it."""
        return self.owner.describe_message(self)

    def result(self, timeout: float | None = None) -> Any:
        """Drive the request for a while, then wait for the result as a Future does."""
        if not (self.settled or self.done()):
            timeout = self.drive(timeout)
        return super().result(timeout)

    def drive(self, timeout: float | None) -> float | None:
        """Test the request on the waiting thread until it completes, as ``MPI_Wait`` does,
        for at most :data:`DRIVE_SECONDS` (or ``timeout``); return the time left of
        ``timeout``.

        No hand-off to and from the progress thread; after DRIVE_SECONDS the waiter sleeps
        and the progress thread finishes the request, so a long wait does not burn a core.
        The waiter holds the request's lock while it tests: the progress thread, which only
        tries the lock, leaves the request alone meanwhile, and each test is MPI's call alone.
        """
        start = time.monotonic()
        # Tried first without a timeout: a timed acquire costs four times as much.
        if not (self.lock.acquire(blocking=False)
                or self.lock.acquire(timeout=-1 if timeout is None else timeout)):
            return 0.0  # another waiter drives it; the future's wait takes over
        limit = DRIVE_SECONDS if timeout is None else min(timeout, DRIVE_SECONDS)
        status = self.status
        spin = self.owner.progress.spin_tests
        test = self.request.Test
        tests = 0
        self.driven = True  # the progress thread backs off meanwhile: no fight over the GIL
        try:
            while not self.settled:
                try:
                    if test(status):
                        self._settle(status, None)
                        break
                except Exception as exc:  # mpi4py raises MPI.Exception (a RuntimeError subclass)
                    self._settle(status, exc)
                    break
                tests += 1
                if tests > spin:
                    os.sched_yield()
                    if self.done() or time.monotonic() - start > limit:
                        break  # failed by a close, or long enough: the future's wait takes over
        finally:
            self.driven = False
            self.lock.release()
        return None if timeout is None else max(0.0, timeout - (time.monotonic() - start))

    def test(self) -> bool:
        """Test the request once; settle the future and return True if it is done.

        Returns False, without waiting, while another thread is testing the same request.
        """
        if self.settled:
            return True
        if not self.lock.acquire(blocking=False):
            return False
        try:
            if self.settled:
                return True
            status = self.status
            try:
                if not self.request.Test(status):
                    return False
            except Exception as exc:  # mpi4py raises MPI.Exception (a RuntimeError subclass)
                self._settle(status, exc)
            else:
                self._settle(status, None)
            return True
        finally:
            self.lock.release()

    def _settle(self, status: Any, error: Exception | None) -> None:
        """Complete the future of the request that just completed (or failed with MPI's
        ``error``); the caller holds :attr:`lock`."""
        if error is not None:
            self.fail(self.owner.describe(self, error, status))
        else:
            try:
                value = self.owner.finish(self, status)
            except BaseException as exc:  # delivered through the Work, never lost
                self.fail(exc)
            else:
                try:
                    self.set_result(value)
                except concurrent.futures.InvalidStateError:
                    pass  # a close failed it first
        # Settled only once the future is: a waiter that sees ``settled`` returns the value at
        # once. Marked first, a waiter found it settled while the progress thread still had to
        # set the result, blocked on the future, and waited for that thread to get the GIL
        # back: hundreds of microseconds per message on a loaded host.
        self.settled = True
        self.buffer = None  # MPI is done with it
        self.owner.progress.forget(self)

    def fail(self, error: BaseException) -> None:
        """Fail the future with ``error`` unless it is complete already (the first outcome
        wins: a close may race the thread that saw the request end)."""
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self.set_exception(error)

    def cancel_request(self) -> None:
        """Cancel the request unless it completed (a close); MPI may still own the buffer."""
        with self.lock:  # a waiting thread may be testing it
            if self.settled:
                return
            with contextlib.suppress(Exception):  # a send: cancelling is deprecated in MPI 4
                self.request.Cancel()


class Progress:
    """Complete pending point-to-point requests on one daemon thread (started on first use).

    The requests live in a dict used as an ordered set: :meth:`add` puts one in and
    :meth:`forget` (called when a request settles, by whichever thread tested it) takes it out,
    each a single dict operation under the GIL, without a lock. The thread tests a snapshot of
    the set. Only waking the thread from its deep sleep, starting it and closing take
    :attr:`_cond`.

    Args:
        name: thread name suffix (the group name), for debuggers.
        spin_tests: tests a waiter makes back to back before it yields the CPU between tests
            (the backend's: more when every rank has a core of its own, as for collectives).
    """

    def __init__(self, name: str, spin_tests: int = YIELD_AFTER_TESTS) -> None:
        self._name = name
        self.spin_tests = spin_tests
        self._cond = threading.Condition()
        self._live: dict[Pending, None] = {}
        #: Set by add(): a request came since the thread last looked (it naps FIRST_LOOK first).
        self._fresh = False
        self._thread: threading.Thread | None = None
        self._closed = False
        #: Whether the thread waits without a timeout (idle for LINGER_S): add() must wake it.
        #: Set before the thread's last look at the set, so an add() that the look missed sees
        #: it and wakes the thread.
        self._deep_sleep = False

    def add(self, item: Pending) -> None:
        """Hand a posted request to the thread.

        Raises:
            BackendError: the backend has been closed.
        """
        if self._closed:
            raise self._closed_error(item)
        self._live[item] = None
        self._fresh = True
        if self._thread is None or self._deep_sleep:
            self._wake()
        # Else the thread naps and looks within MAX_SLEEP: waking it for every message
        # made it take the GIL from the caller, who usually drives the request itself.
        if self._closed:  # closed meanwhile, maybe after close() failed the requests it had
            item.fail(self._closed_error(item))

    def _closed_error(self, item: Pending) -> BackendError:
        """The error of a request handed over after a close, naming the message ("mpi irecv
        from rank 1 with tag 0 on group 'g' (rank 0 of 2)")."""
        return BackendError(f"{item}: the mpi backend of group {self._name!r} has been closed")

    def forget(self, item: Pending) -> None:
        """Drop a settled request from the thread's set."""
        self._live.pop(item, None)

    def _wake(self) -> None:
        """Start the thread, or wake it from its deep sleep."""
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name=f"colls-mpi-progress-{self._name}", daemon=True
                )
                self._thread.start()
            else:
                self._cond.notify()

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
        left = [item for item in list(self._live) if not item.settled]
        self._live.clear()
        for item in left:
            item.fail(BackendError(reason))
        return left

    def _loop(self) -> None:
        live = self._live
        sleep = MIN_SLEEP
        idle_since = time.monotonic()
        while True:
            with self._cond:
                while not live and not self._closed:
                    if time.monotonic() - idle_since < LINGER_S:
                        self._cond.wait(LINGER_LOOK_S)  # light sleep: add() does not notify
                        continue
                    self._deep_sleep = True
                    try:
                        if not live and not self._closed:
                            self._cond.wait()
                    finally:
                        self._deep_sleep = False
                    idle_since = time.monotonic()
                if self._closed:
                    return  # close() fails what is left
            if self._fresh:
                self._fresh = False
                sleep = MIN_SLEEP
                self._nap(FIRST_LOOK)  # a waiter usually drives it meanwhile, alone in MPI
            items = list(live)
            if any(item.driven for item in items):  # a waiter is in MPI: it progresses these
                self._nap(LINGER_LOOK_S)
                continue
            if any([item.test() for item in items]):  # (a list: test them all)
                sleep = MIN_SLEEP
            if live:
                self._nap(sleep)
                sleep = min(sleep * 2, MAX_SLEEP)
            else:
                idle_since = time.monotonic()

    def _nap(self, seconds: float) -> None:
        """Sleep ``seconds``, waking early only when the thread must stop.

        Requests added meanwhile wait for the nap to end (their waiters drive them). The nap
        used to be skipped whenever one had been added: a program posting messages back to
        back then kept this thread testing without a pause, taking the GIL and MPI's lock from
        the caller (isend/irecv + wait, 2 ranks: 43 -> 29 us per exchange).
        """
        with self._cond:
            if not self._closed:
                self._cond.wait(seconds)
