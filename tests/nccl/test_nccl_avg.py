"""AVG on nccl is NCCL's own ncclAvg, and the core does not divide after it (issue 31, item 6).

Without a GPU: a backend of two ranks whose peer contributes what this rank does reduces as
NCCL does (AVG: each input times 1/n, rounded to the dtype, then summed), and declares
``reduces_avg`` like NcclBackend. Float16 40000 then averages to 40000, where SUM-then-divide
overflows to inf, and every reducing collective of the core leaves the division to it. The same
backend without the declaration shows what the core does for the others.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import colls
from colls import dtypes, plugin_manager
from colls.backend import Backend, BackendSpec
from colls.hookspecs import hookimpl
from colls.reduce_ops import RedOpType, ReduceOp, make_premul_sum, resolve_op
from colls.work import Work
from colls_plugins.nccl import datatypes
from colls_plugins.nccl.backend import NcclBackend

pytestmark = pytest.mark.timeout(60)

NAME = "ncclavg-test"


def _nccl_avg(array: np.ndarray, dtype: dtypes.DType, size: int) -> None:
    """NCCL's ncclAvg on floating values, for ``size`` ranks holding ``array``: premultiply by
    1/size in the dtype's precision (ncclDevPreMulSum), then sum."""
    scaled = array.copy()
    resolve_op(make_premul_sum(1.0 / size), dtype, op_name="nccl").prepare(scaled)
    total = scaled.copy()
    add = resolve_op(ReduceOp.SUM, dtype, op_name="nccl")
    for _ in range(size - 1):
        add.combine(total, scaled)
    array[...] = total


class MirroredNccl(Backend):
    """Rank 0 of two whose peer holds the same arrays; reduces with NCCL's semantics."""

    reduces_avg = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.specs: list[Any] = []

    def isend(self, array: Any, dst: int, tag: int) -> Work:
        raise AssertionError("not used")

    irecv = isend

    def _reduce(self, array: np.ndarray, spec: Any) -> None:
        self.specs.append(spec)
        assert datatypes.reduction(spec.dtype, spec.kind, op_name="t", rank=0).nccl_op == (
            "NCCL_AVG" if spec.kind is RedOpType.AVG else "NCCL_SUM")
        if spec.kind is RedOpType.AVG and self.reduces_avg:
            _nccl_avg(array, spec.dtype, self.world_size)
        else:
            spec.combine(array, array.copy())

    def all_reduce(self, array: Any, op: Any, tag: int) -> None:
        self._reduce(array, op)

    def reduce(self, array: Any, root: int, op: Any, tag: int) -> None:
        self._reduce(array, op)

    def reduce_scatter(self, output: Any, input: Any, op: Any, tag: int) -> None:
        mine = input[self.rank * output.size:(self.rank + 1) * output.size].copy()
        self._reduce(mine, op)
        output[...] = mine


class DividedByTheCore(MirroredNccl):
    """The same, without the declaration: the core divides after the backend's SUM."""

    reduces_avg = False


class _Plugin:
    def __init__(self, cls: type) -> None:
        self.cls = cls

    @hookimpl
    def colls_backends(self) -> list[BackendSpec]:
        return [BackendSpec(name=NAME, devices=("cpu",), create=self.cls)]


@pytest.fixture
def world(request):
    plugin_manager.register_plugin(_Plugin(request.param), name=NAME)
    colls.init_process_group(NAME, store=colls.HashStore(), rank=0, world_size=2)
    try:
        yield request.param
    finally:
        colls.destroy_process_group()
        plugin_manager.unregister_plugin(NAME)


def _backend() -> Any:
    from colls import dispatch

    return dispatch.default_group().backend


def test_the_nccl_backend_declares_that_it_averages():
    assert NcclBackend.reduces_avg is True


@pytest.mark.parametrize("world", [MirroredNccl], indirect=True)
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_float16_40000_averages_to_40000_and_the_core_does_not_divide(world, async_op):
    x = np.full(5, 40000, dtype=np.float16)
    work = colls.all_reduce(x, op=ReduceOp.AVG, async_op=async_op)
    if work is not None:
        work.wait()
    assert x.tolist() == [40000.0] * 5
    assert _backend().specs[-1].backend_averages


@pytest.mark.parametrize("world", [MirroredNccl], indirect=True)
def test_every_reducing_collective_leaves_avg_to_the_backend(world):
    values = np.array([3.0, -1.5, 0.25, 1e-3], dtype=np.float32)
    r = values.copy()
    colls.reduce(r, dst=0, op=ReduceOp.AVG)
    out = np.zeros(2, dtype=np.float32)
    colls.reduce_scatter_tensor(out, values.copy(), op=ReduceOp.AVG)
    lst_out = np.zeros(2, dtype=np.float32)
    colls.reduce_scatter(lst_out, [values[:2].copy(), values[2:].copy()], op=ReduceOp.AVG)
    z = (values + 1j * values).astype(np.complex64)  # AVG on complex: NCCL_AVG on its parts
    colls.all_reduce(z, op=ReduceOp.AVG)
    np.testing.assert_array_equal(r, values)
    np.testing.assert_array_equal(out, values[:2])
    np.testing.assert_array_equal(lst_out, values[:2])
    np.testing.assert_array_equal(z, (values + 1j * values).astype(np.complex64))
    assert len(_backend().specs) == 4 and all(s.backend_averages for s in _backend().specs)


@pytest.mark.parametrize("world", [DividedByTheCore], indirect=True)
def test_a_backend_that_does_not_average_gets_sum_then_the_core_divides(world):
    x = np.full(5, 40000, dtype=np.float16)
    colls.all_reduce(x, op=ReduceOp.SUM)
    assert np.isinf(x).all()  # 2 x 40000 overflows float16: why NCCL's own AVG is used
    y = np.full(3, 6.0, dtype=np.float32)
    colls.all_reduce(y, op=ReduceOp.AVG)  # SUM (12) here, then the core's division by 2
    assert y.tolist() == [6.0] * 3 and not _backend().specs[-1].backend_averages
