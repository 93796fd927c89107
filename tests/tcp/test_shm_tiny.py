"""The tcp backend's tiny all_reduce through the control page (colls_plugins.tcp.shm.tiny).

Tests that take ``shm_path`` run twice: on the compiled hot loop and on the pure-Python one.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import shm_tiny_workers
from _support import on_threads
from tcp_helpers import NEEDS_SHM, NOT_BUILT

from colls import dtypes, fingerprint
from colls.errors import BackendError
from colls.reduce_ops import ReduceOp, resolve_op
from colls.testing.spawn import spawn
from colls_plugins.tcp.shm import native as shm_native
from colls_plugins.tcp.shm import segment as shm_segment
from colls_plugins.tcp.shm import tiny as shm_tiny

pytestmark = NEEDS_SHM


def _reduce(group, name: str, inputs: list[np.ndarray], op: ReduceOp, dtype: dtypes.DType,
            tag: int = -1) -> list[np.ndarray]:
    """all_reduce ``inputs`` (one per rank) on a fresh shm group; return every rank's result."""
    world = len(inputs)
    backends = group(world, name=name)
    assert all(b.uses_shm for b in backends)
    native = os.environ.get("COLLS_NATIVE") != "0" and shm_native.built()
    assert all((b._shm.native is not None) == native for b in backends)
    spec = resolve_op(op, dtype, op_name="all_reduce")
    arrays = [a.copy() for a in inputs]
    on_threads(lambda r: backends[r].all_reduce(arrays[r], spec, tag), world)
    return arrays


def _reference(inputs: list[np.ndarray], op: ReduceOp, dtype: dtypes.DType) -> np.ndarray:
    return resolve_op(op, dtype, op_name="all_reduce").numpy_reference(inputs)


def _fold_inputs(dtype: dtypes.DType, count: int, world: int) -> list[np.ndarray]:
    """Random non-integral floats (every rounding step shows), or integers over the whole range
    of the type (sums and products wrap, as NumPy's do)."""
    rng = np.random.default_rng(7)
    if dtype.numpy.kind == "f":
        return [(rng.standard_normal(count) * 1e3).astype(dtype.numpy) for _ in range(world)]
    info = np.iinfo(dtype.numpy)
    return [rng.integers(info.min, info.max, count, dtype=dtype.numpy, endpoint=True)
            for _ in range(world)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PRODUCT], ids=["sum", "product"])
@pytest.mark.parametrize("dtype", [dtypes.FLOAT32, dtypes.FLOAT64, dtypes.INT32, dtypes.INT64],
                         ids=lambda d: d.name)
def test_the_fold_is_bitwise_numpys_rank_order_reduction(group, shm_path, op, dtype):
    """Every (dtype, op) the fold covers, on three ranks, compared byte for byte."""
    full = shm_segment.TINY_BYTES // dtype.itemsize
    for count in (1, full):  # one element, and a full line
        inputs = _fold_inputs(dtype, count, 3)
        assert (op.name, dtype) in shm_tiny.FOLDS and shm_tiny.fits(inputs[0])
        expected = _reference(inputs, op, dtype)
        for result in _reduce(group, f"fold-{dtype.name}-{op}-{count}", inputs, op, dtype):
            assert result.tobytes() == expected.tobytes()


@pytest.mark.timeout(60)
def test_float32_overflow_gives_inf_and_nan_propagates_as_in_numpy(group, shm_path):
    big = np.finfo(np.float32).max
    inputs = [np.array([big, 1.0, np.nan, -0.0], np.float32),
              np.array([big, np.inf, 1.0, -0.0], np.float32)]
    expected = _reference(inputs, ReduceOp.SUM, dtypes.FLOAT32)
    for result in _reduce(group, "ieee", inputs, ReduceOp.SUM, dtypes.FLOAT32):
        assert result.tobytes() == expected.tobytes()
    assert np.isinf(expected[0]) and np.isnan(expected[2]) and np.signbit(expected[3])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [dtypes.INT32, dtypes.INT64], ids=lambda d: d.name)
