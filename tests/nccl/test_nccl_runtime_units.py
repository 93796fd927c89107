"""The nccl backend's pieces that need neither a GPU nor libnccl: unique ids of CuPy 13 and 14,
and the watchdog's reading of completion events.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading

import pytest

from colls.errors import BackendError
from colls.work import Work
from colls_plugins.nccl import runtime
from colls_plugins.nccl.inflight import CUDA_SUCCESS, InFlight

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
