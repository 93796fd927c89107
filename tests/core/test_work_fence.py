"""Work and the stream fence of an asynchronous call on CUDA arrays (colls.streams).

The fence's CUDA side runs only on a GPU (tests/gpu); here a recording fence checks what Work
does with one: completion waits for the device work, and wait()/result() order the waiting
thread's stream after it, once the operation has succeeded.
"""

from __future__ import annotations

import pytest

from colls.work import Work, all_done, chain


class RecordingFence:
    """A fence whose device work finishes when the test says so."""

    def __init__(self) -> None:
        self.finished = False
        self.orders = 0

    def query(self) -> bool:
        return self.finished

    def order_current_stream(self) -> None:
        self.orders += 1


def test_completed_once_the_device_work_is_done():
    work, fence = Work(), RecordingFence()
    work.order_streams_after(fence)
    assert not work.is_completed()
    work.set_result(None)  # the job launched everything
    assert not work.is_completed()
    fence.finished = True
    assert work.is_completed()


def test_wait_and_result_order_the_waiting_stream():
    work, fence = Work(), RecordingFence()
    work.order_streams_after(fence)
    work.set_result(3)
    assert work.wait() is True
    assert fence.orders == 1
    assert work.result() == 3
    assert fence.orders == 2


def test_a_failed_operation_is_completed_and_orders_nothing():
    work, fence = Work(), RecordingFence()
    work.order_streams_after(fence)
    work.set_exception(RuntimeError("peer died"))
    assert work.is_completed()
    with pytest.raises(RuntimeError, match="peer died"):
        work.wait()
    assert fence.orders == 0


def test_a_work_without_a_fence_is_unchanged():
    work = Work()
    assert not work.is_completed()
    work.set_result(None)
    assert work.is_completed() and work.wait()


def test_a_chained_work_keeps_the_fence_of_the_work_it_follows():
    work, fence = Work(), RecordingFence()
    work.order_streams_after(fence)
    chained = chain(work, lambda value: value + 1)
    work.set_result(1)
    assert not chained.is_completed()  # the host step ran; the device work has not finished
    fence.finished = True
    assert chained.is_completed()
    assert chained.result() == 2
    assert fence.orders == 1


def test_the_work_of_several_calls_orders_the_stream_after_each_of_them():
    fences = [RecordingFence(), RecordingFence()]
    works = [Work(), Work(), Work()]  # the last one holds no CUDA array
    for work, fence in zip(works[:2], fences, strict=True):
        work.order_streams_after(fence)
    combined = all_done(works, description="3 operations")
    for work in works:
        work.set_result(None)
    fences[0].finished = True
    assert not combined.is_completed()
    fences[1].finished = True
    assert combined.is_completed()
    combined.wait()
    assert [fence.orders for fence in fences] == [1, 1]
