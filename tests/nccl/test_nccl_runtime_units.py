"""The nccl backend's pieces that need neither a GPU nor libnccl: unique ids of CuPy 13 and 14,
the watchdog's reading of completion events and its completing of Works off its own thread, and
how close() releases the communicator (destroyed when drained and healthy, else aborted).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
import types

import pytest

from colls.errors import BackendError, CollsTimeoutError
from colls.work import Work
from colls_plugins.nccl import runtime
from colls_plugins.nccl.backend import NcclBackend
from colls_plugins.nccl.communicator import Communicator
from colls_plugins.nccl.inflight import CUDA_NOT_READY, CUDA_SUCCESS, InFlight

pytestmark = pytest.mark.timeout(30)

UNIQUE_ID = bytes((i * 37) % 256 for i in range(runtime.UNIQUE_ID_BYTES))  # both halves


def test_a_unique_id_is_bytes_from_cupy_13_and_14():
    signed = tuple(b - 256 if b > 127 else b for b in UNIQUE_ID)  # CuPy 13: C chars
    assert runtime.id_bytes(signed) == UNIQUE_ID
    assert runtime.id_bytes(UNIQUE_ID) == UNIQUE_ID  # CuPy 14


class _Cupy13Nccl:
    """CuPy 13's constructor: the id as a tuple of signed chars; bytes are a TypeError."""

    class NcclCommunicator:
        def __init__(self, ndev: int, comm_id: tuple, rank: int) -> None:
            if not isinstance(comm_id, tuple):
                raise TypeError("Argument 'commId' has incorrect type (expected tuple)")
            self.args = (ndev, comm_id, rank)


class _Cupy14Nccl:
    class NcclCommunicator:
        def __init__(self, ndev: int, comm_id: bytes, rank: int) -> None:
            if not isinstance(comm_id, bytes):
                raise TypeError("expected bytes")
            self.args = (ndev, comm_id, rank)


def test_the_communicator_gets_the_id_in_the_form_its_cupy_takes():
    made = runtime.new_communicator(_Cupy13Nccl, 4, UNIQUE_ID, 2)
    ndev, comm_id, rank = made.args
    assert (ndev, rank) == (4, 2) and runtime.id_bytes(comm_id) == UNIQUE_ID
    assert min(comm_id) < 0  # signed, as CuPy 13's get_unique_id gives it
    assert runtime.new_communicator(_Cupy14Nccl, 4, UNIQUE_ID, 2).args == (4, UNIQUE_ID, 2)


class _Event:
    def __init__(self, status: int) -> None:
        self.status = status


def _watch(status: int) -> tuple[Work, list[BackendError]]:
    failures: list[BackendError] = []
    failed = threading.Event()

    def on_failure(error: BackendError) -> None:
        failures.append(error)
        failed.set()

    inflight = InFlight(contextlib.nullcontext(), 30.0, lambda: None, on_failure,
                        lambda event: event.status)
    work = Work()
    inflight.add("all_reduce on rank 0", _Event(status), (), work, "done")
    concurrent.futures.wait([work.get_future()], timeout=5)
    inflight.stop()
    return work, failures


def test_an_event_that_fired_completes_its_work():
    work, failures = _watch(CUDA_SUCCESS)
    assert work.result() == "done" and failures == []


def test_a_cuda_error_on_an_event_fails_the_group_at_once():
    work, failures = _watch(700)  # cudaErrorIllegalAddress
    assert len(failures) == 1
    assert "all_reduce on rank 0 failed on the GPU (CUDA error 700)" in str(failures[0])
    assert isinstance(work.exception(), BackendError)


# -- completing Works off the watchdog's thread (issue 31, item 8) -----------------------------


