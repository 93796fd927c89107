"""CUDA staging's ordering of a staged irecv, and what it reuses between calls, without a GPU.

* A staged irecv copies up on the transport's thread; the copy must be ordered after the caller's
  stream as it was when irecv was called (issue 31, item 7). The stand-in device of
  colls.testing.staging records where its marks were made and which mark each copier waited for.
* CupyCopier makes its two streams once per thread and device, and reuses its events, which have
  no timing (item 12). A stand-in for the few CuPy calls it makes counts what is created: the
  copies themselves run only in tests/gpu.
* The pinned pool takes the smallest free buffer that fits and keeps a bounded number of bytes.
"""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest

from colls import staging
from colls.staging import PinnedPool, run_segmented, segment_bounds, stage_cuda
from colls.testing.staging import Mark, StandInDeviceArray, threaded_device
from colls.work import Work

pytestmark = pytest.mark.timeout(30)


# -- a staged irecv ------------------------------------------------------------------------------


class _HostReceiver:
    """A host-memory backend whose receives are completed by the test, on a thread of its own."""

    devices = ("cpu",)

    def __init__(self) -> None:
        self.posted: list[tuple[np.ndarray, Work]] = []

    def irecv(self, array: np.ndarray, src: int | None, tag: int) -> Work:
        work = Work(description=f"irecv from {src}")
        self.posted.append((array, work))
        return work

    def _not_called(self, *args: object) -> None:
        raise AssertionError("only irecv is used here")

    all_reduce = broadcast = reduce = isend = _not_called
    all_gather = gather = scatter = reduce_scatter = all_to_all = _not_called


_StagedReceiver = stage_cuda(type("_StagedReceiver", (_HostReceiver,), {}))


def test_a_staged_irecv_copies_up_after_the_callers_stream_as_it_was_at_the_call():
    with threaded_device() as copiers:
        array = StandInDeviceArray(np.arange(8, dtype=np.float32))
        before = array.host.tobytes()
        backend = _StagedReceiver()
        work = backend.irecv(array, 1, 0)  # on this thread: the caller's
        caller = threading.current_thread().name
        host, inner = backend.posted[0]

        def deliver() -> None:  # the transport's thread receives, and completes the Work
            host[...] = 42.0
            inner.set_result(1)

        transport = threading.Thread(target=deliver, name="transport-thread")
        transport.start()
        transport.join()
        assert work.get_future().result(timeout=5) == 1
    np.testing.assert_array_equal(array.host, np.full(8, 42.0, dtype=np.float32))
    (upload,) = copiers
    assert upload.thread == "transport-thread" and upload.log == [("upload", 0)]
    assert isinstance(upload.after, Mark)
    assert upload.after.thread == caller  # recorded on the caller's thread ...
    assert upload.after.contents == before  # ... at the call, before any byte arrived
    assert upload.finished and not upload.violations


def test_a_failed_staged_irecv_gives_its_buffer_back_and_copies_nothing():
    with threaded_device() as copiers:
        array = StandInDeviceArray(np.arange(4, dtype=np.float32))
        backend = _StagedReceiver()
        work = backend.irecv(array, 1, 0)
        _, inner = backend.posted[0]
        inner.set_exception(RuntimeError("peer 1 died"))
        with pytest.raises(RuntimeError, match="peer 1 died"):
            work.get_future().result(timeout=5)
        assert staging.CUDA.pinned.free_bytes == array.nbytes
    assert copiers == []
    np.testing.assert_array_equal(array.host, np.arange(4, dtype=np.float32))


# -- CupyCopier's streams and events ---------------------------------------------------------


class _FakeCuda:
    """The CuPy calls CupyCopier makes, counting the streams and events created."""

    def __init__(self) -> None:
        self.streams: list[_Stream] = []
        self.events: list[_Event] = []
        self.current = _Stream(self, non_blocking=False)

    def module(self) -> types.SimpleNamespace:
        cuda = types.SimpleNamespace(
            Stream=lambda non_blocking: _Stream(self, non_blocking),
            Event=lambda disable_timing=False: _Event(self, disable_timing),
            get_current_stream=lambda: self.current,
        )
        return types.SimpleNamespace(cuda=cuda)


class _Stream:
    def __init__(self, fake: _FakeCuda, non_blocking: bool) -> None:
        self.non_blocking = non_blocking
        self.waited: list[_Event] = []
        fake.streams.append(self)

    def wait_event(self, event: _Event) -> None:
        self.waited.append(event)

    def synchronize(self) -> None:
        pass


