"""Reduction operators: the public ``ReduceOp`` names and the kernels that apply them.

``ReduceOp`` mirrors ``torch.distributed.ReduceOp``. A collective turns the user's op into a
:class:`ReduceSpec` with :func:`resolve_op` *before any byte moves*, so a forbidden combination
(BAND on floats, AVG on integers, MIN on complex) fails on every rank with the same TypeError
instead of half-way through a ring.

A ReduceSpec applies the op with NumPy ufuncs, in place, with no Python loop over elements:

* ``prepare`` runs once on each rank's contribution before communication (PREMUL_SUM scales it);
* ``combine(acc, other)`` folds one received chunk into the accumulator;
* ``finish`` runs once on the result (AVG divides by the world size).

Semantics follow torch/NCCL: integers wrap on overflow, MIN/MAX propagate NaN, bool SUM/MAX/BOR
are logical or, PRODUCT/MIN/BAND logical and, BXOR logical xor. bfloat16 travels as uint16 words
and is reduced through float32 with round-to-nearest-even, as torch does.

Floating-point arithmetic gives the IEEE result without a word, as torch does: every kernel that
computes on floating or complex values runs under :data:`_IEEE`, so overflow to inf, inf - inf,
0 * inf and underflow neither warn nor raise, whatever ``np.seterr`` the caller set. (Integer
array arithmetic never signals: it wraps; AVG on integers is refused before any byte moves.)
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Final, final

import numpy as np

from colls import dtypes
from colls.dtypes import DType

__all__ = ["PremulSum", "ReduceOp", "ReduceSpec", "make_premul_sum", "resolve_op"]

# bfloat16 is reduced through float32 in blocks of this many elements: the float32 temporaries
# stay cache-sized and memory use stays bounded however large the message is.
_BF16_BLOCK: Final = 1 << 16

#: The floating-point error state of every floating kernel: IEEE results, no warnings, no raises
#: (torch's reductions are silent). A decorator, because it costs a third of the ``with`` form.
_IEEE: Final = np.errstate(all="ignore")


class RedOpType(enum.Enum):
    """The nine reduction kinds; values match torch's ``ReduceOp.RedOpType``."""

    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    PREMUL_SUM = 8

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"

    __str__ = __repr__


@final
class ReduceOp:
    """Reduction operators, named as in ``torch.distributed.ReduceOp``. Do not instantiate."""

    RedOpType = RedOpType
    SUM: Final = RedOpType.SUM
    AVG: Final = RedOpType.AVG
    PRODUCT: Final = RedOpType.PRODUCT
    MIN: Final = RedOpType.MIN
    MAX: Final = RedOpType.MAX
    BAND: Final = RedOpType.BAND
    BOR: Final = RedOpType.BOR
    BXOR: Final = RedOpType.BXOR
    PREMUL_SUM: Final = RedOpType.PREMUL_SUM

    def __init__(self) -> None:
        raise TypeError("ReduceOp is a namespace: use ReduceOp.SUM, ReduceOp.MAX, ...")


@final
@dataclass(frozen=True)
class PremulSum:
    """PREMUL_SUM with its factor: each rank's input is multiplied by ``factor``, then summed.

    Build with :func:`make_premul_sum`.
    """

    factor: float | complex
    kind: RedOpType = field(default=RedOpType.PREMUL_SUM, init=False)

    def __repr__(self) -> str:
        return f"ReduceOp.PREMUL_SUM(factor={self.factor!r})"


def make_premul_sum(factor: Any) -> PremulSum:
    """Return the PREMUL_SUM op with ``factor`` (torch's ``_make_nccl_premul_sum``).

    Args:
        factor: A real or complex number, or a one-element array (its value is taken).

    Raises:
        TypeError: ``factor`` is not a number.
    """
    if not isinstance(factor, numbers.Number) and hasattr(factor, "item"):
        factor = factor.item()  # a one-element tensor or array, as torch accepts
    if isinstance(factor, bool) or not isinstance(factor, numbers.Complex):
        raise TypeError(
            f"make_premul_sum: factor must be a real or complex number, got {factor!r} "
            f"({type(factor).__name__})"
        )
    if isinstance(factor, numbers.Real):
        return PremulSum(float(factor))
    value = complex(factor)
    return PremulSum(value.real if value.imag == 0 else value)


