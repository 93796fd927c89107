"""Completion: a :class:`concurrent.futures.Future` that makes its lock only when a thread blocks.

Every Work holds a future, and a latency-bound program (a solver's halo exchange, a send/recv
ping-pong) makes and completes one per message. A plain Future builds a
:class:`threading.Condition` when it is made and takes it in ``done()``, ``set_result()`` and
``result()``: about 4 us per message on the 2-core test machine, as much as the shared-memory
transport itself. Most of these futures are completed before anyone waits on them, or waited on
by a thread that polls ``done()``, so the Condition is rarely needed.

A Completion makes its Condition on first use (a thread that blocks, a done-callback,
:func:`concurrent.futures.wait`) and until then completes under one module-wide lock:

* ``set_result``/``set_exception`` take :data:`_MAKING` and, if no Condition exists yet, set the
  state directly. Making the Condition takes :data:`_MAKING` too, so either the completion comes
  first (a thread that then blocks finds the state final) or the Condition does (and the
  completion notifies it as a plain Future would). Nothing can wait on a Condition that a
  completion did not see.
* ``done()``, ``cancelled()`` and the finished case of ``result()``/``exception()`` read the
  state without a lock: it only ever moves to a final value, once.

Everything else is :class:`concurrent.futures.Future`'s own code, so ``wait``/``as_completed``,
callbacks and cancellation behave as they document.
"""

from __future__ import annotations

import concurrent.futures
import threading
from concurrent.futures._base import (  # the states Future's own methods test
    CANCELLED,
    CANCELLED_AND_NOTIFIED,
    FINISHED,
    PENDING,
)
from typing import Any

#: Guards the making of every Completion's Condition, and completions made without one.
_MAKING = threading.Lock()
_FINAL = (FINISHED, CANCELLED, CANCELLED_AND_NOTIFIED)


class Completion(concurrent.futures.Future):  # type: ignore[type-arg]
    """A Future whose Condition is made only when something needs to wait on it."""

    def __init__(self) -> None:  # Future.__init__ would make the Condition at once
        self._state = PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._waiters: list[Any] = []
        self._done_callbacks: list[Any] = []
        self._lazy_condition: threading.Condition | None = None

    @classmethod
    def finished(cls, result: Any) -> Completion:
        """Return a Completion that has already succeeded with ``result`` (nobody can be
        waiting on it yet, so no lock is taken)."""
        future = cls()
        future._result = result
        future._state = FINISHED
        return future

    @property  # type: ignore[override]
    def _condition(self) -> threading.Condition:
        condition = self._lazy_condition
        if condition is None:
            with _MAKING:
                condition = self._lazy_condition
                if condition is None:
                    condition = self._lazy_condition = threading.Condition()
        return condition

    def done(self) -> bool:
        """Return True once the future has a result, an exception or was cancelled."""
        return self._state in _FINAL

    def cancelled(self) -> bool:
        """Return True if the future was cancelled."""
        return self._state in (CANCELLED, CANCELLED_AND_NOTIFIED)

    def result(self, timeout: float | None = None) -> Any:
        """Return the result, waiting up to ``timeout`` seconds (a Future's semantics)."""
        if self._state == FINISHED:
            if self._exception is not None:
                return super().result(timeout)  # raises it, as a Future does
            return self._result
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Return the exception, waiting up to ``timeout`` seconds (a Future's semantics)."""
        if self._state == FINISHED:
            return self._exception
        return super().exception(timeout)

    def set_result(self, result: Any) -> None:
        """Complete with ``result``; wakes waiters only where a Condition exists."""
        if not self._finish_unwatched(result, None):
            super().set_result(result)  # notifies waiters, or raises InvalidStateError

    def set_exception(self, exception: BaseException | None) -> None:
        """Fail with ``exception``; wakes waiters only where a Condition exists."""
        if not self._finish_unwatched(None, exception):
            super().set_exception(exception)  # notifies waiters, or raises InvalidStateError

    def _finish_unwatched(self, result: Any, exception: BaseException | None) -> bool:
        """Finish a pending future that has no Condition yet (nobody can be waiting on one).

        Returns False, having done nothing, when a Condition exists or the future is not
        pending: then Future's own method runs.
        """
        with _MAKING:
            if self._lazy_condition is not None or self._state != PENDING:
                return False
            self._result, self._exception = result, exception
            self._state = FINISHED
            return True


__all__ = ["Completion"]
