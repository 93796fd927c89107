"""Conformance checks of the reductions: every op on every dtype, refusals, and every count.

The op x dtype matrix runs all_reduce with torch's rules: where an op applies to a dtype the result
must equal :meth:`ReduceSpec.numpy_reference` bit for bit (inputs are exact-safe, so the order in
which a backend reduces does not matter); where it does not, every rank must get a TypeError
before any byte moves, and the group must keep working.
"""

from __future__ import annotations

import functools
from typing import Any, Final

import numpy as np

import colls
from colls import dtypes
from colls.reduce_ops import ReduceOp, make_premul_sum
from colls.testing._checks_common import (
    Suite,
    expect,
    expect_equal,
    expect_raises,
    op_allowed,
    op_label,
    reference,
    sentinel,
)

#: Elements per case of the op x dtype matrix: small and odd (no even split between ranks).
MATRIX_COUNT: Final = 13
#: The premultiplier of the PREMUL_SUM cases: a power of two keeps results exact.
PREMUL_FACTOR: Final = 2.0
OPS: Final = (
    ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND, ReduceOp.BOR,
    ReduceOp.BXOR, ReduceOp.AVG, make_premul_sum(PREMUL_FACTOR),
)  # fmt: skip


def _kind_name(op: Any) -> str:
    return getattr(op, "kind", op).name


def check_all_reduce_matrix(s: Suite) -> None:
    """all_reduce every op on every dtype (refused pairs raise TypeError and move nothing)."""
    for dtype in s.dtypes:
        refused = [op for op in OPS if not op_allowed(op, dtype)]
        for op in OPS:
            if op in refused:
                continue
            with s.case("all_reduce", dtype=dtype, op=op, count=MATRIX_COUNT):
                inputs = s.inputs(dtype, MATRIX_COUNT, "all_reduce", dtype.name, op_label(op))
                array = s.lib.make(inputs[s.rank], dtype)
                returned = colls.all_reduce(array, op=op)
                expect(returned is None, f"all_reduce returned {returned!r}, expected None")
                expect_equal(s.lib.to_numpy(array), reference(op, dtype, inputs), "result")
        for op in refused:
            with s.case("all_reduce refuses op", dtype=dtype, op=op):
                words = s.inputs(dtype, MATRIX_COUNT, "refused", dtype.name)[s.rank]
                array = s.lib.make(words, dtype)
                expect_raises(TypeError, functools.partial(colls.all_reduce, array, op=op),
                              contains=(_kind_name(op), dtype.name))
                expect_equal(s.lib.to_numpy(array), words, "array after the refused call")
        if refused:
            with s.case("collective after refused ops", dtype=dtype):
                sentinel(s)


def check_refusals_of_other_reductions(s: Suite) -> None:
    """reduce, reduce_scatter(_tensor) and all_reduce_multigpu refuse forbidden pairs too."""
    cases = ((ReduceOp.BAND, dtypes.FLOAT32), (ReduceOp.AVG, dtypes.INT32),
             (ReduceOp.MAX, dtypes.COMPLEX64))
    for op, dtype in cases:
        for name, call in _refusal_calls(s, op, dtype).items():
            with s.case(f"{name} refuses op", dtype=dtype, op=op):
                expect_raises(TypeError, call, contains=(op.name, dtype.name))
    with s.case("collective after refused ops"):
        sentinel(s)


def _refusal_calls(s: Suite, op: Any, dtype: dtypes.DType) -> dict[str, Any]:
    """Return the calls of every other reduction with ``op`` on ``dtype``, by name."""
    ws = s.world_size

    def make(count: int) -> Any:
        return s.lib.make(np.zeros(count, dtype=dtype.numpy), dtype)

    return {
        "reduce": lambda: colls.reduce(make(2), dst=0, op=op),
        "reduce_scatter_tensor": lambda: colls.reduce_scatter_tensor(make(2), make(2 * ws), op=op),
        "reduce_scatter": lambda: colls.reduce_scatter(make(2), [make(2)] * ws, op=op),
        "all_reduce_multigpu": lambda: colls.all_reduce_multigpu([make(2), make(2)], op=op),
    }


def check_counts(s: Suite) -> None:
    """Every collective with 0, 1, an odd count and a count spanning several segments."""
    for count in s.counts:
        _all_reduce_count(s, count)
        _broadcast_reduce_count(s, count)
        _all_gather_count(s, count)
        _reduce_scatter_count(s, count)
        _all_to_all_count(s, count)


def _all_reduce_count(s: Suite, count: int) -> None:
    cases = [(dtypes.FLOAT32, ReduceOp.SUM), (dtypes.INT32, ReduceOp.MAX)]
    if not s.quick:
        cases.append((dtypes.BFLOAT16, ReduceOp.SUM))
    for dtype, op in cases:
        with s.case("all_reduce", dtype=dtype, op=op, count=count):
            inputs = s.inputs(dtype, count, "count/all_reduce", dtype.name)
            array = s.lib.make(inputs[s.rank], dtype)
            colls.all_reduce(array, op=op)
            expect_equal(s.lib.to_numpy(array), reference(op, dtype, inputs), "result")


def _broadcast_reduce_count(s: Suite, count: int) -> None:
    dtype = dtypes.FLOAT32
    inputs = s.inputs(dtype, count, "count/rooted")
    root = s.world_size - 1
    with s.case("broadcast", dtype=dtype, root=root, count=count):
        array = s.lib.make(inputs[s.rank], dtype)
        colls.broadcast(array, src=root)
        expect_equal(s.lib.to_numpy(array), inputs[root], "result")
    root = s.world_size // 2
    with s.case("reduce", dtype=dtype, op=ReduceOp.SUM, root=root, count=count):
        array = s.lib.make(inputs[s.rank], dtype)
        colls.reduce(array, dst=root)
        expected = reference(ReduceOp.SUM, dtype, inputs) if s.rank == root else inputs[s.rank]
        expect_equal(s.lib.to_numpy(array), expected, "result")


