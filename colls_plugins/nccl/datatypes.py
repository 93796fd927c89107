"""The one table from colls (dtype, reduce op) to what NCCL is asked to do.

NCCL reduces ten dtypes natively (int8, uint8, int32, uint32, int64, uint64, float16, bfloat16,
float32, float64) with SUM, PROD, MIN and MAX. Everything else colls accepts is mapped here or
refused here, before anything is launched:

* bool travels as uint8 0/1 words: SUM becomes MAX (logical or), PRODUCT becomes MIN (logical
  and), as torch's ProcessGroupNCCL does.
* complex travels as pairs of its real type for SUM, AVG and PREMUL_SUM (each part is reduced
  on its own); PRODUCT is refused with torch's message; MIN and MAX never get here (the core
  refuses them for complex).
* int16 and uint16, which NCCL lacks, are widened into a 32-bit copy: SUM and PRODUCT through
  uint32, whose arithmetic modulo 2**32 keeps the low 16 bits exactly what 16-bit wrapping
  arithmetic gives; MIN and MAX through int32, which orders every int16 and uint16 value.
* AVG is NCCL's own ``ncclAvg`` (``NCCL_AVG``), as under torch's ProcessGroupNCCL. AVG reaches
  NCCL only on floating and complex dtypes (the core refuses it on the others), for which NCCL
  multiplies each rank's input by 1/n, rounded to the dtype, and sums: a sum of two float16
  40000s is never formed, so it cannot overflow to inf. The backend declares ``reduces_avg``, so
  the core does not divide the result again.
* PREMUL_SUM is NCCL SUM: the core's :class:`~colls.reduce_ops.ReduceSpec` scales each rank's
  input before, as CuPy's bindings lack ``ncclRedOpCreatePreMulSum``.
* BAND, BOR and BXOR are refused with torch's error (``Cannot use ReduceOp.BAND with NCCL``).

Data movement (broadcast, gather, all_to_all, send/recv) is dtype-blind: it moves bytes as uint8.

The table names NCCL's constants as strings (``"NCCL_FLOAT32"``), so it is importable and
testable without CuPy; :func:`nccl_constant` resolves a name against ``cupy.cuda.nccl``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, final

from colls import dtypes
from colls.dtypes import DType
from colls.reduce_ops import RedOpType

__all__ = ["BYTES", "NcclReduction", "nccl_constant", "reduction"]

#: How every dtype moves when nothing is reduced: as bytes.
BYTES: Final = "NCCL_UINT8"

# The dtypes NCCL reduces natively, by colls dtype.
_NATIVE: Final = {
    dtypes.INT8: "NCCL_INT8",
    dtypes.UINT8: "NCCL_UINT8",
    dtypes.INT32: "NCCL_INT32",
    dtypes.UINT32: "NCCL_UINT32",
    dtypes.INT64: "NCCL_INT64",
    dtypes.UINT64: "NCCL_UINT64",
    dtypes.FLOAT16: "NCCL_FLOAT16",
    dtypes.BFLOAT16: "NCCL_BFLOAT16",
    dtypes.FLOAT32: "NCCL_FLOAT32",
    dtypes.FLOAT64: "NCCL_FLOAT64",
}
# colls' kind -> NCCL op, for native dtypes (AVG and PREMUL_SUM: see the module docstring).
_OPS: Final = {
    RedOpType.SUM: "NCCL_SUM",
    RedOpType.AVG: "NCCL_AVG",
    RedOpType.PREMUL_SUM: "NCCL_SUM",
    RedOpType.PRODUCT: "NCCL_PROD",
    RedOpType.MIN: "NCCL_MIN",
    RedOpType.MAX: "NCCL_MAX",
}
_BOOL_OPS: Final = {
    RedOpType.SUM: "NCCL_MAX",
    RedOpType.PRODUCT: "NCCL_MIN",
    RedOpType.MIN: "NCCL_MIN",
    RedOpType.MAX: "NCCL_MAX",
}
_COMPLEX_PARTS: Final = {dtypes.COMPLEX64: "float32", dtypes.COMPLEX128: "float64"}
_COMPLEX_OPS: Final = frozenset({RedOpType.SUM, RedOpType.AVG, RedOpType.PREMUL_SUM})
_NARROW: Final = frozenset({dtypes.INT16, dtypes.UINT16})
_WRAPPING: Final = frozenset({RedOpType.SUM, RedOpType.PRODUCT})
_BITWISE: Final = frozenset({RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR})


@final
@dataclass(frozen=True)
class NcclReduction:
    """How one (dtype, op) pair is reduced by NCCL.

    Attributes:
        nccl_dtype: name of the ``cupy.cuda.nccl`` dtype constant ("NCCL_FLOAT32").
        nccl_op: name of the ``cupy.cuda.nccl`` op constant ("NCCL_SUM").
        view: NumPy dtype name to reinterpret the array as (same bytes) before the call, or None:
            "uint8" for bool, the real part type for complex (twice as many elements).
        widen: NumPy dtype name of a widened copy to reduce instead, cast back after, or None.
    """

    nccl_dtype: str
    nccl_op: str
    view: str | None = None
    widen: str | None = None


def reduction(dtype: DType, kind: RedOpType, *, op_name: str, rank: int) -> NcclReduction:
    """Return how NCCL reduces ``dtype`` with ``kind``, or refuse it as torch does.

    Args:
        dtype: the colls dtype of the arrays.
        kind: the reduce op kind (the core has already refused what no backend allows: AVG on
            integers, MIN on complex, BAND on floats).
        op_name: the collective's name, for errors.
        rank: the caller's world rank, for errors.

    Raises:
        ValueError: a bitwise op (NCCL has none), or PRODUCT on complex values.
    """
    where = f"{op_name} on rank {rank}"
    if kind in _BITWISE:
        raise ValueError(f"{where}: Cannot use ReduceOp.{kind.name} with NCCL")
    if kind is RedOpType.AVG and not (dtype.is_floating or dtype.is_complex):
        # The core refuses it first; NCCL would average integers with a truncating division.
        raise ValueError(f"{where}: ReduceOp.AVG on {dtype.name} is not supported with NCCL")
    if dtype is dtypes.BOOL and kind in _BOOL_OPS:
        return NcclReduction("NCCL_UINT8", _BOOL_OPS[kind], view="uint8")
    if dtype in _COMPLEX_PARTS:
        if kind not in _COMPLEX_OPS:
            raise ValueError(
                f"{where}: {op_name} does not support ReduceOp.{kind.name} on complex tensors "
                "with NCCL (only SUM, AVG and PREMUL_SUM, which reduce real and imaginary parts "
                "separately)"
            )
        part = _COMPLEX_PARTS[dtype]
        return NcclReduction(f"NCCL_{part.upper()}", _OPS[kind], view=part)
    if dtype in _NARROW and kind in _OPS:
        wide = "uint32" if kind in _WRAPPING else "int32"
        return NcclReduction(f"NCCL_{wide.upper()}", _OPS[kind], widen=wide)
    if dtype in _NATIVE and kind in _OPS:
        return NcclReduction(_NATIVE[dtype], _OPS[kind])
    raise ValueError(f"{where}: ReduceOp.{kind.name} on {dtype.name} is not supported with NCCL")


def nccl_constant(nccl: Any, name: str) -> int:
    """Return the value of constant ``name`` of the ``cupy.cuda.nccl`` module ``nccl``.

    Raises:
        BackendError: this CuPy's bindings lack it (bfloat16 needs NCCL 2.10 and CuPy 10).
    """
    value = getattr(nccl, name, None)
    if value is None:
        from colls.errors import BackendError

        raise BackendError(f"nccl: this CuPy's NCCL bindings have no {name}")
    return int(value)
