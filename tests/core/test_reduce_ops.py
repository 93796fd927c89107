"""Tests for colls.reduce_ops: every dtype x every op against independent references."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from colls import dtypes
from colls.dtypes import DTYPES, DType
from colls.reduce_ops import (
    PremulSum,
    RedOpType,
    ReduceOp,
    ReduceSpec,
    make_premul_sum,
    resolve_op,
)
from colls.testing.arrays import random_array

OPS = list(RedOpType)
FACTOR = 0.5  # exact in every floating dtype, so PREMUL_SUM results stay exact
INTEGERS = ("int", "uint")


def allowed(kind: RedOpType, dtype: DType) -> bool:
    """The dtype rules as torch states them, written independently of reduce_ops."""
    if kind in (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR):
        return dtype.kind in ("bool", *INTEGERS)
    if kind in (RedOpType.MIN, RedOpType.MAX):
        return not dtype.is_complex
    if kind in (RedOpType.AVG, RedOpType.PREMUL_SUM):
        return dtype.is_floating or dtype.is_complex
    return True


def spec_for(kind: RedOpType, dtype: DType) -> ReduceSpec:
    op = make_premul_sum(FACTOR) if kind is RedOpType.PREMUL_SUM else kind
    return resolve_op(op, dtype, op_name="all_reduce", rank=0)


def to_exact(words: np.ndarray, dtype: DType) -> np.ndarray:
    """Per-element values as float64/complex128 (floats) or Python ints (integers)."""
    if dtype is dtypes.BFLOAT16:
        return dtypes.bf16_to_float32(words).astype(np.float64)
    if dtype.is_complex:
        return words.astype(np.complex128)
    if dtype.is_floating:
        return words.astype(np.float64)
    return words.astype(object)  # Python ints: no overflow, so wrapping is checked for real


def from_exact(values: np.ndarray, dtype: DType) -> np.ndarray:
    """Round/wrap exact values back to the dtype's holding type."""
    if dtype is dtypes.BFLOAT16:
        return dtypes.float32_to_bf16(values.astype(np.float32))
    if dtype.kind in INTEGERS:
        bits = dtype.itemsize * 8
        wrapped = np.array([int(v) % (1 << bits) for v in values], dtype=object)
        if dtype.kind == "int":
            wrapped = np.array([v - (1 << bits) if v >= 1 << (bits - 1) else v for v in wrapped])
        return np.array(list(wrapped), dtype=np.int64 if dtype.kind == "int" else np.uint64).astype(
            dtype.numpy
        )
    return values.astype(dtype.numpy)


def expected_reduction(kind: RedOpType, dtype: DType, arrays: list[np.ndarray]) -> np.ndarray:
    """Reduce exactly (test values keep every intermediate exact), then round once."""
    if dtype is dtypes.BOOL:
        stack = np.stack(arrays)
        if kind in (RedOpType.SUM, RedOpType.MAX, RedOpType.BOR):
            return stack.any(axis=0)
        if kind in (RedOpType.PRODUCT, RedOpType.MIN, RedOpType.BAND):
            return stack.all(axis=0)
        return stack.sum(axis=0) % 2 == 1  # BXOR
    exact = [to_exact(a, dtype) for a in arrays]
    if kind is RedOpType.PREMUL_SUM:
        exact = [e * FACTOR for e in exact]
    result = exact[0].copy()
    for other in exact[1:]:
        if kind in (RedOpType.SUM, RedOpType.AVG, RedOpType.PREMUL_SUM):
            result = result + other
        elif kind is RedOpType.PRODUCT:
            result = result * other
        elif kind is RedOpType.MIN:
            result = np.array([min(pair) for pair in zip(result, other, strict=True)])
        elif kind is RedOpType.MAX:
            result = np.array([max(pair) for pair in zip(result, other, strict=True)])
        elif kind is RedOpType.BAND:
            result = np.array([a & b for a, b in zip(result, other, strict=True)], dtype=object)
        elif kind is RedOpType.BOR:
            result = np.array([a | b for a, b in zip(result, other, strict=True)], dtype=object)
        else:
            result = np.array([a ^ b for a, b in zip(result, other, strict=True)], dtype=object)
    if kind is RedOpType.AVG and dtype.is_complex:  # part by part: exactly rounded
        result = result.real / len(arrays) + 1j * (result.imag / len(arrays))
    elif kind is RedOpType.AVG:
        result = result / len(arrays)
    return from_exact(result, dtype)


