"""The serial executor that runs one group's collectives in call order.

Every rank issues a group's collectives in the same order, and the backend contract says
collectives run one at a time in that order. A synchronous call with nothing queued runs inline
on the caller's thread (no thread hand-off on the latency path); anything else is queued to the
group's daemon thread, which is what makes ``async_op=True`` progress while the caller computes.

Who may run a job is decided by one token, present while the group is idle (no job runs or
waits). An inline call takes it, runs its job and puts it back; the first job queued takes it
for the queue (waiting for an inline job in progress), and the worker puts it back when the
queue is empty. So an inline call never overtakes a queued job, and no two jobs ever run at
once. The token is a key of a dict: ``dict.pop`` takes it atomically (under the GIL, and under
free-threaded CPython's per-object locks, a build colls is not tested on), through a bound C
call that costs the latency path no frame; a ``threading.Lock`` cost more per call than the
whole rest of the fast path's checks.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from colls.work import Work

_STOP = object()
_TOKEN: Final = "idle"
#: Marks the executors' worker threads (:func:`on_worker_thread`).
_WORKER = threading.local()
#: First and longest pause of a submitter waiting for an inline job to give the token back
#: (seconds). Only a job queued from one thread while another runs one inline waits at all.
_TOKEN_WAIT_FIRST_S: Final = 20e-6
_TOKEN_WAIT_MAX_S: Final = 1e-3


class SerialExecutor:
    """Run submitted jobs one at a time, in submission order."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._idle = {_TOKEN: True}
        #: ``claim_inline()``: take the token if the group is idle (True), else None. The caller
        #: then runs one job on its own thread and calls ``release_inline()`` (in a ``finally``).
        self.claim_inline: Callable[[], bool | None] = functools.partial(
            self._idle.pop, _TOKEN, None)
        #: ``release_inline()``: put the token back.
        self.release_inline: Callable[[], None] = functools.partial(
            self._idle.__setitem__, _TOKEN, True)
        self._state = threading.Lock()  # guards _pending, _thread and the queue's token
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    def try_run_inline(self, job: Callable[..., Any], *args: Any) -> bool:
        """Run ``job(*args)`` on this thread if the group is idle; return False (not run) otherwise.

        The synchronous path: no Work or Future is made, and the job's exception propagates to
        the caller unchanged.

        Raises:
            RuntimeError: the group has been destroyed.
        """
        if not self.claim_inline():
            return False
        try:
            self._check_open()
            job(*args)
        finally:
            self.release_inline()
        return True

    def submit(self, job: Callable[[], Any], work: Work) -> None:
        """Queue ``job`` to run after everything submitted before it; ``work`` gets its result."""
        with self._state:
            self._check_open()
            self._pending += 1
            if self._pending == 1:
                self._take_for_queue()
        self._enqueue(job, work)

    def wait_until_drained(self, timeout: float) -> bool:
        """Wait until every job submitted so far has run, or ``timeout`` seconds.

        Returns whether it drained. Jobs that later calls submit meanwhile are waited for too.
        """
        deadline = time.monotonic() + timeout
        pause = _TOKEN_WAIT_FIRST_S
        while self._pending:
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, _TOKEN_WAIT_MAX_S)
        return True

    def _take_for_queue(self) -> None:
        """Take the token for the queue, waiting while an inline job holds it (``_state`` held)."""
        pause = _TOKEN_WAIT_FIRST_S
        while not self.claim_inline():
            time.sleep(pause)
            pause = min(pause * 2, _TOKEN_WAIT_MAX_S)

    def close(self) -> None:
        """Stop the worker thread after the queued jobs (does not wait for it)."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            if self._thread is not None:
                self._queue.put(_STOP)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"process group {self._name!r} has been destroyed")

    def _enqueue(self, job: Callable[[], Any], work: Work) -> None:
        with self._state:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name=f"colls-group-{self._name}", daemon=True
                )
                self._thread.start()
        self._queue.put((job, work))

    def _loop(self) -> None:
        _WORKER.active = True
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            job, work = item
            _execute(job, work)
            with self._state:
                self._pending -= 1
                if self._pending == 0:
                    self.release_inline()  # the queue is empty: the group is idle again


def on_worker_thread() -> bool:
    """Return whether this thread is a group's worker thread, running queued (async) jobs.

    A backend waiting for its peers there should not spin or yield the CPU in a loop: the
    caller that queued the job is computing meanwhile (DDP's backward pass, say), and on a host
    with no core to spare a spinning waiter takes cycles from it. An inline (synchronous) call
    runs on the caller's own thread, which has nothing else to do.
    """
    return getattr(_WORKER, "active", False)


def _execute(job: Callable[[], Any], work: Work) -> None:
    try:
        value = job()
    except BaseException as exc:  # delivered to whoever waits on the Work
        work.set_exception(exc)
    else:
        work.set_result(value)
