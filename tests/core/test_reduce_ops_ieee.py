"""Reductions give IEEE results without a word, as torch does: no NumPy floating-point warning.

Every floating and complex dtype, every op that computes on them, inputs that overflow to inf,
make NaN (inf - inf, 0 * inf), underflow to zero or divide a subnormal into zero. Each case runs
the kernels a collective runs (``prepare`` on every contribution, ``combine``, ``finish``)
with warnings turned into errors and the caller's NumPy error state at its strictest, so a
single warning or FloatingPointError from inside colls fails the test. Expected values are
written out here, from IEEE 754 (round to nearest, overflow to a signed inf, invalid to NaN).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from colls import dtypes
from colls.dtypes import DType
from colls.reduce_ops import RedOpType, make_premul_sum, resolve_op

INF, NAN = math.inf, math.nan
REAL = (dtypes.FLOAT16, dtypes.BFLOAT16, dtypes.FLOAT32, dtypes.FLOAT64)
COMPLEX = (dtypes.COMPLEX64, dtypes.COMPLEX128)


def biggest(dtype: DType) -> float:
    """The largest finite value of a real dtype (bfloat16: 0x7F7F)."""
    if dtype is dtypes.BFLOAT16:
        return float(dtypes.bf16_to_float32(np.array([0x7F7F], dtype=np.uint16))[0])
    return float(np.finfo(dtype.numpy).max)


def smallest_subnormal(dtype: DType) -> float:
    """The smallest positive value of a real dtype (bfloat16: 0x0001)."""
    if dtype is dtypes.BFLOAT16:
        return float(dtypes.bf16_to_float32(np.array([1], dtype=np.uint16))[0])
    return float(np.finfo(dtype.numpy).smallest_subnormal)


def holding(values: list[complex] | list[float], dtype: DType) -> np.ndarray:
    """The values in the dtype's holding type (bfloat16 as words); all are exact in it."""
    if dtype is dtypes.BFLOAT16:
        return dtypes.float32_to_bf16(np.array(values, dtype=np.float32))
    return np.array(values, dtype=dtype.numpy)


def as_wide(array: np.ndarray, dtype: DType) -> np.ndarray:
    if dtype is dtypes.BFLOAT16:
        return dtypes.bf16_to_float32(array).astype(np.float64)
    return array.astype(np.complex128 if dtype.is_complex else np.float64)


def reduce_strictly(op: object, dtype: DType, per_rank: list[list[float]]) -> np.ndarray:
    """Run the kernels over the ranks' contributions with every warning an error."""
    spec = resolve_op(op, dtype, op_name="all_reduce", rank=0)
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        contributions = [holding(values, dtype) for values in per_rank]
        acc = contributions[0].copy()
        spec.prepare(acc)
        for other in contributions[1:]:
            other = other.copy()
            spec.prepare(other)
            spec.combine(acc, other)
        spec.finish(acc, len(per_rank))
        reference = spec.numpy_reference(contributions)
    np.testing.assert_array_equal(acc, reference)
    return as_wide(acc, dtype)


def assert_ieee(got: np.ndarray, expected: list[complex] | list[float]) -> None:
    want = np.array(expected, dtype=got.dtype)
    assert np.array_equal(got, want, equal_nan=True), f"got {got}, IEEE says {want}"
    numbers = ~np.isnan(want.real)  # a NaN's sign is not specified; an inf's and a zero's are
    assert np.array_equal(np.signbit(got.real[numbers]), np.signbit(want.real[numbers])), (
        got, want)


