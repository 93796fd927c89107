"""Tests for colls.dtypes: the table, the lookups and the bfloat16 word conversions."""

from __future__ import annotations

import array

import numpy as np
import pytest

from colls import dtypes
from colls.dtypes import DTYPES

NAMES = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
]  # fmt: skip


def test_table_has_the_fifteen_dtypes_in_order() -> None:
    assert [d.name for d in DTYPES] == NAMES


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_entry_is_consistent(dtype: dtypes.DType) -> None:
    assert dtype.itemsize == dtype.numpy.itemsize
    assert dtype.dlpack[1] == dtype.itemsize * 8
    assert dtype.is_floating == (dtype.kind == "float")
    assert dtype.is_complex == (dtype.kind == "complex")
    assert dtypes.by_name(dtype.name) is dtype
    assert dtypes.from_dlpack(*dtype.dlpack) is dtype


def test_kinds_and_holders() -> None:
    assert dtypes.BFLOAT16.numpy == np.dtype(np.uint16)
    assert dtypes.BFLOAT16.dlpack == (4, 16)
    assert dtypes.BOOL.dlpack == (6, 8)
    assert dtypes.COMPLEX64.dlpack == (5, 64)
    assert dtypes.UINT32.dlpack == (1, 32)
    assert dtypes.INT8.dlpack == (0, 8)
    assert dtypes.FLOAT16.dlpack == (2, 16)
    assert {d.kind for d in DTYPES} == {"bool", "int", "uint", "float", "complex"}
    assert dtypes.BFLOAT16.is_floating and not dtypes.BFLOAT16.is_complex
    assert dtypes.COMPLEX128.is_complex and not dtypes.COMPLEX128.is_floating


def test_dtype_is_frozen() -> None:
    with pytest.raises(AttributeError):
        dtypes.FLOAT32.name = "x"  # type: ignore[misc]


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d is not dtypes.BFLOAT16], ids=str)
def test_from_numpy(dtype: dtypes.DType) -> None:
    assert dtypes.from_numpy(dtype.numpy) is dtype
    assert dtypes.from_numpy(dtype.numpy.type) is dtype


def test_from_numpy_uint16_is_uint16_and_ml_dtypes_bfloat16_is_bfloat16() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert dtypes.from_numpy(np.uint16) is dtypes.UINT16
    assert dtypes.from_numpy(np.dtype(ml_dtypes.bfloat16)) is dtypes.BFLOAT16


@pytest.mark.parametrize("bad", [np.float128 if hasattr(np, "float128") else "U3", "U3", object])
def test_from_numpy_unsupported_lists_supported(bad: object) -> None:
    with pytest.raises(TypeError, match="unsupported dtype") as info:
        dtypes.from_numpy(bad)
    assert dtypes.supported_names() in str(info.value)


def test_from_numpy_non_native_byte_order_says_so() -> None:
    with pytest.raises(TypeError, match="non-native byte order"):
        dtypes.from_numpy(np.dtype(">f4") if np.little_endian else np.dtype("<f4"))


@pytest.mark.parametrize("pair", [(2, 8), (3, 64), (0, 128), (4, 32), (7, 16)])
def test_from_dlpack_unknown(pair: tuple[int, int]) -> None:
    with pytest.raises(TypeError, match=f"type code {pair[0]} and {pair[1]} bits") as info:
        dtypes.from_dlpack(*pair)
    assert "bfloat16" in str(info.value) and "complex128" in str(info.value)


def test_from_dlpack_old_bool_encoding_reads_as_uint8() -> None:
    assert dtypes.from_dlpack(1, 8) is dtypes.UINT8


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("torch.bfloat16", dtypes.BFLOAT16), ("Float32", dtypes.FLOAT32), ("half", dtypes.FLOAT16),
        ("torch.float", dtypes.FLOAT32), ("double", dtypes.FLOAT64), ("long", dtypes.INT64),
        ("bool_", dtypes.BOOL), ("cfloat", dtypes.COMPLEX64), ("numpy.uint8", dtypes.UINT8),
    ],
)  # fmt: skip
def test_by_name_and_aliases(text: str, expected: dtypes.DType) -> None:
    assert dtypes.by_name(text) is expected