class _Event:
    def __init__(self, fake: _FakeCuda, disable_timing: bool) -> None:
        self.disable_timing = disable_timing
        self.recorded_on: list[_Stream] = []
        fake.events.append(self)

    def record(self, stream: _Stream) -> None:
        self.recorded_on.append(stream)

    def synchronize(self) -> None:
        pass


class _Device:
    def __init__(self, index: int) -> None:
        self.id = index

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _Pointer:
    def __add__(self, offset: int) -> _Pointer:
        return self

    def copy_to_host_async(self, address: int, nbytes: int, stream: _Stream) -> None:
        pass

    def copy_from_host_async(self, address: int, nbytes: int, stream: _Stream) -> None:
        pass


def _device_array(index: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(data=_Pointer(), device=_Device(index))


def _one_call(array: types.SimpleNamespace, segments: int) -> None:
    bounds = segment_bounds(segments * 16, 4, 16)
    buffers = [np.zeros(16, dtype=np.uint8) for _ in range(staging.PIPELINE_DEPTH)]
    run_segmented(staging.CupyCopier(array), buffers, bounds, lambda host, k: None,
                  download=True, upload=True)


def test_the_copy_streams_are_made_once_per_thread_and_device_and_events_reused(monkeypatch):
    fake = _FakeCuda()
    monkeypatch.setitem(__import__("sys").modules, "cupy", fake.module())
    monkeypatch.setattr(staging, "_THREAD", threading.local())
    for _ in range(5):
        _one_call(_device_array(0), segments=10)
    assert len(fake.streams) == 1 + 2  # the current stream, then one pair for the whole thread
    assert all(s.non_blocking for s in fake.streams[1:])
    # Each call records one event on the caller's stream and one per copy; 5 calls of 10
    # segments record 105 times, on a handful of events that have all fired when reused.
    assert sum(len(e.recorded_on) for e in fake.events) == 5 * (1 + 2 * 10)
    assert len(fake.events) <= staging.PIPELINE_DEPTH + 3
    assert all(e.disable_timing for e in fake.events)
    # The caller's stream was the one waited for: an event recorded on it, waited by both.
    down, up = fake.streams[1:]
    assert down.waited[0] is up.waited[0] and down.waited[0].recorded_on[0] is fake.current

    _one_call(_device_array(1), segments=1)  # another GPU: its own pair
    assert len(fake.streams) == 5
    made = threading.Thread(target=_one_call, args=(_device_array(0), 1))
    made.start()
    made.join()
    assert len(fake.streams) == 7  # another thread: its own pair


def test_a_mark_is_a_new_event_on_the_current_stream(monkeypatch):
    fake = _FakeCuda()
    monkeypatch.setitem(__import__("sys").modules, "cupy", fake.module())
    first = staging.mark_current_stream(_device_array(0))
    second = staging.mark_current_stream(_device_array(0))
    assert first is not second  # a staged irecv's mark is never recorded again under it
    assert first.recorded_on == [fake.current] and first.disable_timing


# -- the pinned pool -----------------------------------------------------------------------------


def _pool(max_free_bytes: int) -> tuple[PinnedPool, list[int]]:
    made: list[int] = []

    def allocate(nbytes: int) -> np.ndarray:
        made.append(nbytes)
        return np.zeros(nbytes, dtype=np.uint8)

    return PinnedPool(allocate, max_free_bytes), made


def test_the_pool_takes_the_smallest_buffer_that_fits():
    pool, made = _pool(1 << 20)
    big, small = pool.take(1000), pool.take(10)
    pool.give(big)
    pool.give(small)
    assert pool.take(8) is small  # not the first that fits
    assert pool.take(500) is big
    assert made == [1000, 10]


def test_the_pool_keeps_a_bounded_number_of_free_bytes_releasing_the_oldest():
    pool, made = _pool(250)
    a, b, c = pool.take(100), pool.take(100), pool.take(100)
    pool.give(a)
    pool.give(b)
    assert pool.free_bytes == 200
    pool.give(c)  # 300 > 250: the buffer given back longest ago is released
    assert pool.free_bytes == 200
    kept = {id(pool.take(100)), id(pool.take(100))}
    assert kept == {id(b), id(c)}
    assert pool.take(100) is not a and made == [100, 100, 100, 100]
    pool.give(pool.take(1000))  # larger than the bound on its own: not kept
    assert pool.free_bytes == 0
