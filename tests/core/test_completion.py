"""colls.completion.Completion behaves as a concurrent.futures.Future, lock made lazily or not."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from colls.completion import Completion
from colls.work import Work


def test_a_result_set_before_anyone_waits_is_returned_without_a_condition() -> None:
    future = Completion()
    future.set_result(42)
    assert future.done() and not future.cancelled()
    assert future.result(timeout=0) == 42
    assert future.exception(timeout=0) is None
    assert future._lazy_condition is None  # nothing had to block


def test_an_exception_set_before_anyone_waits_is_raised() -> None:
    future = Completion()
    error = ValueError("rank 1 went away")
    future.set_exception(error)
    assert future.exception(timeout=0) is error
    with pytest.raises(ValueError, match="rank 1 went away"):
        future.result(timeout=0)


@pytest.mark.parametrize("outcome", ["result", "exception"])
def test_a_thread_blocked_in_result_is_woken_by_the_completion(outcome: str) -> None:
    future = Completion()
    got: list[object] = []

    def wait() -> None:
        try:
            got.append(future.result(timeout=10))
        except ValueError as exc:
            got.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    while future._lazy_condition is None:  # the waiter made the Condition and blocks on it
        threading.Event().wait(0.001)
    error = ValueError("late")
    future.set_result(7) if outcome == "result" else future.set_exception(error)
    waiter.join(10)
    assert not waiter.is_alive()
    assert got == ([7] if outcome == "result" else [error])


def test_result_times_out_as_a_future_does() -> None:
    with pytest.raises(concurrent.futures.TimeoutError):
        Completion().result(timeout=0.01)


def test_completing_twice_or_after_cancel_raises_invalid_state() -> None:
    future = Completion()
    future.set_result(1)
    with pytest.raises(concurrent.futures.InvalidStateError):
        future.set_result(2)
    with pytest.raises(concurrent.futures.InvalidStateError):
        future.set_exception(ValueError())
    assert future.result() == 1
    cancelled = Completion()
    assert cancelled.cancel() and cancelled.cancelled()
    with pytest.raises(concurrent.futures.InvalidStateError):
        cancelled.set_result(1)


def test_callbacks_wait_and_as_completed_work() -> None:
    future = Completion()
    seen: list[int] = []
    future.add_done_callback(lambda f: seen.append(f.result()))
    assert concurrent.futures.wait([future], timeout=0.01).not_done == {future}
    threading.Timer(0.02, future.set_result, args=(5,)).start()
    assert list(concurrent.futures.as_completed([future], timeout=10)) == [future]
    assert seen == [5]
    done_early = Completion()
    done_early.set_result(6)
    done_early.add_done_callback(lambda f: seen.append(f.result()))
    assert seen == [5, 6]


def test_many_racing_completions_and_waiters_all_finish() -> None:
    """Setter and waiter race on every future: none may be lost (a lost wake-up would hang)."""
    futures = [Completion() for _ in range(2000)]
    results: list[object] = [None] * len(futures)

    def wait_all() -> None:
        for i, future in enumerate(futures):
            results[i] = future.result(timeout=10)

    def set_all() -> None:
        for i, future in enumerate(futures):
            future.set_result(i)

    threads = [threading.Thread(target=wait_all), threading.Thread(target=set_all)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    assert results == list(range(len(futures)))


def test_work_defaults_to_a_completion_and_get_future_is_a_future() -> None:
    work = Work(description="op")
    assert isinstance(work.get_future(), concurrent.futures.Future)
    work.set_result(3)
    assert work.wait() and work.result() == 3 and work.is_success()
