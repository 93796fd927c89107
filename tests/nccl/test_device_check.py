"""The core refuses an array on a device the group's backend does not serve, before any byte moves.

``Backend.devices`` is enforced in one place, colls.dispatch: every public call (collectives,
point-to-point, functional, multigpu) checks each array's DLPack device against the group's
backend first. The arrays here are the ctypes DLPack producer announcing kDLCUDA over host memory,
and CuPy is blocked, so the refusal is shown to need no CuPy and to happen before the array is
imported: the messages name the op, the argument, the rank, the device and the backend. The backend
is ``hostonly`` (device_workers: tcp declaring only "cpu"), since tcp itself stages CUDA arrays.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from _support import one_process_world
from device_workers import HOST_ONLY, p2p_refusals, register_host_only

import colls
from colls import _dlpack_ctypes as dlc
from colls import buffers, plugin_manager
from colls.testing.arrays import CtypesDLPackArray
from colls.testing.spawn import spawn

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def host_only_world(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A host-only world of one process, with CuPy made unimportable."""
    monkeypatch.setitem(sys.modules, "cupy", None)
    register_host_only()
    try:
        with one_process_world(HOST_ONLY):
            yield
    finally:
        plugin_manager.unregister_plugin(HOST_ONLY)


def _cuda(values: np.ndarray) -> CtypesDLPackArray:
    return CtypesDLPackArray(values, device_type=dlc.KDL_CUDA)


def _host() -> np.ndarray:
    return np.arange(6, dtype=np.float32)


def _cases() -> dict[str, tuple[str, Callable[..., Any]]]:
    """Every public call that takes arrays: name -> (the argument refused, call(cuda, cpu, kw)).

    ``kw`` is ``{"async_op": True}`` or empty; the functional forms have no async_op.
    """
    f = colls.functional
    return {
        "all_reduce": ("tensor", lambda g, c, kw: colls.all_reduce(g, **kw)),
        "broadcast": ("tensor", lambda g, c, kw: colls.broadcast(g, src=0, **kw)),
        "reduce": ("tensor", lambda g, c, kw: colls.reduce(g, dst=0, **kw)),
        "all_gather": ("tensor_list[0]", lambda g, c, kw: colls.all_gather([g], c, **kw)),
        "all_gather_into_tensor": (
            "input_tensor", lambda g, c, kw: colls.all_gather_into_tensor(c, g, **kw)),
        "gather": ("gather_list[0]", lambda g, c, kw: colls.gather(c, [g], dst=0, **kw)),
        "scatter": ("tensor", lambda g, c, kw: colls.scatter(g, [c], src=0, **kw)),
        "reduce_scatter": (
            "input_list[0]", lambda g, c, kw: colls.reduce_scatter(c, [g], **kw)),
        "reduce_scatter_tensor": (
            "output", lambda g, c, kw: colls.reduce_scatter_tensor(g, c, **kw)),
        "all_to_all": (
            "input_tensor_list[0]", lambda g, c, kw: colls.all_to_all([c], [g], **kw)),
        "all_to_all_single": ("input", lambda g, c, kw: colls.all_to_all_single(c, g, **kw)),
        "functional.all_reduce": ("array", lambda g, c, kw: f.all_reduce(g)),
        "functional.broadcast": ("array", lambda g, c, kw: f.broadcast(g, src=0)),
        "functional.all_gather": ("array", lambda g, c, kw: f.all_gather(g)),
        "functional.reduce_scatter": ("array", lambda g, c, kw: f.reduce_scatter(g)),
        "functional.all_to_all": ("array", lambda g, c, kw: f.all_to_all(g)),
        "all_reduce_multigpu": (
            "tensor_list[1]", lambda g, c, kw: colls.all_reduce_multigpu([c, g], **kw)),
        "broadcast_multigpu": (
            "tensor_list[0]", lambda g, c, kw: colls.broadcast_multigpu([g], src=0, **kw)),
        "reduce_multigpu": (
            "tensor_list[0]", lambda g, c, kw: colls.reduce_multigpu([g], dst=0, **kw)),
        "all_gather_multigpu": (
            "output_tensor_lists[0][0]",
            lambda g, c, kw: colls.all_gather_multigpu([[g]], [c], **kw)),
        "reduce_scatter_multigpu": (
            "input_tensor_lists[0][0]",
            lambda g, c, kw: colls.reduce_scatter_multigpu([c], [[g]], **kw)),
    }


CASES = _cases()
SYNC_AND_ASYNC = [(op, mode) for op in CASES for mode in ("sync", "async")
                  if mode == "sync" or not op.startswith("functional.")]


@pytest.mark.parametrize(("op", "mode"), SYNC_AND_ASYNC)
def test_cuda_array_is_refused_by_a_cpu_backend(host_only_world, op, mode):
    arg, call = CASES[op]
    host, other = _host(), _host()
    with pytest.raises(TypeError) as info:
        call(_cuda(host), other, {"async_op": True} if mode == "async" else {})
    message = str(info.value)
    assert message.startswith(f"{op} on rank 0: argument '{arg}' is a cuda array "), message
    assert "backend 'hostonly' of group 'default_pg' moves only cpu arrays" in message, message
    assert np.array_equal(host, _host()) and np.array_equal(other, _host()), "a refused call wrote"
    check = np.ones(2)
    colls.all_reduce(check)  # the group is not broken: the refusal moved nothing
    assert np.array_equal(check, np.ones(2))


def test_cpu_arrays_and_buffers_pass_the_check(host_only_world):
    array = np.arange(4, dtype=np.int64)
    colls.all_reduce(array)
    assert np.array_equal(array, np.arange(4))  # a world of one: the sum is the array
    wrapped = CtypesDLPackArray(np.arange(3, dtype=np.int32), device_type=dlc.KDL_CUDA_HOST)
    colls.all_reduce(wrapped)  # pinned host memory is CPU memory
    assert np.array_equal(wrapped.array, np.arange(3))


def test_device_of_reads_dlpack_without_importing(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    host = _host()
    assert buffers.device_of(host) == "cpu"
    assert buffers.device_of(bytearray(4)) == "cpu"
    assert buffers.device_of(CtypesDLPackArray(host)) == "cpu"
    assert buffers.device_of(CtypesDLPackArray(host, device_type=dlc.KDL_CUDA)) == "cuda"
    assert buffers.device_of(CtypesDLPackArray(host, device_type=dlc.KDL_CUDA_MANAGED)) == "cuda"
    assert buffers.device_of(CtypesDLPackArray(host, device_type=dlc.KDL_CUDA_HOST)) == "cpu"
    assert buffers.device_of(CtypesDLPackArray(host, device_type=10)) is None  # ROCm


def test_an_unknown_device_keeps_the_import_error(host_only_world):
    rocm = CtypesDLPackArray(_host(), device_type=10)
    with pytest.raises(TypeError, match=re.escape("lives on DLPack device type 10 (kDLROCM)")):
        colls.all_reduce(rocm)


def test_point_to_point_refuses_cuda_arrays_on_a_cpu_backend():
    for rank, messages in enumerate(spawn(p2p_refusals, 2, backend=None, timeout=90)):
        names = [m.split(":", 1)[0] for m in messages]
        assert names == ["isend", "irecv", "send", "recv", "recv_any", "batch_isend_irecv"]
        for message in messages:
            body = message.split(": ", 1)[1]
            # The blocking forms may name themselves or the isend/irecv they wrap.
            assert re.match(rf"(i?send|i?recv) on rank {rank}: argument 'tensor' is a cuda "
                            "array", body), body
            assert "backend 'hostonly' of group 'default_pg' moves only cpu arrays" in body, body
