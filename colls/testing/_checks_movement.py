"""Conformance checks of data movement: every root, uneven all-to-all, layouts and list forms.

Rooted collectives run once per root, with the root given as a world rank (``src=``/``dst=``) and
as a group rank (``group_src=``/``group_dst=``). Layout checks pass strided views (the result must
land in the caller's view and nowhere else) and check that contiguous arrays are written in place.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, Final

import numpy as np

import colls
from colls import dtypes
from colls.algorithms.select import ALGORITHMS
from colls.dtypes import DType
from colls.reduce_ops import ReduceOp
from colls.testing._checks_common import (
    LARGE_COUNT,
    ODD_COUNT,
    Suite,
    expect,
    expect_equal,
    reference,
)

#: Elements per rank in the rooted checks.
ROOTED_COUNT: Final = 5
#: Dtypes cycled through by root, so every root also sees a different element size.
ROOTED_DTYPES: Final = (dtypes.FLOAT64, dtypes.INT32, dtypes.BFLOAT16, dtypes.COMPLEX64)
#: Columns of the 2-D arrays of all_to_all_single: split sizes count rows, not elements.
A2A_COLUMNS: Final = 2


def _root_args(root: int, as_group_rank: bool, name: str) -> dict[str, int]:
    return {f"group_{name}" if as_group_rank else name: root}


def check_rooted(s: Suite) -> None:
    """broadcast, reduce, gather and scatter from every root, by src= and by group_src=."""
    for root in range(s.world_size):
        dtype = ROOTED_DTYPES[root % len(ROOTED_DTYPES)]
        for as_group_rank in (False, True):
            how = "group rank" if as_group_rank else "world rank"
            fields = {"dtype": dtype, "root": root, "root_given_as": how}
            inputs = s.inputs(dtype, ROOTED_COUNT, "rooted", root)
            with s.case("broadcast", **fields):
                array = s.lib.make(inputs[s.rank], dtype)
                colls.broadcast(array, **_root_args(root, as_group_rank, "src"))
                expect_equal(s.lib.to_numpy(array), inputs[root], "tensor")
            with s.case("reduce", op=ReduceOp.SUM, **fields):
                _reduce_case(s, dtype, root, as_group_rank, inputs)
            with s.case("gather", **fields):
                _gather_case(s, dtype, root, as_group_rank, inputs)
            with s.case("scatter", **fields):
                _scatter_case(s, dtype, root, as_group_rank)


def _reduce_case(s: Suite, dtype: DType, root: int, as_group_rank: bool,
                 inputs: list[np.ndarray]) -> None:
    array = s.lib.make(inputs[s.rank], dtype)
    colls.reduce(array, op=ReduceOp.SUM, **_root_args(root, as_group_rank, "dst"))
    if s.rank == root:
        expect_equal(s.lib.to_numpy(array), reference(ReduceOp.SUM, dtype, inputs), "root's tensor")
    else:
        expect_equal(s.lib.to_numpy(array), inputs[s.rank], "non-root tensor (must be unchanged)")


def _gather_case(s: Suite, dtype: DType, root: int, as_group_rank: bool,
                 inputs: list[np.ndarray]) -> None:
    outs = None
    if s.rank == root:
        outs = [s.lib.make(np.zeros(ROOTED_COUNT, dtype.numpy), dtype) for _ in inputs]
    colls.gather(s.lib.make(inputs[s.rank], dtype), outs, **_root_args(root, as_group_rank, "dst"))
    for r, out in enumerate(outs or []):
        expect_equal(s.lib.to_numpy(out), inputs[r], f"gather_list[{r}]")


def _scatter_case(s: Suite, dtype: DType, root: int, as_group_rank: bool) -> None:
    chunks = s.inputs(dtype, ROOTED_COUNT, "scatter", root)  # chunk r goes to rank r
    ins = [s.lib.make(c, dtype) for c in chunks] if s.rank == root else None
    out = s.lib.make(np.zeros(ROOTED_COUNT, dtype.numpy), dtype)
    colls.scatter(out, ins, **_root_args(root, as_group_rank, "src"))
    expect_equal(s.lib.to_numpy(out), chunks[s.rank], "tensor")


def _a2a_rows(src: int, dst: int) -> int:
    """Rows rank ``src`` sends rank ``dst`` in the uneven all_to_all_single (0, 1 or 2)."""
    return (src + 2 * dst) % 3


def _a2a_size(src: int, dst: int) -> int:
    """Elements rank ``src`` sends rank ``dst`` in the list all_to_all (0 to 3)."""
    return (3 * src + dst) % 4


def _payload(src: int, dst: int, count: int, columns: int = 1) -> np.ndarray:
    base = 1000.0 * src + 10.0 * dst
    values = base + np.arange(count * columns, dtype=np.float64) / 8
    return values.reshape(count, columns) if columns > 1 else values


def check_all_to_all_uneven(s: Suite) -> None:
    """all_to_all_single with uneven row splits (zeros included); list form with ragged sizes."""
    ws, me = s.world_size, s.rank
    dtype = dtypes.FLOAT64
    with s.case("all_to_all_single uneven splits", dtype=dtype):
        in_splits = [_a2a_rows(me, j) for j in range(ws)]
        out_splits = [_a2a_rows(j, me) for j in range(ws)]
        source = np.concatenate([_payload(me, j, in_splits[j], A2A_COLUMNS) for j in range(ws)])
        expected = np.concatenate([_payload(j, me, out_splits[j], A2A_COLUMNS)
                                   for j in range(ws)])
        out = s.lib.make(np.zeros((sum(out_splits), A2A_COLUMNS)), dtype)
        colls.all_to_all_single(out, s.lib.make(source, dtype), out_splits, in_splits)
        expect_equal(s.lib.to_numpy(out), expected,
                     f"output (input splits {in_splits}, output splits {out_splits})")
    with s.case("all_to_all ragged list", dtype=dtype):
        ins = [s.lib.make(_payload(me, j, _a2a_size(me, j)), dtype) for j in range(ws)]
        outs = [s.lib.make(np.zeros(_a2a_size(j, me)), dtype) for j in range(ws)]
        colls.all_to_all(outs, ins)
        for j, out in enumerate(outs):
            expect_equal(s.lib.to_numpy(out), _payload(j, me, _a2a_size(j, me)),
                         f"output_tensor_list[{j}]")


def check_layouts(s: Suite) -> None:
    """Strided views are reduced/broadcast into the view only; contiguous arrays in place."""
    layout_dtypes = (dtypes.FLOAT32, dtypes.INT64, dtypes.COMPLEX128, dtypes.BFLOAT16)
    for dtype in layout_dtypes[:2] if s.quick else layout_dtypes:
        inputs = s.inputs(dtype, 9, "strided", dtype.name)
        with s.case("all_reduce on a strided view", dtype=dtype, op=ReduceOp.SUM):
            view, base = s.lib.strided(inputs[s.rank], dtype)
            colls.all_reduce(view)
            expect_equal(s.lib.to_numpy(view), reference(ReduceOp.SUM, dtype, inputs), "view")
            if base is not None:
                gaps = s.lib.to_numpy(base)[1::2]
                expect_equal(gaps, np.zeros_like(gaps), "elements between the view's (untouched)")
        root = s.world_size - 1
        with s.case("broadcast on a strided view", dtype=dtype, root=root):
            view, base = s.lib.strided(inputs[s.rank], dtype)
            colls.broadcast(view, src=root)
            expect_equal(s.lib.to_numpy(view), inputs[root], "view")
            if base is not None:
                gaps = s.lib.to_numpy(base)[1::2]
                expect_equal(gaps, np.zeros_like(gaps), "elements between the view's (untouched)")
    with s.case("all_reduce writes into the caller's memory", dtype=dtypes.FLOAT32):
        inputs = s.inputs(dtypes.FLOAT32, 11, "zero-copy")
        array = s.lib.make(inputs[s.rank], dtypes.FLOAT32)
        address, alias = s.lib.address(array), s.lib.alias(array)
        colls.all_reduce(array)
        expected = reference(ReduceOp.SUM, dtypes.FLOAT32, inputs)
        expect(s.lib.address(array) == address, "the array moved to other memory")
        expect_equal(s.lib.to_numpy(alias), expected, "a view taken before the call")


#: Elements per rank (per block) in the aliasing checks.
ALIASED_COUNT: Final = 6


def check_aliasing(s: Suite) -> None:
    """An input that overlaps the output is read as it was before the call (torch allows it)."""
    dtype, k, n, me = dtypes.FLOAT32, ALIASED_COUNT, s.world_size, s.rank
    inputs = s.inputs(dtype, k * n, "aliased")
    with s.case("all_gather_into_tensor in place (input is this rank's slot of output)",
                dtype=dtype):
        words = np.zeros(k * n, dtype.numpy)
        words[me * k:(me + 1) * k] = inputs[me][:k]
        output = s.lib.make(words, dtype)
        colls.all_gather_into_tensor(output, output[me * k:(me + 1) * k])
        expect_equal(s.lib.to_numpy(output), np.concatenate([x[:k] for x in inputs]), "output")
    total = reference(ReduceOp.SUM, dtype, inputs)
    for where, block in (("this rank's block", me), ("the first block", 0)):
        with s.case(f"reduce_scatter_tensor into {where} of its input", dtype=dtype,
                    op=ReduceOp.SUM):
            data = s.lib.make(inputs[me], dtype)
            output = data[block * k:(block + 1) * k]
            colls.reduce_scatter_tensor(output, data)
            expect_equal(s.lib.to_numpy(output), total[me * k:(me + 1) * k], "output")
    with s.case("all_to_all_single(x, x)", dtype=dtype):
        x = s.lib.make(inputs[me], dtype)
        colls.all_to_all_single(x, x)
        expected = np.concatenate([inputs[j][me * k:(me + 1) * k] for j in range(n)])
        expect_equal(s.lib.to_numpy(x), expected, "x")


def check_multigpu(s: Suite) -> None:
    """The *_multigpu list forms with two arrays per process."""
    k, ws, count, dtype = 2, s.world_size, 3, dtypes.FLOAT64
    # Value of array i of rank r: distinct per (r, i) so misplaced arrays are caught.
    own = [np.full(count, 1.0 + 10 * s.rank + i) for i in range(k)]
    every = [[np.full(count, 1.0 + 10 * r + i) for i in range(k)] for r in range(ws)]
    total = sum(a for row in every for a in row)
    with s.case("all_reduce_multigpu", op=ReduceOp.SUM):
        arrays = [s.lib.make(a, dtype) for a in own]
        colls.all_reduce_multigpu(arrays)
        for i, a in enumerate(arrays):
            expect_equal(s.lib.to_numpy(a), total, f"tensor_list[{i}]")
    with s.case("all_reduce_multigpu(async_op=True)", op=ReduceOp.MAX):
        arrays = [s.lib.make(a, dtype) for a in own]
        work = colls.all_reduce_multigpu(arrays, op=ReduceOp.MAX, async_op=True)
        expect(work is not None, "all_reduce_multigpu(async_op=True) returned None")
        work.wait(timeout=30)
        for i, a in enumerate(arrays):
            expect_equal(s.lib.to_numpy(a), every[-1][-1], f"tensor_list[{i}]")
    root = ws - 1
    with s.case("broadcast_multigpu", root=root):
        arrays = [s.lib.make(a, dtype) for a in own]
        colls.broadcast_multigpu(arrays, src=root, src_tensor=1)
        for i, a in enumerate(arrays):
            expect_equal(s.lib.to_numpy(a), every[root][1], f"tensor_list[{i}]")
    with s.case("reduce_multigpu", root=root, op=ReduceOp.SUM):
        arrays = [s.lib.make(a, dtype) for a in own]
        colls.reduce_multigpu(arrays, dst=root, dst_tensor=0)
        expected = [total if s.rank == root else own[0], own[1]]
        for i, a in enumerate(arrays):
            expect_equal(s.lib.to_numpy(a), expected[i], f"tensor_list[{i}]")
    with s.case("all_gather_multigpu"):
        outs = [[s.lib.make(np.zeros(count), dtype) for _ in range(ws * k)] for _ in range(k)]
        colls.all_gather_multigpu(outs, [s.lib.make(a, dtype) for a in own])
        for i, out_list in enumerate(outs):
            for j, a in enumerate(out_list):
                expect_equal(s.lib.to_numpy(a), every[j // k][j % k],
                             f"output_tensor_lists[{i}][{j}]")
    with s.case("reduce_scatter_multigpu", op=ReduceOp.SUM):
        _reduce_scatter_multigpu_case(s, k, count, dtype)


def _reduce_scatter_multigpu_case(s: Suite, k: int, count: int, dtype: DType) -> None:
    ws = s.world_size

    def entry(r: int, lst: int, j: int) -> np.ndarray:  # input_tensor_lists[lst][j] of rank r
        return np.full(count, float(r + 3 * lst + 7 * j))

    lists = [[s.lib.make(entry(s.rank, lst, j), dtype) for j in range(ws * k)] for lst in range(k)]
    outs = [s.lib.make(np.zeros(count), dtype) for _ in range(k)]
    colls.reduce_scatter_multigpu(outs, lists)
    for i, out in enumerate(outs):
        j = s.rank * k + i
        expected = sum(entry(r, lst, j) for r in range(ws) for lst in range(k))
        expect_equal(s.lib.to_numpy(out), expected, f"output_tensor_list[{i}]")


@contextlib.contextmanager
def _forced(collective: str, algorithm: str) -> Iterator[None]:
    """Force ``algorithm`` for ``collective`` (COLLS_ALGORITHM is read at each call)."""
    old = os.environ.get("COLLS_ALGORITHM")
    os.environ["COLLS_ALGORITHM"] = f"{collective}={algorithm}"
    try:
        yield
    finally:
        if old is None:
            del os.environ["COLLS_ALGORITHM"]
        else:
            os.environ["COLLS_ALGORITHM"] = old


def check_each_algorithm(s: Suite) -> None:
    """Run each rooted or reducing collective under every algorithm colls.algorithms offers.

    A backend that overrides a collective ignores the forced choice; the results must hold anyway.
    """
    dtype, ws = dtypes.FLOAT32, s.world_size
    for count in (ODD_COUNT, LARGE_COUNT):
        inputs = s.inputs(dtype, count, "algorithms", count)
        root = count % ws
        runs: dict[str, Any] = {
            "all_reduce": lambda a, _root: colls.all_reduce(a),
            "broadcast": lambda a, root: colls.broadcast(a, src=root),
            "reduce": lambda a, root: colls.reduce(a, dst=root),
        }
        expected = {
            "all_reduce": reference(ReduceOp.SUM, dtype, inputs),
            "broadcast": inputs[root],
            "reduce": reference(ReduceOp.SUM, dtype, inputs) if s.rank == root else inputs[s.rank],
        }
        for collective, run in runs.items():
            for algorithm in ALGORITHMS[collective]:
                with s.case(collective, algorithm=algorithm, dtype=dtype, root=root, count=count):
                    array = s.lib.make(inputs[s.rank], dtype)
                    with _forced(collective, algorithm):
                        run(array, root)
                    expect_equal(s.lib.to_numpy(array), expected[collective], "result")
        _gather_algorithms(s, inputs, root, count)


def _gather_algorithms(s: Suite, inputs: list[np.ndarray], root: int, count: int) -> None:
    dtype = dtypes.FLOAT32
    for algorithm in ALGORITHMS["all_gather"]:
        with s.case("all_gather_into_tensor", algorithm=algorithm, count=count):
            out = s.lib.make(np.zeros(count * s.world_size, np.float32), dtype)
            with _forced("all_gather", algorithm):
                colls.all_gather_into_tensor(out, s.lib.make(inputs[s.rank], dtype))
            expect_equal(s.lib.to_numpy(out), np.concatenate(inputs), "output_tensor")
    for algorithm in ALGORITHMS["gather"]:
        with s.case("gather", algorithm=algorithm, root=root, count=count):
            _forced_gather(s, inputs, root, algorithm)
    for algorithm in ALGORITHMS["scatter"]:
        with s.case("scatter", algorithm=algorithm, root=root, count=count):
            out = s.lib.make(np.zeros(count, np.float32), dtype)
            ins = [s.lib.make(a, dtype) for a in inputs] if s.rank == root else None
            with _forced("scatter", algorithm):
                colls.scatter(out, ins, src=root)
            expect_equal(s.lib.to_numpy(out), inputs[s.rank], "tensor")


def _forced_gather(s: Suite, inputs: list[np.ndarray], root: int, algorithm: str) -> None:
    dtype = dtypes.FLOAT32
    outs = None
    if s.rank == root:
        outs = [s.lib.make(np.zeros_like(a), dtype) for a in inputs]
    with _forced("gather", algorithm):
        colls.gather(s.lib.make(inputs[s.rank], dtype), outs, dst=root)
    for r, out in enumerate(outs or []):
        expect_equal(s.lib.to_numpy(out), inputs[r], f"gather_list[{r}]")
