"""The ``*_multigpu`` reductions refuse AVG and PREMUL_SUM, before touching the caller's arrays.

Their scaling would count processes while the reduction runs over ``world_size * k`` arrays, so
all_reduce_multigpu, reduce_multigpu and reduce_scatter_multigpu raise ValueError naming the op,
the function and the rank. A world of one process (the suite's ``world_of_one``) is enough: the
refusal happens before any communication.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import colls
from colls.reduce_ops import ReduceOp, make_premul_sum

pytestmark = pytest.mark.timeout(60)

K = 2  # arrays per process
COUNT = 5
OPS = {"AVG": ReduceOp.AVG, "PREMUL_SUM": make_premul_sum(2.0)}
FUNCTIONS = ("all_reduce_multigpu", "reduce_multigpu", "reduce_scatter_multigpu")


def _arrays() -> list[np.ndarray]:
    return [np.arange(COUNT, dtype=np.float32) + 10 * i for i in range(K)]


def _call(function: str, op: Any, async_op: bool) -> tuple[Callable[[], Any], list[np.ndarray]]:
    """Return a call of ``function`` with ``op`` and every array that call is given."""
    if function == "reduce_scatter_multigpu":
        outputs = _arrays()
        inputs = [_arrays() for _ in range(K)]  # K lists of world_size * K arrays
        return (lambda: colls.reduce_scatter_multigpu(outputs, inputs, op=op, async_op=async_op),
                outputs + [a for lst in inputs for a in lst])
    arrays = _arrays()
    if function == "reduce_multigpu":
        return lambda: colls.reduce_multigpu(arrays, dst=0, op=op, async_op=async_op), arrays
    return lambda: colls.all_reduce_multigpu(arrays, op=op, async_op=async_op), arrays


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize("function", FUNCTIONS)
def test_scaled_ops_are_refused(world_of_one, function, op_name, async_op):
    call, arrays = _call(function, OPS[op_name], async_op)
    before = [a.copy() for a in arrays]
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"{function} on rank 0: op {op_name} is not supported"), message
    for index, (array, original) in enumerate(zip(arrays, before, strict=True)):
        np.testing.assert_array_equal(array, original, err_msg=f"array {index} was modified")


@pytest.mark.parametrize("function", FUNCTIONS)
def test_sum_still_runs_after_a_refusal(world_of_one, function):
    """The refusal leaves the group usable: SUM over the same list adds the k arrays."""
    with pytest.raises(ValueError):
        _call(function, ReduceOp.AVG, False)[0]()
    call, arrays = _call(function, ReduceOp.SUM, False)
    call()
    total = sum(_arrays())
    if function == "reduce_scatter_multigpu":
        # one process: output i is entry i, summed over the K input lists
        for i, output in enumerate(arrays[:K]):
            np.testing.assert_array_equal(output, K * _arrays()[i], err_msg=f"output {i}")
    elif function == "reduce_multigpu":
        np.testing.assert_array_equal(arrays[0], total)
    else:
        for array in arrays:
            np.testing.assert_array_equal(array, total)
