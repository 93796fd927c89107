"""How a waiter and the progress thread share a point-to-point request (colls_plugins.mpi.progress).

MPI forbids two threads testing one request at once, and a waiter that drives its own request
must not fight the progress thread for it. These tests drive :class:`Pending` with a stand-in
request whose ``Test`` records the thread that calls it, so no MPI is needed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from colls.errors import BackendError
from colls_plugins.mpi.progress import DRIVE_SECONDS, Pending, Progress

pytestmark = [pytest.mark.no_mpi_needed, pytest.mark.timeout(60)]


class Request:
    """A stand-in for an MPI request: completes at its ``complete_after``-th test (never when
    None), raises ``error`` when set, and records the threads that test it."""

    def __init__(self, complete_after: int | None, error: Exception | None = None) -> None:
        self.complete_after = complete_after
        self.error = error
        self.testers: list[threading.Thread] = []

    def Test(self, status: Any = None) -> bool:  # noqa: N802 - mpi4py's name
        self.testers.append(threading.current_thread())
        if self.error is not None:
            raise self.error
        return self.complete_after is not None and len(self.testers) >= self.complete_after


class Owner:
    """What a Pending asks of its backend: a Progress, the value and errors of a message."""

    def __init__(self, spin_tests: int = 5) -> None:
        self.progress = Progress("test", spin_tests)

    def finish(self, item: Pending, status: Any) -> Any:
        return f"{item.kind} done"

    def describe(self, item: Pending, exc: Exception, status: Any) -> BaseException:
        return BackendError(f"{item.kind} failed: {exc}")

    def describe_message(self, item: Pending) -> str:
        return f"{item.kind} from rank {item.peer}"


def _pending(request: Request, owner: Owner | None = None) -> Pending:
    return Pending(owner or Owner(), request, np.zeros(8, np.uint8), "irecv", 1, 0)


def test_a_waiter_drives_its_request_and_gets_the_value() -> None:
    request = Request(complete_after=50)
    item = _pending(request)
    assert item.result(timeout=10) == "irecv done"
    assert len(request.testers) == 50
    assert item.settled and item.buffer is None  # MPI is done with the buffer


def test_the_progress_thread_does_not_test_a_request_its_waiter_drives() -> None:
    """While a waiter drives, another thread's test() leaves the request alone (MPI forbids
    concurrent tests of one request) and reports it not done."""
    request = Request(complete_after=200_000)  # tens of GIL switch intervals
    item = _pending(request, Owner(spin_tests=1_000_000))  # the waiter never yields
    other_results: list[bool] = []

    def other_thread() -> None:
        while not item.driven:  # the waiter has taken the request
            time.sleep(0)
        while not item.settled:
            other_results.append(item.test())

    waiter = threading.current_thread()
    thread = threading.Thread(target=other_thread)
    thread.start()
    assert item.result(timeout=10) == "irecv done"
    thread.join(10)
    # It looked, and was turned away (its last look may come after the waiter settled it).
    assert other_results and not any(other_results[:-1])
    assert all(tester is waiter for tester in request.testers)


def test_a_second_waiter_gets_the_value_the_first_drove() -> None:
    request = Request(complete_after=200_000)
    item = _pending(request, Owner(spin_tests=1_000_000))
    values: list[Any] = []
    threads = [threading.Thread(target=lambda: values.append(item.result(timeout=30)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert values == ["irecv done", "irecv done"]
    assert len(request.testers) == 200_000  # one thread tested at a time, none after the end


def test_a_close_stops_the_waiter_driving_at_once() -> None:
    """A waiter whose request never completes stops driving when the Work is failed (a close),
    not after DRIVE_SECONDS, and raises the failure."""
    item = _pending(Request(complete_after=None))
    timer = threading.Timer(0.05, item.fail, args=(BackendError("the group was closed"),))
    timer.start()
    start = time.monotonic()
    with pytest.raises(BackendError, match="the group was closed"):
        item.result(timeout=30)
    assert time.monotonic() - start < DRIVE_SECONDS / 2
    timer.join()


def test_an_mpi_error_while_driving_fails_the_work_with_the_backends_description() -> None:
    item = _pending(Request(complete_after=None, error=RuntimeError("MPI_ERR_TRUNCATE")))
    with pytest.raises(BackendError, match="irecv failed: MPI_ERR_TRUNCATE"):
        item.result(timeout=10)
    assert item.settled


def test_a_timed_wait_while_another_thread_drives_returns_within_its_timeout() -> None:
    request = Request(complete_after=None)
    item = _pending(request, Owner(spin_tests=1_000_000))
    driver = threading.Thread(target=item.drive, args=(0.3,))
    driver.start()
    while not item.driven:
        time.sleep(0.001)
    start = time.monotonic()
    assert item.drive(0.05) == 0.0  # could not take the request: no time left to wait
    assert time.monotonic() - start < 0.25
    driver.join(10)


def test_a_request_its_waiter_settles_leaves_the_threads_set() -> None:
    """The thread holds only requests still in flight: one settled by its waiter is dropped at
    once, not at the thread's next look."""
    owner = Owner()
    item = _pending(Request(complete_after=20), owner)
    owner.progress.add(item)
    assert item in owner.progress._live
    assert item.result(timeout=10) == "irecv done"
    assert item not in owner.progress._live
    assert owner.progress.close("done") == []


def test_the_thread_completes_a_request_nobody_waits_on() -> None:
    owner = Owner()
    request = Request(complete_after=3)
    item = _pending(request, owner)
    owner.progress.add(item)
    deadline = time.monotonic() + 10
    while not item.done() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert item.done() and item.result(timeout=0) == "irecv done"
    assert {tester.name for tester in request.testers} == {"colls-mpi-progress-test"}
    assert not owner.progress._live
    owner.progress.close("done")


def test_a_close_fails_the_requests_in_flight_and_refuses_new_ones() -> None:
    owner = Owner()
    item = _pending(Request(complete_after=None), owner)
    owner.progress.add(item)
    assert owner.progress.close("the group was closed") == [item]
    with pytest.raises(BackendError, match="the group was closed"):
        item.result(timeout=5)
    with pytest.raises(BackendError,
                       match="irecv from rank 1: the mpi backend of group .test. has been closed"):
        owner.progress.add(_pending(Request(complete_after=None), owner))
