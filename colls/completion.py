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

A Completion may also carry one step to run on its result before it finishes (:meth:`then`):
a receive into a strided array copies the staged bytes into it there, in the thread that
completes the message, so the Work the caller holds is the backend's own, with no second future,
done-callback or Condition (about 20 us of a strided receive on the 2-core test machine).

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
#: A Completion's ``_then`` while its step runs: another completion is refused meanwhile.
_RUNNING: Any = object()
#: A Completion's ``_then`` once its step has run (or was dropped by a failure).
_TAKEN: Any = object()


class Completion(concurrent.futures.Future):  # type: ignore[type-arg]
    """A Future whose Condition is made only when something needs to wait on it."""

    def __init__(self) -> None:  # Future.__init__ would make the Condition at once
        self._state = PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._waiters: list[Any] = []
        self._done_callbacks: list[Any] = []
        self._lazy_condition: threading.Condition | None = None
        self._then: Any = None

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

    def then(self, step: Any) -> bool:
        """Make ``step(result)`` the result, computed before the future finishes; return False,
        doing nothing, when it is no longer pending or has a step already.

        ``step`` runs in the thread that completes the future; an exception it raises fails
        the future instead. A failed future does not run it.
        """
        with _MAKING:
            if self._state != PENDING or self._then is not None:
                return False
            self._then = step
            return True

    def set_result(self, result: Any) -> None:
        """Complete with ``result`` (after the :meth:`then` step, if any); wakes waiters only
        where a Condition exists."""
        outcome = self._finish_unwatched(result, None)
        if outcome is True:
            return
        if outcome is False:
            super().set_result(result)  # notifies waiters, or raises InvalidStateError
            return
        try:  # ``outcome`` is the then() step, marked running: it runs outside the lock
            value, error = outcome(result), None
        except BaseException as exc:  # delivered through the future, never lost
            value, error = None, exc
        try:
            if self._finish_unwatched(value, error, stepped=True) is not True:
                if error is None:
                    super().set_result(value)
                else:
                    super().set_exception(error)
        finally:
            self._then = _TAKEN

    def set_exception(self, exception: BaseException | None) -> None:
        """Fail with ``exception`` (a :meth:`then` step does not run); wakes waiters only where
        a Condition exists."""
        if self._finish_unwatched(None, exception) is not True:
            super().set_exception(exception)  # notifies waiters, or raises InvalidStateError

    def _finish_unwatched(self, result: Any, exception: BaseException | None,
                          stepped: bool = False) -> Any:
        """Finish a pending future that has no Condition yet (nobody can be waiting on one).

        Returns True when it did. Returns the :meth:`then` step instead, marked running and
        nothing finished, when a result must go through it first (the caller runs it, then
        calls again with ``stepped``). Returns False, having done nothing, when a Condition
        exists or the future is not pending: then Future's own method runs.

        Raises:
            concurrent.futures.InvalidStateError: another thread is completing the future (its
                step runs), as a Future raises for one completed already.
        """
        with _MAKING:
            step = self._then
            if step is _RUNNING and not stepped:
                # (no repr here: a Future's repr takes its Condition, made under this lock)
                raise concurrent.futures.InvalidStateError("another thread is completing it")
            if step is not None and step is not _RUNNING and step is not _TAKEN \
                    and self._state == PENDING:
                if exception is None:
                    self._then = _RUNNING
                    return step
                self._then = _TAKEN  # a failure: the step does not run
            if self._lazy_condition is not None or self._state != PENDING:
                return False
            self._result, self._exception = result, exception
            self._state = FINISHED
            return True


__all__ = ["Completion"]