# Ufunc per kind for numeric dtypes, and for bool (where torch's results are logical).
_NUMERIC_UFUNCS: Final = {
    RedOpType.SUM: np.add,
    RedOpType.AVG: np.add,
    RedOpType.PREMUL_SUM: np.add,
    RedOpType.PRODUCT: np.multiply,
    RedOpType.MIN: np.minimum,
    RedOpType.MAX: np.maximum,
    RedOpType.BAND: np.bitwise_and,
    RedOpType.BOR: np.bitwise_or,
    RedOpType.BXOR: np.bitwise_xor,
}
_BOOL_UFUNCS: Final = {
    RedOpType.SUM: np.logical_or,
    RedOpType.MAX: np.logical_or,
    RedOpType.BOR: np.logical_or,
    RedOpType.PRODUCT: np.logical_and,
    RedOpType.MIN: np.logical_and,
    RedOpType.BAND: np.logical_and,
    RedOpType.BXOR: np.logical_xor,
}


@final
@dataclass(frozen=True)
class ReduceSpec:
    """A checked (op, dtype) pair with its kernels. Built by :func:`resolve_op`."""

    kind: RedOpType
    dtype: DType
    factor: float | complex | None = None
    _ufunc: Any = field(default=None, repr=False, compare=False)
    #: ``kind.name``, read on every call (an Enum's ``name`` is a slow descriptor).
    name: str = field(init=False, repr=False, compare=False)
    #: Whether the values are floating or complex (their arithmetic runs under ``_IEEE``).
    _floating: bool = field(init=False, repr=False, compare=False)
    #: AVG only: the backend averages (NCCL's ``ncclAvg``), so :meth:`finish` does not divide.
    backend_averages: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", self.kind.name)
        object.__setattr__(self, "_floating", self.dtype.is_floating or self.dtype.is_complex)

    @property
    def modifies_input(self) -> bool:
        """True when :meth:`prepare` rewrites its array (callers then prepare a copy)."""
        return self.kind is RedOpType.PREMUL_SUM

    def combine(self, acc: np.ndarray, other: np.ndarray) -> None:
        """Set ``acc = acc (op) other`` in place (both 1-D arrays of the holding dtype)."""
        if self.dtype is dtypes.BFLOAT16:
            _bf16_apply(self._ufunc, acc, other)
        elif self._floating:
            _float_apply(self._ufunc, acc, other)
        else:
            self._ufunc(acc, other, out=acc)

    def combine_all(self, acc: np.ndarray, others: Iterable[np.ndarray]) -> None:
        """Set ``acc = ((acc (op) others[0]) (op) others[1]) ...`` in place, in that order.

        What :meth:`combine` does for each, but floating values enter the error state once for
        all of them: entering it costs more than the ufunc on a few KiB, once per peer of a
        host's flat reduction.
        """
        if self.dtype is dtypes.BFLOAT16:
            for other in others:
                _bf16_apply(self._ufunc, acc, other)
        elif self._floating:
            _float_apply_all(self._ufunc, acc, others)
        else:
            ufunc = self._ufunc
            for other in others:
                ufunc(acc, other, out=acc)

    def averaged_by_backend(self) -> ReduceSpec:
        """Return this AVG spec for a backend that averages itself: :meth:`finish` is a no-op."""
        return replace(self, backend_averages=True)

    def prepare(self, array: np.ndarray) -> None:
        """Apply the pre-communication step in place (PREMUL_SUM: multiply by the factor)."""
        if self.kind is RedOpType.PREMUL_SUM:
            _scale(array, self.dtype, self.factor, np.multiply)

    def finish(self, array: np.ndarray, world_size: int) -> None:
        """Apply the post-communication step in place (AVG: divide by ``world_size``)."""
        if self.kind is RedOpType.AVG and not self.backend_averages:
            _scale(array, self.dtype, world_size, np.divide)

    def numpy_reference(self, arrays: list[np.ndarray]) -> np.ndarray:
        """Return the reduction of per-rank arrays (a new array), left to right, for tests.

        The arrays hold the dtype's holding type (bfloat16 as uint16 words).
        """
        if not arrays:
            raise ValueError("numpy_reference: needs at least one array")
        acc = np.array(arrays[0], dtype=self.dtype.numpy, copy=True)
        self.prepare(acc)
        for array in arrays[1:]:
            other = np.array(array, dtype=self.dtype.numpy, copy=True)
            self.prepare(other)
            self.combine(acc, other)
        self.finish(acc, len(arrays))
        return acc


