"""The tcp backend's flat shared-memory all_reduce (one phase, every rank folds every slot).

Tests that take ``shm_path`` run twice: on the compiled hot loop, whose one-piece sums and
products fold in C (``slot_post``/``slot_fold``), and on the pure-Python one (NumPy's kernels).
Both must give NumPy's rank-order bits.
"""

from __future__ import annotations

import numpy as np
import pytest
from _support import on_threads
from tcp_helpers import NEEDS_SHM
from test_shm_tiny import _fold_inputs, _reduce, _reference

from colls import dtypes, fingerprint
from colls.errors import BackendError
from colls.reduce_ops import ReduceOp, resolve_op
from colls_plugins.tcp.shm import collectives as shm_collectives
from colls_plugins.tcp.shm import segment as shm_segment
from colls_plugins.tcp.shm import tiny as shm_tiny

pytestmark = NEEDS_SHM

FOLDED = [dtypes.FLOAT32, dtypes.FLOAT64, dtypes.INT32, dtypes.INT64]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PRODUCT], ids=["sum", "product"])
@pytest.mark.parametrize("dtype", FOLDED, ids=lambda d: d.name)
def test_flat_sums_and_products_are_bitwise_numpys_rank_order_reduction(group, shm_path, op,
                                                                        dtype):
    """Just above the tiny line, a few KiB, and the largest flat call, on three ranks."""
    largest = shm_collectives.FLAT_MAX_BYTES // dtype.itemsize
    for count in (shm_segment.TINY_BYTES // dtype.itemsize + 1, 1000, largest):
        inputs = _fold_inputs(dtype, count, 3)
        assert not shm_tiny.fits(inputs[0]) and inputs[0].nbytes <= shm_collectives.FLAT_MAX_BYTES
        expected = _reference(inputs, op, dtype)
        for result in _reduce(group, f"flat-{dtype.name}-{op}-{count}", inputs, op, dtype):
            assert result.tobytes() == expected.tobytes()


@pytest.mark.timeout(60)
def test_flat_float_overflow_nan_and_signed_zero_are_numpys(group, shm_path):
    big = np.finfo(np.float64).max
    inputs = [np.array([big, 1.0, np.nan, -0.0] * 64), np.array([big, np.inf, 1.0, -0.0] * 64)]
    expected = _reference(inputs, ReduceOp.SUM, dtypes.FLOAT64)
    for result in _reduce(group, "flat-ieee", inputs, ReduceOp.SUM, dtypes.FLOAT64):
        assert result.tobytes() == expected.tobytes()
    assert np.isinf(expected[0]) and np.isnan(expected[2]) and np.signbit(expected[3])


@pytest.mark.timeout(60)
def test_an_unaligned_array_is_folded_right(group, shm_path):
    """NumPy allows unaligned arrays; the C fold reads and writes them byte-wise."""
    count = 300
    inputs = []
    for r in range(2):
        raw = np.zeros(count * 8 + 1, np.uint8)
        unaligned = raw[1:].view(np.float64)  # one byte off an 8-byte boundary
        unaligned[:] = np.arange(count) * (r + 1) + 0.25
        inputs.append(unaligned)
    assert not inputs[0].flags.aligned
    backends = group(2, name="flat-unaligned")
    spec = resolve_op(ReduceOp.SUM, dtypes.FLOAT64, op_name="all_reduce")
    on_threads(lambda r: backends[r].all_reduce(inputs[r], spec, -1), 2)
    expected = np.arange(count) * 3 + 0.5
    for result in inputs:
        np.testing.assert_array_equal(result, expected)


@pytest.mark.timeout(60)
def test_mismatched_flat_calls_raise_naming_the_peer_and_leave_the_arrays(group, shm_path):
    backends = group(2, name="flat-mismatch")
    arrays = [np.full(100, 3.0), np.full(200, 5.0)]  # both flat, different signatures
    tags = [fingerprint.collective_tag(0, fingerprint.CallRecord(
        "all_reduce", "float64", a.shape, None, "SUM").signature()) for a in arrays]
    spec = resolve_op(ReduceOp.SUM, dtypes.FLOAT64, op_name="all_reduce")

    def body(rank):
        with pytest.raises(BackendError, match=f"rank {rank}: all_reduce \\(shm flat\\): "
                           f"mismatched collectives: .* on rank {1 - rank}"):
            backends[rank].all_reduce(arrays[rank], spec, tags[rank])
        return bool(np.all(arrays[rank] == (3.0 if rank == 0 else 5.0)))

    assert on_threads(body, 2) == [True, True]