def test_integer_overflow_wraps_as_in_numpy(group, shm_path, dtype):
    """The fold's store refuses an out-of-range integer; the NumPy kernel then wraps it."""
    top = np.iinfo(dtype.numpy).max
    inputs = [np.array([top, 5, -3], dtype.numpy), np.array([1, 7, -4], dtype.numpy),
              np.array([top, 1, 2], dtype.numpy)]
    expected = _reference(inputs, ReduceOp.SUM, dtype)
    assert expected[0] == np.array(top, dtype.numpy) + np.array(1, dtype.numpy) + top  # wrapped
    for result in _reduce(group, f"wrap-{dtype.name}", inputs, ReduceOp.SUM, dtype):
        np.testing.assert_array_equal(result, expected)
    # out of range only in between: the Python fold's exact sum is NumPy's wrapped one
    inputs = [np.array([top], dtype.numpy), np.array([1], dtype.numpy),
              np.array([-5], dtype.numpy)]
    for result in _reduce(group, f"between-{dtype.name}", inputs, ReduceOp.SUM, dtype):
        np.testing.assert_array_equal(result, [top - 4])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("op", "dtype"),
    [(ReduceOp.MIN, dtypes.FLOAT32), (ReduceOp.MAX, dtypes.INT64), (ReduceOp.SUM, dtypes.COMPLEX64),
     (ReduceOp.SUM, dtypes.FLOAT16), (ReduceOp.BXOR, dtypes.UINT8), (ReduceOp.SUM, dtypes.BOOL)],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_ops_and_dtypes_without_a_fold_use_numpys_kernel(group, op, dtype):
    assert (op.name, dtype) not in shm_tiny.FOLDS
    rng = np.random.default_rng(3)
    count = shm_segment.TINY_BYTES // dtype.itemsize
    inputs = [rng.integers(0, 4, count).astype(dtype.numpy) for _ in range(3)]
    if dtype is dtypes.FLOAT32:
        inputs[1][0] = np.nan  # np.minimum propagates it
    expected = _reference(inputs, op, dtype)
    for result in _reduce(group, f"numpy-{dtype.name}", inputs, op, dtype):
        assert result.tobytes() == expected.tobytes()


@pytest.mark.timeout(60)
def test_sizes_around_the_tiny_limit_are_right(group):
    """TINY_BYTES goes through the control page, one element more through a slot."""
    count = shm_segment.TINY_BYTES // 4
    for extra in (0, 1):
        inputs = [np.arange(count + extra, dtype=np.float32) * (r + 1) for r in range(2)]
        assert shm_tiny.fits(inputs[0]) == (extra == 0)
        for result in _reduce(group, f"edge-{extra}", inputs, ReduceOp.SUM, dtypes.FLOAT32):
            np.testing.assert_array_equal(result, inputs[0] * 3)


@pytest.mark.timeout(60)
def test_mismatched_tiny_calls_raise_naming_the_peer(group, shm_path):
    backends = group(2, name="tiny-mismatch")
    assert (backends[0]._shm.native is not None) == shm_path
    arrays = [np.zeros(1), np.zeros(2)]  # 8 and 16 bytes: both tiny, different signatures
    tags = [fingerprint.collective_tag(0, fingerprint.CallRecord(
        "all_reduce", "float64", a.shape, None, "SUM").signature()) for a in arrays]
    spec = resolve_op(ReduceOp.SUM, dtypes.FLOAT64, op_name="all_reduce")

    def body(rank):
        with pytest.raises(BackendError, match=f"rank {rank}: all_reduce \\(shm, tiny\\): "
                           f"mismatched collectives: .* on rank {1 - rank}"):
            backends[rank].all_reduce(arrays[rank], spec, tags[rank])
        return True

    assert on_threads(body, 2) == [True, True]


@pytest.mark.timeout(120)
def test_back_to_back_tiny_calls_between_processes_never_read_a_rewritten_line(shm_path):
    """Three processes, 1500 tiny all_reduces mixed with barriers and broadcasts."""
    checked = spawn(shm_tiny_workers.interleaved, 3, args=(1500, shm_path),
                    env={"COLLS_NATIVE": str(int(shm_path))}, timeout=90)
    assert checked == [1500, 1500, 1500]


@pytest.mark.timeout(120)
def test_ranks_on_the_compiled_and_the_python_hot_loop_work_together():
    """Three processes, ranks 0 and 2 compiled, rank 1 in Python: every result checked."""
    if not shm_native.built():
        pytest.skip(NOT_BUILT)
    checked = spawn(shm_tiny_workers.interleaved_mixed, 3, args=(600,), backend=None,
                    timeout=90)
    assert checked == [600, 600, 600]