def real_cases(dtype: DType) -> list[tuple[str, object, list[list[float]], list[float]]]:
    """(case, op, per-rank values, IEEE result) for a real dtype."""
    big, tiny = biggest(dtype), smallest_subnormal(dtype)
    return [
        ("sum overflows", RedOpType.SUM, [[big, -big, INF], [big, -big, -INF]],
         [INF, -INF, NAN]),
        ("avg overflows, then divides", RedOpType.AVG, [[big, -big, INF], [big, -big, -INF]],
         [INF, -INF, NAN]),
        ("avg divides a subnormal into zero", RedOpType.AVG, [[tiny], [0.0], [0.0]], [0.0]),
        ("product overflows and underflows", RedOpType.PRODUCT,
         [[big, big, tiny, INF], [2.0, -2.0, tiny, 0.0]], [INF, -INF, 0.0, NAN]),
        ("min and max keep NaN and inf", RedOpType.MIN, [[NAN, INF, 1.0], [1.0, -INF, NAN]],
         [NAN, -INF, NAN]),
        ("max keeps NaN and inf", RedOpType.MAX, [[NAN, INF, 1.0], [1.0, -INF, NAN]],
         [NAN, INF, NAN]),
        ("premul_sum's factor overflows", make_premul_sum(4.0), [[big, 1.0], [0.0, -INF]],
         [INF, -INF]),
        ("premul_sum by inf makes NaN of zero", make_premul_sum(INF), [[0.0, 1.0], [1.0, 1.0]],
         [NAN, INF]),
    ]


def complex_cases(dtype: DType) -> list[tuple[str, object, list[list[complex]], list[complex]]]:
    big = float(np.finfo(dtype.numpy).max)
    return [
        ("sum overflows", RedOpType.SUM, [[complex(big, -big)], [complex(big, -big)]],
         [complex(INF, -INF)]),
        ("avg overflows, then divides", RedOpType.AVG, [[complex(big, 1.0)], [complex(big, 1.0)]],
         [complex(INF, 1.0)]),
        ("product of inf and zero", RedOpType.PRODUCT, [[complex(INF, 0.0)], [complex(0.0, 0.0)]],
         [complex(NAN, NAN)]),
        ("premul_sum overflows", make_premul_sum(4.0), [[complex(big, 0.0)], [complex(0.0, 0.0)]],
         [complex(INF, 0.0)]),
        ("complex premul_sum overflows", make_premul_sum(2j),
         [[complex(big, big)], [complex(0.0, 0.0)]], [complex(-INF, INF)]),
    ]


CASES = [
    pytest.param(dtype, op, per_rank, expected, id=f"{dtype.name}-{case}")
    for dtypes_, make in ((REAL, real_cases), (COMPLEX, complex_cases))
    for dtype in dtypes_
    for case, op, per_rank, expected in make(dtype)
]


@pytest.mark.parametrize("dtype, op, per_rank, expected", CASES)
def test_reductions_are_ieee_and_silent(dtype, op, per_rank, expected):
    try:
        got = reduce_strictly(op, dtype, per_rank)
    except (RuntimeWarning, FloatingPointError) as exc:
        pytest.fail(f"colls signalled {exc!r}")
    if op is RedOpType.PRODUCT and dtype.is_complex:  # C99 Annex G: (inf+0j) * 0j is NaN,
        assert np.isnan(got.real).all() or np.isnan(got.imag).all(), got  # in either part
        return
    assert_ieee(got, expected)


def test_the_callers_error_state_is_left_as_it_was():
    spec = resolve_op(RedOpType.SUM, dtypes.FLOAT32, op_name="all_reduce")
    big = np.full(2, np.finfo(np.float32).max, dtype=np.float32)
    with np.errstate(all="raise"):
        spec.combine(big, big.copy())
        assert np.geterr() == {"divide": "raise", "over": "raise", "under": "raise",
                               "invalid": "raise"}
        with pytest.raises(FloatingPointError):
            np.add(np.float32(3e38), np.float32(3e38))


def test_integer_reductions_wrap_silently():
    spec = resolve_op(RedOpType.SUM, dtypes.INT8, op_name="all_reduce")
    acc = np.array([127, -128], dtype=np.int8)
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        spec.combine(acc, np.array([1, -1], dtype=np.int8))
    np.testing.assert_array_equal(acc, np.array([-128, 127], dtype=np.int8))
