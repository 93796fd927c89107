"""all_reduce, reduce and reduce_scatter against NumPy, for every algorithm, world size and root."""

from __future__ import annotations

import numpy as np
import pytest
from alg_data import COUNTS, DTYPES, TAG, WORLD_SIZES, equal, make, reference, run, spec

pytestmark = pytest.mark.timeout(120)


def _all_reduce(n: int, count: int, dtype: str = "float32", op: str = "sum") -> None:
    inputs = [make(dtype, count, r) for r in range(n)]
    reduce_op = spec(op, dtype)

    def fn(comm):
        array = inputs[comm.rank].copy()
        comm.all_reduce(array, reduce_op, TAG)
        return array

    expected = reference(reduce_op, inputs)
    for rank, result in enumerate(run(n, fn)):
        equal(result, expected, f"all_reduce n={n} count={count} {dtype} {op} rank {rank}")


def _reduce(n: int, count: int, root: int, dtype: str = "float32", op: str = "sum") -> None:
    inputs = [make(dtype, count, r) for r in range(n)]
    reduce_op = spec(op, dtype)

    def fn(comm):
        array = inputs[comm.rank].copy()
        comm.reduce(array, root, reduce_op, TAG)
        return array

    results = run(n, fn)
    what = f"reduce n={n} count={count} root={root} {dtype} {op}"
    equal(results[root], reference(reduce_op, inputs), what)
    for rank in range(n):
        if rank != root:
            equal(results[rank], inputs[rank], f"{what}: non-root rank {rank} changed")


def _reduce_scatter(n: int, per_rank: int, dtype: str = "float32", op: str = "sum") -> None:
    inputs = [make(dtype, n * per_rank, r) for r in range(n)]
    reduce_op = spec(op, dtype)

    def fn(comm):
        source = inputs[comm.rank].copy()
        output = np.full(per_rank, 3, dtype=source.dtype)
        comm.reduce_scatter(output, source, reduce_op, TAG)
        return output, source

    expected = reference(reduce_op, inputs)
    for rank, (output, source) in enumerate(run(n, fn)):
        what = f"reduce_scatter n={n} per_rank={per_rank} {dtype} rank {rank}"
        equal(output, expected[rank * per_rank : (rank + 1) * per_rank], what)
        equal(source, inputs[rank], f"{what}: input changed")


@pytest.mark.parametrize("algorithm", ["recursive_doubling", "ring"])
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_reduce(force, algorithm, n):
    force("all_reduce", algorithm)
    for count in COUNTS:
        _all_reduce(n, count)


@pytest.mark.parametrize("algorithm", ["binomial", "ring"])
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_reduce_every_root(force, algorithm, n):
    force("reduce", algorithm)
    for count in COUNTS:
        for root in range(n):
            _reduce(n, count, root)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_reduce_scatter(n):
    for per_rank in (0, 1, 5, 26):
        _reduce_scatter(n, per_rank)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algorithm", ["recursive_doubling", "ring"])
def test_all_reduce_dtypes(force, algorithm, dtype):
    force("all_reduce", algorithm)
    _all_reduce(5, 37, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_and_reduce_scatter_dtypes(force, dtype):
    for algorithm in ("binomial", "ring"):
        force("reduce", algorithm)
        _reduce(5, 37, 3, dtype)
    _reduce_scatter(5, 9, dtype)


@pytest.mark.parametrize(
    ("op", "dtype"),
    [("max", "float32"), ("min", "int32"), ("product", "int64"), ("bxor", "uint8"),
     ("band", "bool"), ("max", "bfloat16")],
)
def test_other_ops(force, op, dtype):
    for algorithm in ("recursive_doubling", "ring"):
        force("all_reduce", algorithm)
        _all_reduce(6, 29, dtype, op)
    force("reduce", "ring")
    _reduce(6, 29, 4, dtype, op)
    _reduce_scatter(6, 5, dtype, op)


def test_default_selection_large_messages(monkeypatch):
    """Without an override, a message above the threshold takes the ring paths."""
    monkeypatch.setenv("COLLS_SMALL_MESSAGE_BYTES", "64")
    for n in (3, 4):
        _all_reduce(n, 101)
        _reduce(n, 101, n - 1)