@pytest.mark.parametrize("bad", ["float8", "", "torch.qint8", 3, None])
def test_by_name_unknown(bad: object) -> None:
    with pytest.raises(TypeError, match="colls supports: bool, int8"):
        dtypes.by_name(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_from_any_numpy(dtype: dtypes.DType) -> None:
    if dtype is dtypes.BFLOAT16:  # NumPy's bfloat16 is ml_dtypes'
        ml_dtypes = pytest.importorskip("ml_dtypes", reason="needs ml_dtypes")
        assert dtypes.from_any(np.zeros(2, ml_dtypes.bfloat16)) is dtype
        return
    assert dtypes.from_any(np.zeros(2, dtype.numpy)) is dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_from_any_torch(dtype: dtypes.DType) -> None:
    torch = pytest.importorskip("torch", reason="needs torch")
    tensor = torch.zeros(2, dtype=getattr(torch, dtype.name))
    assert dtypes.from_any(tensor) is dtype
    assert dtypes.from_any(tensor.dtype) is dtype


def test_from_any_jax() -> None:
    jnp = pytest.importorskip("jax.numpy")
    assert dtypes.from_any(jnp.zeros(2, jnp.bfloat16)) is dtypes.BFLOAT16
    assert dtypes.from_any(jnp.zeros(2, jnp.float32)) is dtypes.FLOAT32
    assert dtypes.from_any(jnp.zeros(2, jnp.int8)) is dtypes.INT8
    assert dtypes.from_any(np.zeros(2, jnp.bfloat16)) is dtypes.BFLOAT16


def test_from_any_buffer_protocol_and_dtype_objects() -> None:
    assert dtypes.from_any(bytearray(3)) is dtypes.UINT8
    assert dtypes.from_any(array.array("d", [1.0])) is dtypes.FLOAT64
    assert dtypes.from_any(memoryview(array.array("i", [1]))) is dtypes.INT32
    assert dtypes.from_any(np.dtype("c8")) is dtypes.COMPLEX64
    assert dtypes.from_any(np.int16) is dtypes.INT16
    assert dtypes.from_any("bfloat16") is dtypes.BFLOAT16
    assert dtypes.from_any(dtypes.UINT64) is dtypes.UINT64


def test_from_any_without_dtype() -> None:
    with pytest.raises(TypeError, match="cannot tell the dtype of int"):
        dtypes.from_any(3)


def test_bf16_round_trip_of_every_word() -> None:
    words = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = dtypes.bf16_to_float32(words)
    back = dtypes.float32_to_bf16(values)
    nan = np.isnan(values)
    np.testing.assert_array_equal(back[~nan], words[~nan])
    assert np.all(back[nan] == dtypes.BF16_CANONICAL_NAN)


def test_bf16_rounds_to_nearest_even() -> None:
    # 1.0 is 0x3F800000; halfway to the next bf16 (0x3F81) is 0x3F808000.
    bits = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F7FFFFF], np.uint32)
    words = dtypes.float32_to_bf16(bits.view(np.float32))
    np.testing.assert_array_equal(words, [0x3F80, 0x3F82, 0x3F81, 0x3F80, 0x7F80])


def test_bf16_special_values() -> None:
    values = np.array([np.inf, -np.inf, -0.0, np.nan, -np.nan], dtype=np.float32)
    words = dtypes.float32_to_bf16(values)
    np.testing.assert_array_equal(words[:3], [0x7F80, 0xFF80, 0x8000])
    assert np.all(np.isnan(dtypes.bf16_to_float32(words[3:])))


def test_bf16_conversion_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    values = (rng.standard_normal(10_000) * 10.0 ** rng.integers(-30, 30, 10_000)).astype(
        np.float32
    )
    expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy()
    np.testing.assert_array_equal(dtypes.float32_to_bf16(values), expected.view(np.uint16))
    words = expected.view(np.uint16)
    back = torch.from_numpy(expected).view(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(dtypes.bf16_to_float32(words), back)


def test_float32_to_bf16_writes_into_out() -> None:
    out = np.zeros(3, np.uint16)
    result = dtypes.float32_to_bf16(np.array([1.0, 2.0, -1.0], np.float32), out=out)
    assert result is out
    np.testing.assert_array_equal(out, [0x3F80, 0x4000, 0xBF80])
