"""The serial executor: one job at a time, an inline job never overtakes a queued one.

These run the executor alone, with real threads: a job queued while another thread runs one
inline must wait for it (never run beside it), the group is idle again once the queue drains,
and a destroyed group refuses both paths.
"""

from __future__ import annotations

import threading
import time

import pytest

from colls._executor import SerialExecutor
from colls.work import Work

pytestmark = pytest.mark.timeout(30)


def _wait_for(flag: threading.Event) -> None:
    assert flag.wait(5.0), "the job never started"


def test_a_job_queued_during_an_inline_job_runs_after_it_not_beside_it() -> None:
    executor = SerialExecutor("t")
    events: list[str] = []
    started, finish = threading.Event(), threading.Event()

    def inline_job() -> None:
        events.append("inline start")
        started.set()
        finish.wait(5.0)
        events.append("inline end")

    runner = threading.Thread(target=executor.try_run_inline, args=(inline_job,))
    runner.start()
    _wait_for(started)
    work = Work()
    submitter = threading.Thread(
        target=executor.submit, args=(lambda: events.append("queued"), work))
    submitter.start()
    time.sleep(0.05)  # the submitter waits for the inline job's token meanwhile
    assert events == ["inline start"]
    assert not executor.try_run_inline(lambda: events.append("overtaker"))  # the group is busy
    finish.set()
    runner.join(5.0)
    submitter.join(5.0)
    work.wait(5.0)
    assert events == ["inline start", "inline end", "queued"]


def test_an_inline_call_waits_its_turn_behind_queued_jobs_then_runs_inline_again() -> None:
    executor = SerialExecutor("t")
    release = threading.Event()
    works = [Work(), Work()]
    executor.submit(lambda: release.wait(5.0), works[0])
    executor.submit(lambda: None, works[1])
    assert not executor.try_run_inline(lambda: None)  # two jobs queued or running
    release.set()
    for work in works:
        work.wait(5.0)
    deadline = time.monotonic() + 5.0
    ran: list[int] = []
    while not executor.try_run_inline(ran.append, 1):  # the worker gives the token back
        assert time.monotonic() < deadline, "the group never became idle again"
        time.sleep(0.001)
    assert ran == [1]


def test_a_failing_inline_job_gives_the_token_back() -> None:
    executor = SerialExecutor("t")
    with pytest.raises(ValueError, match="boom"):
        executor.try_run_inline(lambda: (_ for _ in ()).throw(ValueError("boom")))
    assert executor.try_run_inline(lambda: None)


def test_a_destroyed_group_refuses_both_paths() -> None:
    executor = SerialExecutor("gone")
    executor.close()
    with pytest.raises(RuntimeError, match="'gone' has been destroyed"):
        executor.try_run_inline(lambda: None)
    with pytest.raises(RuntimeError, match="'gone' has been destroyed"):
        executor.submit(lambda: None, Work())
    assert executor.claim_inline()  # the refused inline call gave the token back


def test_waiting_until_drained_returns_once_the_queued_jobs_have_run() -> None:
    executor = SerialExecutor("t")
    release, ran = threading.Event(), []
    executor.submit(lambda: (release.wait(5.0), ran.append("first")), Work())
    executor.submit(lambda: ran.append("second"), Work())
    assert executor.wait_until_drained(0.05) is False  # the first job still blocks
    release.set()
    assert executor.wait_until_drained(5.0) is True
    assert ran == ["first", "second"]
    assert executor.wait_until_drained(0.0) is True  # nothing queued: at once
    executor.close()