@_IEEE
def _float_apply(ufunc: Any, acc: np.ndarray, other: np.ndarray) -> None:
    """Set ``acc = ufunc(acc, other)`` in place on floating or complex values."""
    ufunc(acc, other, out=acc)


@_IEEE
def _float_apply_all(ufunc: Any, acc: np.ndarray, others: Iterable[np.ndarray]) -> None:
    """Set ``acc = ufunc(acc, other)`` in place for each of ``others`` in turn."""
    for other in others:
        ufunc(acc, other, out=acc)


@_IEEE
def _bf16_apply(ufunc: Any, acc: np.ndarray, other: Any) -> None:
    """Apply a binary ufunc to bfloat16 words through float32, rounding once per element."""
    if not acc.flags.c_contiguous:  # reshape would copy, and the result would be lost
        raise ValueError("bfloat16 reduction needs a C-contiguous accumulator")
    flat_acc = acc.reshape(-1)
    if np.ndim(other) == 0:  # a scalar operand (a factor or a divisor), already float32
        for start in range(0, flat_acc.size, _BF16_BLOCK):
            block = flat_acc[start : start + _BF16_BLOCK]
            wide = dtypes.bf16_to_float32(block)
            ufunc(wide, other, out=wide)
            dtypes.float32_to_bf16(wide, out=block)
        return
    flat_other = other.reshape(-1)
    for start in range(0, flat_acc.size, _BF16_BLOCK):
        block = flat_acc[start : start + _BF16_BLOCK]
        wide = dtypes.bf16_to_float32(block)
        ufunc(wide, dtypes.bf16_to_float32(flat_other[start : start + _BF16_BLOCK]), out=wide)
        dtypes.float32_to_bf16(wide, out=block)


def _bf16_scalar(value: float) -> np.float32:
    """Round a Python float to the nearest bfloat16, returned as float32 (NCCL's scalar rule)."""
    words = dtypes.float32_to_bf16(np.array([value], dtype=np.float32))
    return np.float32(dtypes.bf16_to_float32(words)[0])


_COMPLEX_PARTS: Final = {"complex64": np.float32, "complex128": np.float64}


@_IEEE
def _scale(array: np.ndarray, dtype: DType, scalar: Any, ufunc: Any) -> None:
    """Multiply or divide in place by a scalar held in the array's precision."""
    if dtype is dtypes.BFLOAT16:
        # A factor is rounded to bf16 like NCCL's scalar; a divisor (world size) is exact anyway.
        operand = _bf16_scalar(scalar) if ufunc is np.multiply else np.float32(scalar)
        _bf16_apply(ufunc, array, operand)
    elif dtype is dtypes.FLOAT16:
        wide = array.astype(np.float32)
        operand = np.float32(np.float16(scalar)) if ufunc is np.multiply else np.float32(scalar)
        ufunc(wide, operand, out=wide)
        np.copyto(array, wide, casting="same_kind")
    elif dtype.is_complex and not isinstance(scalar, complex):
        # Scale real and imaginary parts separately: exact IEEE rounding (NumPy's complex
        # division is not), and inf * 0j cannot turn a finite part into NaN.
        parts = array.view(_COMPLEX_PARTS[dtype.name])
        ufunc(parts, parts.dtype.type(scalar), out=parts)
    else:
        ufunc(array, dtype.numpy.type(scalar), out=array)