def test_a_slow_completion_does_not_stop_the_watchdog_seeing_a_timeout():
    # A staged receive's Work completion copies into the caller's array and synchronises a
    # stream: seconds, if the caller's stream is busy. The watchdog must go on polling.
    failures: list[BaseException] = []
    failed = threading.Event()
    release = threading.Event()
    ran_on: list[str] = []

    def on_failure(error: BaseException) -> None:
        failures.append(error)
        failed.set()

    def slow_write_back(_work: Work) -> None:
        ran_on.append(threading.current_thread().name)
        release.wait(20)

    inflight = InFlight(contextlib.nullcontext(), 0.3, lambda: None, on_failure,
                        lambda event: event.status)
    try:
        staged = Work()
        staged.add_done_callback(slow_write_back)
        inflight.add("irecv from rank 1 on rank 0", _Event(CUDA_SUCCESS), (), staged, 1)
        stuck = Work()
        inflight.add("all_reduce on rank 0", _Event(CUDA_NOT_READY), (), stuck)
        assert failed.wait(5), "the watchdog stopped polling while a Work was being completed"
        assert ran_on == ["colls-nccl-completion"]
        assert "all_reduce on rank 0 did not complete within 0.3 s" in str(failures[0])
        assert isinstance(stuck.exception(), CollsTimeoutError)
        assert staged.result() == 1  # its event fired: it completed, not failed
    finally:
        release.set()
        inflight.stop()


def test_drain_waits_for_the_completions_too():
    release = threading.Event()
    inflight = InFlight(contextlib.nullcontext(), 30.0, lambda: None, lambda error: None,
                        lambda event: event.status)
    try:
        work = Work()
        work.add_done_callback(lambda _work: release.wait(20))
        inflight.add("irecv", _Event(CUDA_SUCCESS), (), work, 0)
        assert not inflight.drain(0.3)  # fired, but its Work is still being completed
        release.set()
        assert inflight.drain(5)
    finally:
        release.set()
        inflight.stop()


# -- releasing the communicator at close (issue 31, item 10) -----------------------------------


class _Comm:
    """What Communicator calls on cupy.cuda.nccl.NcclCommunicator; ``comm`` is 0 once released."""

    def __init__(self, destroy_blocks: threading.Event | None = None) -> None:
        self.comm = 1
        self.calls: list[str] = []
        self._destroy_blocks = destroy_blocks

    def check_async_error(self) -> None:
        self.calls.append("check_async_error")

    def abort(self) -> None:
        self.calls.append("abort")
        self.comm = 0

    def destroy(self) -> None:
        self.calls.append("destroy")
        if self._destroy_blocks is not None:
            self._destroy_blocks.wait(20)
        self.comm = 0


def _closing(comm: _Comm, timeout: float, broken: BaseException | None = None) -> NcclBackend:
    """An NcclBackend as its constructor leaves it, minus the GPU: close() is the code tested."""
    backend = object.__new__(NcclBackend)
    backend.options = types.SimpleNamespace(timeout=timeout)
    backend._lock = threading.Lock()
    backend._closed = False
    backend._broken = broken
    backend._inflight = InFlight(contextlib.nullcontext(), 30.0, lambda: None,
                                 lambda error: None, lambda event: event.status)
    backend._communicator = Communicator(comm, contextlib.nullcontext(), "rank 0")
    return backend


def test_a_healthy_drained_communicator_is_destroyed_not_aborted():
    comm = _Comm()
    backend = _closing(comm, 5.0)
    backend._inflight.add("all_reduce", _Event(CUDA_SUCCESS), ())
    backend.close()
    assert comm.calls == ["destroy"]
    backend.close()  # once
    assert comm.calls == ["destroy"]


def test_work_still_running_at_close_aborts():
    comm = _Comm()
    backend = _closing(comm, 0.2)
    backend._inflight.add("all_reduce", _Event(CUDA_NOT_READY), ())
    backend.close()
    assert comm.calls == ["abort"]


def test_a_failed_group_aborts_at_close():
    comm = _Comm()
    backend = _closing(comm, 5.0, broken=BackendError("nccl: rank 1 died"))
    backend.close()
    assert comm.calls == ["abort"]


def test_a_destroy_that_does_not_return_is_bounded_and_reported():
    blocked = threading.Event()
    comm = _Comm(destroy_blocks=blocked)
    backend = _closing(comm, 0.2)
    started = time.monotonic()
    try:
        with pytest.warns(RuntimeWarning, match=r"nccl: rank 0: ncclCommDestroy did not return "
                                                r"within 0\.2 s"):
            backend.close()
        assert time.monotonic() - started < 5
    finally:
        blocked.set()
    communicator = backend._communicator
    communicator.abort()  # released once: an abort after it does nothing
    communicator.check_async_error()  # nor is it queried
    assert comm.calls == ["destroy"]
