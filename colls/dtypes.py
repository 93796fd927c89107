"""The table of dtypes colls can move and reduce, and lookups into it.

Every array that enters colls is described by one :class:`DType` from a frozen table of 15
entries. The table ties together the three names a dtype has on its way through colls: the
framework's name (``torch.bfloat16``, ``jnp.float32``), the DLPack type code carried in a capsule,
and the NumPy dtype the core uses to hold the bytes. NumPy has no bfloat16, so bfloat16 is held as
raw ``np.uint16`` words; :func:`bf16_to_float32` and :func:`float32_to_bf16` convert those words
for arithmetic.

Lookups never import torch, jax or ml_dtypes: a framework dtype is recognised by its string form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, final

import numpy as np

__all__ = [
    "BF16_CANONICAL_NAN",
    "BFLOAT16",
    "BOOL",
    "COMPLEX64",
    "COMPLEX128",
    "DTYPES",
    "FLOAT16",
    "FLOAT32",
    "FLOAT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "KDL_BFLOAT",
    "KDL_BOOL",
    "KDL_COMPLEX",
    "KDL_FLOAT",
    "KDL_INT",
    "KDL_UINT",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "DType",
    "bf16_to_float32",
    "by_name",
    "float32_to_bf16",
    "from_any",
    "from_dlpack",
    "from_numpy",
    "supported_names",
]

# DLPack DLDataTypeCode values (dlpack.h).
KDL_INT: Final = 0
KDL_UINT: Final = 1
KDL_FLOAT: Final = 2
KDL_BFLOAT: Final = 4
KDL_COMPLEX: Final = 5
KDL_BOOL: Final = 6

_BITS_PER_BYTE: Final = 8
# bfloat16 is the upper half of a float32: shift by 16 bits to go from one to the other.
_BF16_SHIFT: Final = 16
# Round-to-nearest-even bias for dropping the low 16 bits of a float32 (torch's c10::BFloat16).
_BF16_ROUND_BIAS: Final = 0x7FFF
# The NaN torch writes for any NaN converted to bfloat16 (c10 round_to_nearest_even).
BF16_CANONICAL_NAN: Final = 0x7FC0


@final
@dataclass(frozen=True, eq=False)
class DType:
    """One entry of the colls dtype table. Compare with ``is``; do not construct.

    Attributes:
        name: Canonical name ("float32", "bfloat16", ...), as in torch without the prefix.
        itemsize: Bytes per element.
        kind: "bool", "int", "uint", "float" or "complex".
        numpy: NumPy dtype that holds the data (``uint16`` words for bfloat16).
        dlpack: DLPack ``(type code, bits)``.
    """

    name: str
    itemsize: int
    kind: str
    numpy: np.dtype[Any]
    dlpack: tuple[int, int]

    @property
    def is_floating(self) -> bool:
        """Whether this is a real floating point dtype (float16/bfloat16/float32/float64)."""
        return self.kind == "float"

    @property
    def is_complex(self) -> bool:
        """Whether this is a complex dtype."""
        return self.kind == "complex"

    def __repr__(self) -> str:
        return f"colls.dtypes.{self.name.upper()}"


def _make(name: str, kind: str, holder: Any, code: int) -> DType:
    np_dtype = np.dtype(holder)
    return DType(
        name, np_dtype.itemsize, kind, np_dtype, (code, np_dtype.itemsize * _BITS_PER_BYTE)
    )


BOOL: Final = _make("bool", "bool", np.bool_, KDL_BOOL)
INT8: Final = _make("int8", "int", np.int8, KDL_INT)
INT16: Final = _make("int16", "int", np.int16, KDL_INT)
INT32: Final = _make("int32", "int", np.int32, KDL_INT)
INT64: Final = _make("int64", "int", np.int64, KDL_INT)
UINT8: Final = _make("uint8", "uint", np.uint8, KDL_UINT)
UINT16: Final = _make("uint16", "uint", np.uint16, KDL_UINT)
UINT32: Final = _make("uint32", "uint", np.uint32, KDL_UINT)
UINT64: Final = _make("uint64", "uint", np.uint64, KDL_UINT)
FLOAT16: Final = _make("float16", "float", np.float16, KDL_FLOAT)
BFLOAT16: Final = _make("bfloat16", "float", np.uint16, KDL_BFLOAT)
FLOAT32: Final = _make("float32", "float", np.float32, KDL_FLOAT)
FLOAT64: Final = _make("float64", "float", np.float64, KDL_FLOAT)
COMPLEX64: Final = _make("complex64", "complex", np.complex64, KDL_COMPLEX)
COMPLEX128: Final = _make("complex128", "complex", np.complex128, KDL_COMPLEX)

DTYPES: Final[tuple[DType, ...]] = (
    BOOL, INT8, INT16, INT32, INT64, UINT8, UINT16, UINT32, UINT64,
    FLOAT16, BFLOAT16, FLOAT32, FLOAT64, COMPLEX64, COMPLEX128,
)  # fmt: skip

_BY_NAME: Final[dict[str, DType]] = {d.name: d for d in DTYPES}
# Aliases a user or a framework may print ("torch.float" prints "torch.float32", but a user may
# type "float"; "bool_" is NumPy's scalar name).
_ALIASES: Final[dict[str, DType]] = {
    "bool_": BOOL, "half": FLOAT16, "float": FLOAT32, "double": FLOAT64,
    "cfloat": COMPLEX64, "cdouble": COMPLEX128, "short": INT16, "int": INT32, "long": INT64,
    "bf16": BFLOAT16,
}  # fmt: skip
# bfloat16 is deliberately absent: uint16 words mean uint16 unless the caller says otherwise.
_BY_NUMPY: Final[dict[np.dtype[Any], DType]] = {d.numpy: d for d in DTYPES if d is not BFLOAT16}
_BY_DLPACK: Final[dict[tuple[int, int], DType]] = {d.dlpack: d for d in DTYPES}
# Older producers export bool as an unsigned byte; that reads as uint8, which is what it is.


def supported_names() -> str:
    """Return the supported dtype names as one comma-separated string, for error messages."""
    return ", ".join(d.name for d in DTYPES)


def _unsupported(what: str) -> TypeError:
    return TypeError(f"unsupported dtype {what}; colls supports: {supported_names()}")


def by_name(name: str) -> DType:
    """Look a dtype up by name ("float32", "bfloat16", "torch.int64", "float", ...).

    Raises:
        TypeError: the name is not a supported dtype.
    """
    if isinstance(name, str):
        key = name.strip().lower().removeprefix("torch.").removeprefix("numpy.")
        found = _BY_NAME.get(key) or _ALIASES.get(key)
        if found is not None:
            return found
    raise _unsupported(repr(name))


#: ``known_numpy(np_dtype)``: the DType of a supported native NumPy dtype, else None. The table's
#: own lookup, without from_numpy's checks and errors: for the per-call import of arrays.
known_numpy: Final = _BY_NUMPY.get


def from_numpy(dtype: Any) -> DType:
    """Return the DType of a NumPy dtype (or anything ``np.dtype()`` accepts).

    ``np.uint16`` maps to UINT16; an ml_dtypes ``bfloat16`` dtype maps to BFLOAT16.

    Raises:
        TypeError: the dtype is not supported (including non-native byte order).
    """
    found = _BY_NUMPY.get(dtype) if isinstance(dtype, np.dtype) else None
    if found is not None:
        return found
    try:
        np_dtype = np.dtype(dtype)
    except (TypeError, ValueError):
        raise _unsupported(repr(dtype)) from None
    found = _BY_NUMPY.get(np_dtype)
    if found is not None:
        return found
    if np_dtype.name == "bfloat16":  # ml_dtypes.bfloat16 (what JAX hands to NumPy)
        return BFLOAT16
    if not np_dtype.isnative:
        raise TypeError(
            f"unsupported dtype {np_dtype.str!r}: non-native byte order; convert with "
            f"arr.astype(arr.dtype.newbyteorder('=')). colls supports: {supported_names()}"
        )
    raise _unsupported(repr(np_dtype.name))


def from_dlpack(code: int, bits: int) -> DType:
    """Return the DType of a DLPack ``(type code, bits)`` pair (lanes must be 1).

    Raises:
        TypeError: the pair is not a supported dtype.
    """
    found = _BY_DLPACK.get((int(code), int(bits)))
    if found is None:
        raise _unsupported(f"with DLPack type code {code} and {bits} bits")
    return found


def _is_torch_dtype(obj: Any) -> bool:
    cls = type(obj)
    return cls.__module__ == "torch" and cls.__name__ == "dtype"


def from_any(obj: Any) -> DType:
    """Return the DType of an array-like (or of a dtype object) without importing its framework.

    Looks at ``obj.dtype`` when present: a NumPy/CuPy/JAX dtype, an ml_dtypes bfloat16, a torch
    dtype (recognised by its string, "torch.bfloat16"), or a colls DType. Buffer-protocol objects
    (bytearray, memoryview, array.array) are described by their buffer format.

    Raises:
        TypeError: the dtype is unsupported or ``obj`` has no recognisable dtype.
    """
    if isinstance(obj, DType):
        return obj
    if isinstance(obj, (np.dtype, type, str)) or _is_torch_dtype(obj):
        dtype = obj  # a dtype itself
    else:
        dtype = getattr(obj, "dtype", None)
    if dtype is None:
        try:
            dtype = np.dtype(memoryview(obj).format)
        except TypeError:
            raise TypeError(
                f"cannot tell the dtype of {type(obj).__name__}: it has no 'dtype' "
                "attribute and does not support the buffer protocol"
            ) from None
    if isinstance(dtype, DType):
        return dtype
    if isinstance(dtype, np.dtype):
        return from_numpy(dtype)
    if isinstance(dtype, str):
        return by_name(dtype)
    text = str(dtype)
    if text.startswith("torch."):
        return by_name(text)
    return from_numpy(dtype)


def bf16_to_float32(words: np.ndarray) -> np.ndarray:
    """Return the float32 values of bfloat16 ``uint16`` words (exact; a new array).

    CuPy words (a bfloat16 reduction on a CUDA array) give a CuPy array, through array methods.
    """
    if not isinstance(words, np.ndarray):
        device_wide = words.astype(np.uint32)
        device_wide <<= _BF16_SHIFT
        return device_wide.view(np.float32)  # type: ignore[no-any-return]
    wide = np.empty(words.shape, dtype=np.uint32)
    np.left_shift(words, _BF16_SHIFT, out=wide, dtype=np.uint32)
    return wide.view(np.float32)


def float32_to_bf16(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Round float32 values to bfloat16 words, to nearest even; any NaN becomes 0x7FC0.

    This is the conversion torch uses (c10::BFloat16 round_to_nearest_even), so results match
    torch's bfloat16 arithmetic bit for bit.

    Args:
        values: float32 array (not modified).
        out: optional ``uint16`` array of the same shape to write into.

    Returns:
        The ``uint16`` words (``out`` when given).
    """
    on_device = hasattr(values, "__cuda_array_interface__")
    if not on_device:  # CuPy stays CuPy
        values = np.asarray(values, dtype=np.float32)
    bits = values.view(np.uint32)
    rounded = bits >> _BF16_SHIFT
    rounded &= 1
    rounded += _BF16_ROUND_BIAS
    rounded += bits
    rounded >>= _BF16_SHIFT
    if out is None:
        out = rounded.astype(np.uint16)  # NumPy's or CuPy's, as ``values`` is
    else:
        np.copyto(out, rounded, casting="unsafe")
    nan = np.isnan(values)
    if on_device:  # ``nan.any()`` would wait for the GPU, once per block: a masked copy does not
        np.copyto(out, BF16_CANONICAL_NAN, where=nan)
    elif nan.any():  # on the host, the check is cheaper than the masked copy it usually skips
        out[nan] = BF16_CANONICAL_NAN
    return out
