"""The work a group has launched on the GPU and not yet seen finish: the watchdog.

Like torch's ProcessGroupNCCL watchdog, one thread per backend watches the completion event of
every launched operation. It

* keeps the operation's arrays referenced until its event has fired, so the memory the GPU reads
  or writes cannot be freed and reused under it;
* completes the operation's :class:`~colls.work.Work`, if it has one (point-to-point), when the
  event fires, on a second thread (``colls-nccl-completion``): completing a Work runs its
  callbacks, and the core's are not always quick (a staged receive copies into the caller's
  non-contiguous array and synchronises a stream that may wait behind the caller's kernels).
  Run inside the poll, they would stop every timeout and asynchronous error from being seen;
* fails the group when an operation outlives the group timeout, or when NCCL reports an
  asynchronous error (a peer that died): ``on_failure`` then aborts the communicator, and every
  pending Work fails with the error.

Events are polled (``cudaEventQuery``): a blocking wait could not be bounded by a timeout.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from colls.errors import BackendError, CollsError, CollsTimeoutError
from colls.work import Work

__all__ = ["InFlight"]

#: cudaEventQuery's results: the event fired, or the work before it has not finished yet.
CUDA_SUCCESS: Final = 0
CUDA_NOT_READY: Final = 600

#: Seconds between two polls of the pending events while any are pending: short against NCCL's
#: latencies on a large message, long enough that the thread costs little CPU.
POLL_S: Final = 0.0005


@dataclass(eq=False)
class _Entry:
    what: str
    event: Any
    keep: tuple[Any, ...]
    work: Work | None
    result: Any
    started: float = field(default_factory=time.monotonic)


class InFlight:
    """Launched operations of one backend, watched until their events fire.

    Args:
        device: the CuPy Device the events belong to (made current on the thread).
        timeout: seconds an operation may stay pending before the group fails.
        check_async: called on every poll; raises the colls error NCCL reported, if any.
        on_failure: called once, from the watchdog thread, with the error that failed the group.
        query: returns an event's cudaEventQuery status (:data:`CUDA_SUCCESS`,
            :data:`CUDA_NOT_READY`, or an error, which fails the group).
    """

    def __init__(
        self,
        device: Any,
        timeout: float,
        check_async: Callable[[], None],
        on_failure: Callable[[CollsError], None],
        query: Callable[[Any], int],
    ) -> None:
        self._device = device
        self._query = query
        self._timeout = timeout
        self._check_async = check_async
        self._on_failure = on_failure
        self._pending: list[_Entry] = []
        #: Entries whose events fired and whose Works the completion thread has not completed.
        self._completing = 0
        self._done: queue.SimpleQueue[_Entry | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._stopped = False
        self._failed: CollsError | None = None
        self._thread = threading.Thread(target=self._run, name="colls-nccl-watchdog", daemon=True)
        self._completer = threading.Thread(target=self._complete, name="colls-nccl-completion",
                                           daemon=True)
        self._thread.start()
        self._completer.start()

    def add(self, what: str, event: Any, keep: tuple[Any, ...], work: Work | None = None,
            result: Any = None) -> None:
        """Watch ``event``; keep ``keep`` alive until it fires, then complete ``work`` (if any)."""
        entry = _Entry(what, event, keep, work, result)
        with self._cond:
            failed = self._failed
            if failed is None:
                self._pending.append(entry)
                self._cond.notify()
        if failed is not None and work is not None:
            work.set_exception(failed)

    def drain(self, timeout: float) -> bool:
        """Wait until every operation has finished and its Work is completed, or ``timeout``
        seconds; return whether it drained (False also when the group failed)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._pending or self._completing) and self._failed is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
            return not self._pending and not self._completing and self._failed is None

    def fail(self, error: CollsError) -> None:
        """Fail every pending Work with ``error`` and stop watching (the group is broken)."""
        with self._cond:
            if self._failed is not None:
                return
            self._failed = error
            entries, self._pending = self._pending, []
            self._cond.notify_all()
        for entry in entries:  # their arrays stay alive here until the abort has run
            if entry.work is not None:
                entry.work.set_exception(error)

    def stop(self) -> None:
        """End the watchdog thread, and the completion thread once it has completed the Works
        of the operations already seen to finish. Idempotent."""
        with self._cond:
            if self._stopped:
                return
            self._stopped = True
            self._cond.notify_all()
        self._done.put(None)
        current = threading.current_thread()
        if self._thread is not current:
            self._thread.join()
        if self._completer is not current:  # a callback stuck on the GPU must not hang close()
            self._completer.join(self._timeout)

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        with self._device:
            while True:
                with self._cond:
                    while not self._pending and not self._stopped:
                        self._cond.wait()
                    if self._stopped:
                        return
                    entries = list(self._pending)
                error = self._poll(entries)
                if error is not None:
                    self.fail(error)
                    self._on_failure(error)
                    return
                time.sleep(POLL_S)

    def _poll(self, entries: list[_Entry]) -> CollsError | None:
        """Retire the entries whose events fired; return an error that fails the group, if any."""
        try:
            self._check_async()
        except CollsError as exc:
            return exc
        now = time.monotonic()
        done = []
        for entry in entries:
            status = self._query(entry.event)
            if status == CUDA_SUCCESS:
                done.append(entry)
            elif status != CUDA_NOT_READY:  # a sticky CUDA error: nothing will complete
                return BackendError(
                    f"nccl: {entry.what} failed on the GPU (CUDA error {status}); the "
                    "communicator is aborted"
                )
            elif now - entry.started > self._timeout:
                return CollsTimeoutError(
                    f"nccl: {entry.what} did not complete within {self._timeout:.1f} s "
                    "(a peer that never joined, died or called a different collective); the "
                    "communicator is aborted"
                )
        if done:
            with self._cond:
                retired = set(map(id, done))
                self._pending = [e for e in self._pending if id(e) not in retired]
                self._completing += len(done)
                self._cond.notify_all()
            for entry in done:  # completed off this thread: see the module docstring
                self._done.put(entry)
        return None

    def _complete(self) -> None:
        """The completion thread: complete each finished operation's Work, in firing order.

        The device is current, as on the watchdog's thread, for callbacks that use CuPy.
        """
        with self._device:
            while (entry := self._done.get()) is not None:
                try:
                    if entry.work is not None:
                        entry.work.set_result(entry.result)  # its callbacks run here
                finally:
                    entry.keep = ()
                    with self._cond:
                        self._completing -= 1
                        self._cond.notify_all()
