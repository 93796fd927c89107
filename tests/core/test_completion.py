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


def test_a_then_step_makes_the_result_before_the_future_is_done() -> None:
    future = Completion()
    seen_done: list[bool] = []

    def step(value: int) -> int:
        seen_done.append(future.done())
        return value * 10

    assert future.then(step)
    future.set_result(4)
    assert future.result(timeout=0) == 40
    assert seen_done == [False]  # nobody could see the result before the step had made it
    assert future._lazy_condition is None


def test_a_then_step_that_raises_fails_the_future_and_a_failure_skips_the_step() -> None:
    raising = Completion()
    assert raising.then(lambda value: 1 / 0)
    raising.set_result(1)
    assert isinstance(raising.exception(timeout=0), ZeroDivisionError)

    failed, ran = Completion(), []
    assert failed.then(ran.append)
    error = ValueError("the receive failed")
    failed.set_exception(error)
    assert failed.exception(timeout=0) is error and ran == []


def test_then_is_refused_once_finished_or_once_a_step_is_set() -> None:
    finished = Completion.finished(3)
    assert not finished.then(lambda value: value + 1)
    assert finished.result() == 3
    pending = Completion()
    assert pending.then(lambda value: value + 1)
    assert not pending.then(lambda value: value * 100)  # one step: the second is not run
    pending.set_result(1)
    assert pending.result() == 2


def test_a_then_step_runs_before_a_blocked_waiter_and_callbacks_see_the_result() -> None:
    future = Completion()
    got: list[int] = []
    called: list[int] = []
    future.add_done_callback(lambda f: called.append(f.result()))
    waiter = threading.Thread(target=lambda: got.append(future.result(timeout=10)))
    waiter.start()
    while future._lazy_condition is None:  # the waiter blocks on the Condition
        threading.Event().wait(0.001)
    assert future.then(lambda value: value + 100)
    future.set_result(5)
    waiter.join(10)
    assert got == [105] and called == [105]


def test_a_completion_while_the_then_step_runs_is_refused_and_the_step_wins() -> None:
    future = Completion()
    running, release = threading.Event(), threading.Event()

    def step(value: int) -> int:
        running.set()
        release.wait(10)
        return value + 1

    assert future.then(step)
    completer = threading.Thread(target=future.set_result, args=(1,))
    completer.start()
    assert running.wait(10)
    for late in (lambda: future.set_result(7), lambda: future.set_exception(ValueError())):
        with pytest.raises(concurrent.futures.InvalidStateError):
            late()  # the first completion is under way: as for a future already completed
    assert not future.done()
    release.set()
    completer.join(10)
    assert future.result(timeout=0) == 2


def test_a_then_step_set_while_another_thread_completes_is_run_or_refused_never_lost() -> None:
    for attempt in range(2000):
        future = Completion()
        completer = threading.Thread(target=future.set_result, args=(attempt,))
        completer.start()
        taken = future.then(lambda value: -value - 1)
        completer.join(10)
        assert future.result(timeout=10) == (-attempt - 1 if taken else attempt)


def test_then_steps_a_pending_works_own_future_and_chains_anything_else() -> None:
    from colls.work import chain, then

    pending = Work()
    stepped = then(pending, lambda value: value + 1)
    assert stepped is pending  # no second Work, future or callback
    completer = threading.Thread(target=pending.set_result, args=(1,))
    completer.start()
    assert stepped.result() == 2
    completer.join(10)

    plain = Work(concurrent.futures.Future())  # not a Completion: a done-callback chains it
    stepped = then(plain, lambda value: value + 1)
    assert stepped is not plain
    plain.set_result(1)
    assert stepped.result() == 2

    inner = Work()  # chain's step runs once the inner Work is done, and may rely on it
    seen: list[bool] = []
    chained = chain(inner, lambda value: seen.append(inner.is_completed()) or value)
    assert chained is not inner
    inner.set_result(3)
    assert chained.result() == 3 and seen == [True]
