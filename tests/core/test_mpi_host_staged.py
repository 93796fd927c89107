"""The mpi backend's ``host_staged`` decorator: its fixed-arity front and its general path.

No MPI is needed (so it lives with the unit tests): the decorated methods belong to a stand-in
backend.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from colls_plugins.mpi import staging
from colls_plugins.mpi.staging import host_staged


class DeviceArray:
    """A CUDA array as the staging code sees one: the interface, ``get`` and ``set``."""

    __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (8, False),
                                "version": 3}

    def __init__(self, host: np.ndarray) -> None:
        self.host = host.copy()

    def get(self) -> np.ndarray:
        return self.host.copy()

    def set(self, host: np.ndarray) -> None:
        np.copyto(self.host, host)


class Backend:
    cuda_aware = False

    @host_staged()
    def one(self, array: Any, op: Any, tag: int) -> tuple:
        if type(array) is np.ndarray:
            array += 1  # what it writes comes back to a staged array
        return "one", type(array).__name__, op, tag

    @host_staged(arrays=(0, 1))
    def two(self, output: Any, input: Any, tag: int) -> tuple:
        if output is not None:
            output[:] = input
        return "two", type(output).__name__, type(input).__name__, tag

    @host_staged(arrays=(0, 1))
    def four(self, output: Any, input: Any, root: int, tag: int) -> tuple:
        return "four", output is None, type(input).__name__, root, tag

    @host_staged(arrays=(0, 1))
    def five(self, output: Any, input: Any, out_splits: Any, in_splits: Any, tag: int
             ) -> tuple:
        return "five", type(output).__name__, out_splits, in_splits, tag


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> Backend:
    monkeypatch.setattr(staging, "synchronize_device", lambda: None)
    return Backend()


def test_numpy_arrays_by_position_or_by_name_reach_the_method(backend: Backend) -> None:
    a, b = np.zeros(2, np.float32), np.ones(2, np.float32)
    assert backend.one(a, "sum", 3) == ("one", "ndarray", "sum", 3)
    assert backend.one(a, op="max", tag=4) == ("one", "ndarray", "max", 4)
    assert backend.one(array=a, op="min", tag=5) == ("one", "ndarray", "min", 5)
    assert backend.two(a, b, 6) == ("two", "ndarray", "ndarray", 6)
    assert (a == 1).all()
    assert backend.two(a, input=b, tag=7) == ("two", "ndarray", "ndarray", 7)
    assert backend.four(None, b, 0, 8) == ("four", True, "ndarray", 0, 8)
    assert backend.four(None, b, root=1, tag=9) == ("four", True, "ndarray", 1, 9)
    assert backend.five(a, b, [1], [1], 10) == ("five", "ndarray", [1], [1], 10)
    assert Backend.two.__name__ == "two" and Backend.two.__wrapped__ is not None


def test_a_device_array_is_staged_and_what_the_method_wrote_comes_back(backend: Backend
                                                                        ) -> None:
    device = DeviceArray(np.array([1, 2], np.float32))
    assert backend.one(device, "sum", 1) == ("one", "ndarray", "sum", 1)
    assert device.host.tolist() == [2, 3]
    out = DeviceArray(np.zeros(2, np.float32))
    assert backend.two(out, np.array([5, 6], np.float32), 2) == ("two", "ndarray", "ndarray", 2)
    assert out.host.tolist() == [5, 6]
    assert backend.four(None, DeviceArray(np.ones(2, np.float32)), 0, 3)[2] == "ndarray"


def test_missing_or_unknown_arguments_raise_as_the_method_would(backend: Backend) -> None:
    a = np.zeros(2, np.float32)
    with pytest.raises(TypeError, match="tag"):
        backend.two(a, a)
    with pytest.raises(TypeError, match="root"):
        backend.four(None, a, tag=1)
    with pytest.raises(TypeError, match="nonsense"):
        backend.one(a, "sum", 1, nonsense=2)


def test_only_leading_array_positions_are_supported() -> None:
    with pytest.raises(ValueError, match="arrays"):
        host_staged(arrays=(1,))
