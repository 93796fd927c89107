"""The serial executor that runs one group's collectives in call order.

Every rank issues a group's collectives in the same order, and the backend contract says
collectives run one at a time in that order. A synchronous call with nothing queued runs inline
on the caller's thread (no thread hand-off on the latency path); anything else is queued to the
group's daemon thread, which is what makes ``async_op=True`` progress while the caller computes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from colls.work import Work

_STOP = object()


class SerialExecutor:
    """Run submitted jobs one at a time, in submission order."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._running = threading.Lock()  # held by whoever executes a job
        self._state = threading.Lock()  # guards _pending and _thread
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    def try_run_inline(self, job: Callable[..., Any], *args: Any) -> bool:
        """Run ``job(*args)`` on this thread if nothing is queued; return False (not run) otherwise.

        The synchronous fast path: no Work or Future is made, and the job's exception
        propagates to the caller unchanged. One non-blocking lock acquisition decides: holding
        ``_running`` with nothing pending, no earlier job can be waiting or running, and a job
        submitted meanwhile waits for ``_running`` in the worker thread, so order holds.
        """
        if not self._running.acquire(False):  # positional: a keyword costs more per call
            return False
        try:
            if self._pending:  # queued jobs come first (the worker has not taken them yet)
                return False
            if self._closed:
                self._check_open()
            job(*args)
        finally:
            self._running.release()
        return True

    def submit(self, job: Callable[[], Any], work: Work) -> None:
        """Queue ``job`` to run after everything submitted before it; ``work`` gets its result."""
        with self._state:
            self._check_open()
            self._pending += 1
        self._enqueue(job, work)

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
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            job, work = item
            with self._running:
                _execute(job, work)
            with self._state:
                self._pending -= 1


def _execute(job: Callable[[], Any], work: Work) -> None:
    try:
        value = job()
    except BaseException as exc:  # delivered to whoever waits on the Work
        work.set_exception(exc)
    else:
        work.set_result(value)
