"""colls dtypes and reduce ops as MPI datatypes and MPI ops.

Data movement (broadcast, gathers, all_to_all, point-to-point) sends bytes: ``MPI.BYTE`` with
byte counts, so every dtype moves, bfloat16 included. A reduction needs the element type and
the op, chosen here once per (op, dtype) and cached:

* integers and unsigned integers: the fixed-width MPI types with the built-in ops (SUM wraps
  like NumPy's; BAND/BOR/BXOR are MPI's bitwise ops);
* bool: ``MPI.C_BOOL`` with MPI's logical ops, following torch (SUM/MAX/BOR = logical or,
  PRODUCT/MIN/BAND = logical and, BXOR = logical xor);
* float32/64 and complex64/128: ``MPI.FLOAT``/``DOUBLE``/``C_FLOAT_COMPLEX``/
  ``C_DOUBLE_COMPLEX`` with the built-in SUM and PROD;
* what MPI lacks is handled with a user-defined, commutative ``MPI.Op`` that folds MPI's
  buffers through the spec's own NumPy kernel (:meth:`ReduceSpec.combine`), so the result is
  bit-for-bit what colls' other backends compute: float16 and bfloat16 (no standard MPI type;
  they travel as ``MPI.UINT16_T`` words, bfloat16 reduced through float32 with round to nearest
  even), and real MIN/MAX (MPI's built-in MIN/MAX drop NaN; torch propagates it).

AVG and PREMUL_SUM reach the backend as SUM: the core scales before (PREMUL_SUM) and divides
after (AVG). Complex MIN/MAX never get here: the core refuses them before any byte moves.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from colls import dtypes
from colls.reduce_ops import RedOpType

if TYPE_CHECKING:
    from colls.dtypes import DType
    from colls.reduce_ops import ReduceSpec

#: Built-in MPI op names per kind, for numeric dtypes.
_NUMERIC_OPS: Final = {
    RedOpType.SUM: "SUM", RedOpType.AVG: "SUM", RedOpType.PREMUL_SUM: "SUM",
    RedOpType.PRODUCT: "PROD", RedOpType.MIN: "MIN", RedOpType.MAX: "MAX",
    RedOpType.BAND: "BAND", RedOpType.BOR: "BOR", RedOpType.BXOR: "BXOR",
}  # fmt: skip
#: torch's logical reading of each kind on bool.
_BOOL_OPS: Final = {
    RedOpType.SUM: "LOR", RedOpType.MAX: "LOR", RedOpType.BOR: "LOR",
    RedOpType.PRODUCT: "LAND", RedOpType.MIN: "LAND", RedOpType.BAND: "LAND",
    RedOpType.BXOR: "LXOR",
}  # fmt: skip
#: MPI datatype name per colls dtype, for reductions with built-in ops.
_MPI_TYPES: Final = {
    "bool": "C_BOOL",
    "int8": "INT8_T", "int16": "INT16_T", "int32": "INT32_T", "int64": "INT64_T",
    "uint8": "UINT8_T", "uint16": "UINT16_T", "uint32": "UINT32_T", "uint64": "UINT64_T",
    "float32": "FLOAT", "float64": "DOUBLE",
    "complex64": "C_FLOAT_COMPLEX", "complex128": "C_DOUBLE_COMPLEX",
    "float16": "UINT16_T", "bfloat16": "UINT16_T",  # words, reduced by a user-defined op
}  # fmt: skip
_HALF_PRECISION: Final = ("float16", "bfloat16")


def needs_user_op(kind: RedOpType, dtype: DType) -> bool:
    """Return whether (kind, dtype) is reduced by a colls-defined MPI op, not a built-in one."""
    if dtype.name in _HALF_PRECISION:
        return True
    return dtype.is_floating and kind in (RedOpType.MIN, RedOpType.MAX)


class ReductionTable:
    """(MPI datatype, MPI op) per (reduce kind, dtype), built on first use and cached.

    One table serves the process: MPI handles are process-wide, and the user-defined ops live
    until MPI is finalised (MPI frees them then).

    Args:
        MPI: the initialised ``mpi4py.MPI`` module.
    """

    def __init__(self, MPI: Any) -> None:
        self._MPI = MPI
        self._cache: dict[tuple[RedOpType, DType], tuple[Any, Any]] = {}
        # Fast path by identity (hashing a RedOpType runs Python code); holds the spec alive,
        # so an id is never reused for another spec. Only factor-less specs, which the core
        # caches: a PREMUL_SUM spec is new on every call and would pile up here.
        self._by_spec: dict[int, tuple[ReduceSpec, tuple[Any, Any]]] = {}
        self._lock = threading.Lock()

    def lookup(self, spec: ReduceSpec) -> tuple[Any, Any]:
        """Return ``(datatype, op)`` reducing ``spec.dtype`` with ``spec.kind``.

        Raises:
            TypeError: a combination the core should have refused (complex MIN/MAX, bitwise
                ops on floats), named, rather than a wrong result.
        """
        hit = self._by_spec.get(id(spec))
        if hit is not None and hit[0] is spec:  # the core caches specs without a factor
            return hit[1]
        key = (spec.kind, spec.dtype)
        found = self._cache.get(key)
        if found is None:
            with self._lock:
                found = self._cache.get(key)
                if found is None:
                    found = self._build(spec)
                    self._cache[key] = found
        if spec.factor is None:
            self._by_spec[id(spec)] = (spec, found)
        return found

    def _build(self, spec: ReduceSpec) -> tuple[Any, Any]:
        MPI, kind, dtype = self._MPI, spec.kind, spec.dtype
        datatype = getattr(MPI, _MPI_TYPES[dtype.name])
        if needs_user_op(kind, dtype):
            return datatype, self._user_op(spec)
        if dtype is dtypes.BOOL:
            return datatype, getattr(MPI, _BOOL_OPS[kind])
        bitwise = kind in (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR)
        ordered = kind in (RedOpType.MIN, RedOpType.MAX)
        if (bitwise and dtype.kind not in ("int", "uint")) or (ordered and dtype.is_complex):
            raise TypeError(
                f"mpi: ReduceOp.{kind.name} is not defined for {dtype.name} (the core should "
                "have refused it before communication)"
            )
        return datatype, getattr(MPI, _NUMERIC_OPS[kind])

    def _user_op(self, spec: ReduceSpec) -> Any:
        """Create a commutative MPI op folding MPI's buffers with ``spec.combine``."""
        holder = spec.dtype.numpy
        combine = spec.combine

        def reduce_buffers(inbuf: Any, inoutbuf: Any, _datatype: Any) -> None:
            # MPI asks for inoutbuf = inbuf (op) inoutbuf; every op here is commutative.
            incoming = np.frombuffer(inbuf, dtype=holder)
            acc = np.frombuffer(inoutbuf, dtype=holder)
            combine(acc, incoming)

        return self._MPI.Op.Create(reduce_buffers, commute=True)