_NAME_ALIASES: Final = {"PROD": "PRODUCT"}  # MPI's and NumPy's spelling
_ACCEPTED: Final = ", ".join(f"ReduceOp.{k.name}" for k in RedOpType)


def _kind_of(op: Any, op_name: str, rank: int | None) -> tuple[RedOpType, Any]:
    """Return (kind, factor) for any accepted spelling of an op."""
    if isinstance(op, RedOpType):
        return op, None
    if isinstance(op, PremulSum):
        return op.kind, op.factor
    name = op if isinstance(op, str) else getattr(op, "name", None)  # e.g. torch's ReduceOp.SUM
    if isinstance(name, str):
        key = name.strip().upper().removeprefix("REDUCEOP.")
        key = _NAME_ALIASES.get(key, key)
        if key in RedOpType.__members__:
            return RedOpType[key], None
    raise TypeError(
        f"{op_name}{_on_rank(rank)}: unknown reduce op {op!r}; accepted: {_ACCEPTED}, "
        "make_premul_sum(factor), or their names as strings ('sum', 'max', ...)"
    )


def _on_rank(rank: int | None) -> str:
    return "" if rank is None else f" on rank {rank}"


def _check_dtype(
    kind: RedOpType, dtype: DType, factor: Any, op_name: str, rank: int | None
) -> None:
    where = f"{op_name}{_on_rank(rank)}"
    if kind in (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR):
        if dtype.kind not in ("bool", "int", "uint"):
            raise TypeError(
                f"{where}: ReduceOp.{kind.name} is not defined for {dtype.name}; bitwise ops "
                "need a bool or integer dtype"
            )
    elif kind in (RedOpType.MIN, RedOpType.MAX):
        if dtype.is_complex:
            raise TypeError(
                f"{where}: ReduceOp.{kind.name} is not defined for {dtype.name}; complex numbers "
                "are not ordered (allowed: bool, integer and real floating dtypes)"
            )
    elif kind in (RedOpType.AVG, RedOpType.PREMUL_SUM):
        if not (dtype.is_floating or dtype.is_complex):
            raise TypeError(
                f"{where}: ReduceOp.{kind.name} is not defined for {dtype.name}; it needs a "
                "floating point or complex dtype"
            )
        if kind is RedOpType.PREMUL_SUM and factor is None:
            raise ValueError(
                f"{where}: ReduceOp.PREMUL_SUM needs a factor; pass make_premul_sum(factor)"
            )
        if isinstance(factor, complex) and not dtype.is_complex:
            raise TypeError(
                f"{where}: PREMUL_SUM factor {factor!r} is complex but the dtype is {dtype.name}"
            )


# Keyed by the kind's value: hashing an Enum member runs Python code, and this is read per call.
_CACHE: dict[tuple[int, DType], ReduceSpec] = {}


def resolve_op(op: Any, dtype: DType, *, op_name: str, rank: int | None = None) -> ReduceSpec:
    """Check ``op`` against ``dtype`` and return its kernels. Call before any byte moves.

    Args:
        op: A ``ReduceOp`` member, a :class:`PremulSum`, or a name ("sum", "max", ...).
        dtype: The dtype being reduced.
        op_name: The collective's name, for errors.
        rank: The caller's rank, for errors.

    Raises:
        TypeError: unknown op, or an op the dtype does not allow.
        ValueError: bare ``ReduceOp.PREMUL_SUM`` without a factor.
    """
    if type(op) is RedOpType:  # the common spelling, ReduceOp.SUM: straight to the cache
        cached = _CACHE.get((op._value_, dtype))
        if cached is not None:
            return cached
    kind, factor = _kind_of(op, op_name, rank)
    if factor is None:
        cached = _CACHE.get((kind._value_, dtype))
        if cached is not None:
            return cached
    _check_dtype(kind, dtype, factor, op_name, rank)
    table = _BOOL_UFUNCS if dtype is dtypes.BOOL else _NUMERIC_UFUNCS
    spec = ReduceSpec(kind, dtype, factor, table[kind])
    if factor is None:
        _CACHE[(kind._value_, dtype)] = spec
    return spec