def _all_gather_count(s: Suite, count: int) -> None:
    dtype = dtypes.FLOAT32
    inputs = s.inputs(dtype, count, "count/all_gather")
    mine = s.lib.make(inputs[s.rank], dtype)
    with s.case("all_gather", dtype=dtype, count=count):
        outs = [s.lib.make(np.full(count, -1, dtype.numpy), dtype) for _ in inputs]
        colls.all_gather(outs, mine)
        for r, out in enumerate(outs):
            expect_equal(s.lib.to_numpy(out), inputs[r], f"tensor_list[{r}]")
    with s.case("all_gather_into_tensor", dtype=dtype, count=count):
        out = s.lib.make(np.full(count * s.world_size, -1, dtype.numpy), dtype)
        colls.all_gather_into_tensor(out, mine)
        expect_equal(s.lib.to_numpy(out), np.concatenate(inputs), "output_tensor")
    expect_equal(s.lib.to_numpy(mine), inputs[s.rank], "all_gather's input (must be unchanged)")


def _reduce_scatter_count(s: Suite, count: int) -> None:
    dtype, ws = dtypes.FLOAT32, s.world_size
    inputs = s.inputs(dtype, count * ws, "count/reduce_scatter")
    total = reference(ReduceOp.SUM, dtype, inputs)
    mine = total[s.rank * count : (s.rank + 1) * count]
    with s.case("reduce_scatter", dtype=dtype, op=ReduceOp.SUM, count=count):
        out = s.lib.make(np.zeros(count, dtype.numpy), dtype)
        pieces = [s.lib.make(p, dtype) for p in np.split(inputs[s.rank], ws)]
        colls.reduce_scatter(out, pieces)
        expect_equal(s.lib.to_numpy(out), mine, "output")
    with s.case("reduce_scatter_tensor", dtype=dtype, op=ReduceOp.SUM, count=count):
        out = s.lib.make(np.zeros(count, dtype.numpy), dtype)
        src = s.lib.make(inputs[s.rank], dtype)
        colls.reduce_scatter_tensor(out, src)
        expect_equal(s.lib.to_numpy(out), mine, "output")
        expect_equal(s.lib.to_numpy(src), inputs[s.rank], "input (must be unchanged)")


def _all_to_all_count(s: Suite, count: int) -> None:
    dtype, ws = dtypes.FLOAT64, s.world_size
    inputs = s.inputs(dtype, count * ws, "count/all_to_all")
    expected = np.concatenate([inputs[j][s.rank * count : (s.rank + 1) * count]
                               for j in range(ws)])
    with s.case("all_to_all", dtype=dtype, count=count):
        outs = [s.lib.make(np.zeros(count, dtype.numpy), dtype) for _ in range(ws)]
        ins = [s.lib.make(p, dtype) for p in np.split(inputs[s.rank], ws)]
        colls.all_to_all(outs, ins)
        got = np.concatenate([s.lib.to_numpy(o) for o in outs])
        expect_equal(got, expected, "output_tensor_list (concatenated)")
    with s.case("all_to_all_single", dtype=dtype, count=count):
        out = s.lib.make(np.zeros(count * ws, dtype.numpy), dtype)
        colls.all_to_all_single(out, s.lib.make(inputs[s.rank], dtype))
        expect_equal(s.lib.to_numpy(out), expected, "output")


def check_scaled_reductions(s: Suite) -> None:
    """AVG and PREMUL_SUM (which scale before or after moving) on the other reductions.

    The scaling must reach the result and never the caller's inputs: reduce's non-root arrays
    and reduce_scatter's inputs stay as they were.
    """
    dtype, ws, count = dtypes.FLOAT32, s.world_size, 3
    root = ws - 1
    for op in (ReduceOp.AVG, make_premul_sum(PREMUL_FACTOR)):
        inputs = s.inputs(dtype, count * ws, "scaled", op_label(op))
        total = reference(op, dtype, inputs)
        with s.case("reduce", dtype=dtype, op=op, root=root):
            array = s.lib.make(inputs[s.rank], dtype)
            colls.reduce(array, dst=root, op=op)
            expected = total if s.rank == root else inputs[s.rank]
            expect_equal(s.lib.to_numpy(array), expected, "tensor")
        mine = total[s.rank * count : (s.rank + 1) * count]
        with s.case("reduce_scatter_tensor", dtype=dtype, op=op):
            src = s.lib.make(inputs[s.rank], dtype)
            out = s.lib.make(np.zeros(count, dtype.numpy), dtype)
            colls.reduce_scatter_tensor(out, src, op=op)
            expect_equal(s.lib.to_numpy(out), mine, "output")
            expect_equal(s.lib.to_numpy(src), inputs[s.rank], "input (must be unchanged)")
        with s.case("reduce_scatter", dtype=dtype, op=op):
            pieces = [s.lib.make(p, dtype) for p in np.split(inputs[s.rank], ws)]
            out = s.lib.make(np.zeros(count, dtype.numpy), dtype)
            colls.reduce_scatter(out, pieces, op=op)
            expect_equal(s.lib.to_numpy(out), mine, "output")
            got = np.concatenate([s.lib.to_numpy(p) for p in pieces])
            expect_equal(got, inputs[s.rank], "input_list (must be unchanged)")