CASES = [(k, d) for d in DTYPES for k in OPS if allowed(k, d)]
FORBIDDEN = [(k, d) for d in DTYPES for k in OPS if not allowed(k, d)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize(("kind", "dtype"), CASES, ids=lambda x: getattr(x, "name", x))
def test_reduction_matches_exact_reference(kind: RedOpType, dtype: DType, world_size: int) -> None:
    rng = np.random.default_rng(world_size * 100 + kind.value)
    arrays = [random_array(dtype, 37, rng) for _ in range(world_size)]
    originals = [a.copy() for a in arrays]
    spec = spec_for(kind, dtype)

    acc = arrays[0]
    spec.prepare(acc)
    for other in arrays[1:]:
        spec.prepare(other)
        spec.combine(acc, other)
    spec.finish(acc, world_size)

    expected = expected_reduction(kind, dtype, originals)
    assert acc.dtype == dtype.numpy
    np.testing.assert_array_equal(acc, expected)
    np.testing.assert_array_equal(spec.numpy_reference(originals), expected)

    # combine_all: the same reduction in one call (a host's flat shared-memory reduction)
    together, rest = originals[0].copy(), [a.copy() for a in originals[1:]]
    for array in (together, *rest):
        spec.prepare(array)
    spec.combine_all(together, rest)
    spec.finish(together, world_size)
    np.testing.assert_array_equal(together, expected)


@pytest.mark.parametrize("dtype", [dtypes.FLOAT16, dtypes.BFLOAT16, dtypes.FLOAT32,
                                   dtypes.COMPLEX64], ids=lambda d: d.name)
def test_combine_all_overflows_to_inf_silently(dtype: DType) -> None:
    """Like combine, it computes under the IEEE error state: no warning, no raise (torch's)."""
    spec = spec_for(RedOpType.SUM, dtype)
    big = dtypes.float32_to_bf16(np.full(4, 3e38, np.float32)) if dtype is dtypes.BFLOAT16 \
        else np.full(4, np.finfo(dtype.numpy).max, dtype.numpy)
    acc = big.copy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec.combine_all(acc, [big, big])
    values = dtypes.bf16_to_float32(acc) if dtype is dtypes.BFLOAT16 else acc
    assert np.all(np.isinf(values.real))


@pytest.mark.parametrize(("kind", "dtype"), CASES, ids=lambda x: getattr(x, "name", x))
def test_combine_is_in_place_and_leaves_other_alone(kind: RedOpType, dtype: DType) -> None:
    rng = np.random.default_rng(3)
    acc, other = random_array(dtype, 16, rng), random_array(dtype, 16, rng)
    other_before = other.copy()
    buffer_address = acc.ctypes.data
    spec_for(kind, dtype).combine(acc, other)
    assert acc.ctypes.data == buffer_address
    np.testing.assert_array_equal(other, other_before)


@pytest.mark.parametrize(("kind", "dtype"), FORBIDDEN, ids=lambda x: getattr(x, "name", x))
def test_forbidden_combinations_raise_before_anything(kind: RedOpType, dtype: DType) -> None:
    op = make_premul_sum(FACTOR) if kind is RedOpType.PREMUL_SUM else kind
    with pytest.raises(TypeError) as info:
        resolve_op(op, dtype, op_name="reduce_scatter", rank=3)
    message = str(info.value)
    assert message.startswith("reduce_scatter on rank 3: ")
    assert f"ReduceOp.{kind.name}" in message and dtype.name in message


def test_rule_messages_say_what_is_allowed() -> None:
    with pytest.raises(TypeError, match="bitwise ops need a bool or integer dtype"):
        resolve_op(ReduceOp.BAND, dtypes.FLOAT32, op_name="all_reduce")
    with pytest.raises(TypeError, match="complex numbers are not ordered"):
        resolve_op(ReduceOp.MAX, dtypes.COMPLEX64, op_name="all_reduce")
    with pytest.raises(TypeError, match="needs a floating point or complex dtype"):
        resolve_op(ReduceOp.AVG, dtypes.INT32, op_name="all_reduce")
    with pytest.raises(TypeError, match=r"^all_reduce: ReduceOp.AVG is not defined for bool"):
        resolve_op("avg", dtypes.BOOL, op_name="all_reduce")


def test_bare_premul_sum_needs_a_factor() -> None:
    with pytest.raises(ValueError, match=r"pass make_premul_sum\(factor\)"):
        resolve_op(ReduceOp.PREMUL_SUM, dtypes.FLOAT32, op_name="all_reduce", rank=1)


def test_complex_factor_needs_complex_dtype() -> None:
    with pytest.raises(TypeError, match="is complex but the dtype is float32"):
        resolve_op(make_premul_sum(1 + 2j), dtypes.FLOAT32, op_name="all_reduce")
    spec = resolve_op(make_premul_sum(1j), dtypes.COMPLEX64, op_name="all_reduce")
    data = np.array([1 + 1j, 2], np.complex64)
    spec.prepare(data)
    np.testing.assert_array_equal(data, [-1 + 1j, 2j])


@pytest.mark.parametrize("bad", ["mean", "", 3, None, object()])
def test_unknown_op_names_accepted_ones(bad: object) -> None:
    with pytest.raises(TypeError, match="unknown reduce op") as info:
        resolve_op(bad, dtypes.FLOAT32, op_name="all_reduce", rank=0)
    assert "ReduceOp.SUM" in str(info.value) and "make_premul_sum" in str(info.value)


@pytest.mark.parametrize(
    ("name", "kind"),
    [("sum", RedOpType.SUM), ("MAX", RedOpType.MAX), ("Product", RedOpType.PRODUCT),
     ("prod", RedOpType.PRODUCT), ("bxor", RedOpType.BXOR), (" avg ", RedOpType.AVG)],
)  # fmt: skip
def test_string_ops_case_insensitive(name: str, kind: RedOpType) -> None:
    assert resolve_op(name, dtypes.FLOAT64 if kind is not RedOpType.BXOR else dtypes.INT8,
                      op_name="x").kind is kind  # fmt: skip


def test_reduce_op_mirrors_torch() -> None:
    assert ReduceOp.RedOpType is RedOpType
    assert [k.name for k in RedOpType] == [
        "SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM",
    ]  # fmt: skip
    assert ReduceOp.SUM is RedOpType.SUM and ReduceOp.PREMUL_SUM is RedOpType.PREMUL_SUM
    with pytest.raises(TypeError, match="namespace"):
        ReduceOp()
    dist = pytest.importorskip("torch.distributed")
    for name, member in dist.ReduceOp.RedOpType.__members__.items():
        assert RedOpType[name].value == int(member)
    # torch's own members are accepted by name
    assert resolve_op(dist.ReduceOp.MAX, dtypes.FLOAT32, op_name="x").kind is RedOpType.MAX
    assert resolve_op(dist.ReduceOp.BXOR, dtypes.UINT8, op_name="x").kind is RedOpType.BXOR


def test_make_premul_sum() -> None:
    assert make_premul_sum(2) == PremulSum(2.0)
    assert make_premul_sum(np.float32(0.25)).factor == 0.25
    assert make_premul_sum(3 + 0j).factor == 3.0
    assert make_premul_sum(np.array([1.5])).factor == 1.5
    assert make_premul_sum(1j).factor == 1j
    assert make_premul_sum(0.5).kind is RedOpType.PREMUL_SUM
    for bad in ("2", None, True, [1.0]):
        with pytest.raises(TypeError, match="factor must be a real or complex number"):
            make_premul_sum(bad)


def test_premul_factor_is_rounded_to_the_dtype() -> None:
    # NCCL takes the scalar in the reduction dtype: float16(0.1) != 0.1.
    spec = resolve_op(make_premul_sum(0.1), dtypes.FLOAT16, op_name="x")
    data = np.array([1.0, 3.0], np.float16)
    spec.prepare(data)
    factor = np.float32(np.float16(0.1))
    np.testing.assert_array_equal(data, (factor * np.array([1, 3], np.float32)).astype(np.float16))
    spec = resolve_op(make_premul_sum(0.1), dtypes.BFLOAT16, op_name="x")
    words = dtypes.float32_to_bf16(np.array([1.0], np.float32))
    spec.prepare(words)
    np.testing.assert_array_equal(words, dtypes.float32_to_bf16(np.array([0.1], np.float32)))


def test_prepare_and_finish_are_no_ops_where_they_should_be() -> None:
    data = np.array([1.0, 2.0], np.float32)
    spec = resolve_op(ReduceOp.SUM, dtypes.FLOAT32, op_name="x")
    spec.prepare(data)
    spec.finish(data, 4)
    np.testing.assert_array_equal(data, [1.0, 2.0])
    spec = resolve_op(ReduceOp.AVG, dtypes.FLOAT32, op_name="x")
    spec.prepare(data)
    np.testing.assert_array_equal(data, [1.0, 2.0])
    spec.finish(data, 4)
    np.testing.assert_array_equal(data, [0.25, 0.5])


def test_integer_overflow_wraps() -> None:
    acc = np.array([127, -128, 100], np.int8)
    resolve_op("sum", dtypes.INT8, op_name="x").combine(acc, np.array([1, -1, 100], np.int8))
    np.testing.assert_array_equal(acc, [-128, 127, -56])
    acc = np.array([255, 0], np.uint8)
    resolve_op("sum", dtypes.UINT8, op_name="x").combine(acc, np.array([1, 0], np.uint8))
    np.testing.assert_array_equal(acc, [0, 0])
    acc = np.array([2**62], np.int64)
    resolve_op("product", dtypes.INT64, op_name="x").combine(acc, np.array([4], np.int64))
    np.testing.assert_array_equal(acc, [0])
    acc = np.array([2**63], np.uint64)
    resolve_op("sum", dtypes.UINT64, op_name="x").combine(acc, np.array([2**63], np.uint64))
    np.testing.assert_array_equal(acc, [0])


@pytest.mark.parametrize("dtype", [dtypes.FLOAT16, dtypes.BFLOAT16, dtypes.FLOAT32, dtypes.FLOAT64])
@pytest.mark.parametrize("kind", [RedOpType.MIN, RedOpType.MAX])
def test_min_max_propagate_nan(dtype: DType, kind: RedOpType) -> None:
    def words(values: list[float]) -> np.ndarray:
        array = np.array(values, np.float32)
        return (
            dtypes.float32_to_bf16(array) if dtype is dtypes.BFLOAT16 else array.astype(dtype.numpy)
        )

    def floats(array: np.ndarray) -> np.ndarray:
        return dtypes.bf16_to_float32(array) if dtype is dtypes.BFLOAT16 else array

    acc = words([np.nan, 1.0, 2.0, np.nan])
    spec = resolve_op(kind, dtype, op_name="x")
    spec.combine(acc, words([1.0, np.nan, 3.0, np.nan]))
    result = floats(acc)
    assert np.isnan(result[[0, 1, 3]]).all()
    assert result[2] == (2.0 if kind is RedOpType.MIN else 3.0)


def test_bool_ops_are_logical() -> None:
    a = np.array([True, True, False, False])
    b = np.array([True, False, True, False])
    expected = {
        "sum": [1, 1, 1, 0], "max": [1, 1, 1, 0], "bor": [1, 1, 1, 0],
        "product": [1, 0, 0, 0], "min": [1, 0, 0, 0], "band": [1, 0, 0, 0],
        "bxor": [0, 1, 1, 0],
    }  # fmt: skip
    for name, want in expected.items():
        acc = a.copy()
        resolve_op(name, dtypes.BOOL, op_name="x").combine(acc, b)
        assert acc.dtype == np.bool_
        np.testing.assert_array_equal(acc, np.array(want, bool), err_msg=name)


def test_bf16_spans_several_blocks() -> None:
    rng = np.random.default_rng(11)
    n = 150_001  # more than two internal blocks, and odd
    a = dtypes.float32_to_bf16(rng.standard_normal(n).astype(np.float32))
    b = dtypes.float32_to_bf16(rng.standard_normal(n).astype(np.float32))
    expected = dtypes.float32_to_bf16(dtypes.bf16_to_float32(a) + dtypes.bf16_to_float32(b))
    acc = a.copy()
    resolve_op("sum", dtypes.BFLOAT16, op_name="x").combine(acc, b)
    np.testing.assert_array_equal(acc, expected)


TORCH_OPS = {
    RedOpType.SUM: lambda a, b: a + b,
    RedOpType.PRODUCT: lambda a, b: a * b,
    RedOpType.MIN: lambda a, b: a.minimum(b),
    RedOpType.MAX: lambda a, b: a.maximum(b),
    RedOpType.AVG: lambda a, b: a + b,
    RedOpType.PREMUL_SUM: lambda a, b: a + b,
}


@pytest.mark.parametrize("kind", list(TORCH_OPS), ids=lambda k: k.name)
@pytest.mark.parametrize("dtype", [dtypes.BFLOAT16, dtypes.FLOAT16], ids=lambda d: d.name)
def test_half_precision_rounding_matches_torch(kind: RedOpType, dtype: DType) -> None:
    torch = pytest.importorskip("torch")
    tdtype = getattr(torch, dtype.name)
    rng = np.random.default_rng(kind.value)
    world = 3
    values = [(rng.standard_normal(4096) * 4).astype(np.float32) for _ in range(world)]
    factor = 0.3
    tensors = [torch.from_numpy(v).to(tdtype) for v in values]
    if kind is RedOpType.PREMUL_SUM:  # the factor rounded to the dtype, as NCCL does
        tensors = [t * torch.tensor(factor, dtype=tdtype) for t in tensors]
    expected = tensors[0]
    for t in tensors[1:]:
        expected = TORCH_OPS[kind](expected, t)
    if kind is RedOpType.AVG:
        expected = expected / world

    op = make_premul_sum(factor) if kind is RedOpType.PREMUL_SUM else kind
    spec = resolve_op(op, dtype, op_name="all_reduce")
    arrays = [torch.from_numpy(v).to(tdtype).view(torch.int16).numpy().view(dtype.numpy)
              for v in values]  # fmt: skip
    for array in arrays:
        spec.prepare(array)
    for other in arrays[1:]:
        spec.combine(arrays[0], other)
    spec.finish(arrays[0], world)
    want = expected.view(torch.int16).numpy().view(dtype.numpy)
    np.testing.assert_array_equal(arrays[0], want)


def test_numpy_reference_needs_arrays_and_copies() -> None:
    spec = resolve_op("sum", dtypes.INT32, op_name="x")
    with pytest.raises(ValueError, match="at least one array"):
        spec.numpy_reference([])
    a = np.array([1, 2], np.int32)
    result = spec.numpy_reference([a, a, a])
    np.testing.assert_array_equal(result, [3, 6])
    np.testing.assert_array_equal(a, [1, 2])


def test_resolve_op_is_cached_for_plain_ops() -> None:
    first = resolve_op(ReduceOp.SUM, dtypes.FLOAT32, op_name="a")
    assert resolve_op("sum", dtypes.FLOAT32, op_name="b") is first
    assert resolve_op(make_premul_sum(2.0), dtypes.FLOAT32, op_name="c").factor == 2.0
