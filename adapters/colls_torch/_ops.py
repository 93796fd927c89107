"""Reduce operators: torch's ReduceOp objects in, colls' ops out, with torch's dtype rules.

colls_torch exports torch's own ``ReduceOp`` (and the deprecated ``reduce_op``), so a script
that passes ``torch.distributed.ReduceOp.SUM`` or ``colls_torch.ReduceOp.SUM`` gets the same
object. :func:`to_colls` accepts every spelling torch accepts (``ReduceOp.SUM``, a
``ReduceOp(...)`` instance as found in ``AllreduceOptions.reduceOp``, and
``torch.distributed._make_nccl_premul_sum(factor)``) plus colls' own ops.

:func:`check_reduction` applies torch's rules before any byte moves, with torch's exception
types: ValueError for MAX/MIN/PRODUCT/bitwise ops on complex tensors in ``all_reduce`` (torch's
Python check), RuntimeError for bitwise ops on floating types and AVG on integers (gloo's checks).
"""

from __future__ import annotations

from typing import Any, Final

import torch
import torch.distributed as _dist

import colls
from colls.reduce_ops import PremulSum, RedOpType

ReduceOp = _dist.ReduceOp
_TorchRedOpType = _dist.ReduceOp.RedOpType
#: torch's own constructor of a PREMUL_SUM op (``factor``: a number, or a one-element tensor,
#: which may differ per rank): the op is torch's, so code written for torch passes it unchanged,
#: and :func:`to_colls` turns it into colls' PremulSum (sum over ranks of factor * x).
_make_nccl_premul_sum = _dist._make_nccl_premul_sum

#: Ops torch refuses on complex tensors, by name: read from torch's own
#: ``supports_complex`` (which colls_torch also exports), so the rule lives in one place.
_COMPLEX_DENY: Final = frozenset(
    name for name, kind in _TorchRedOpType.__members__.items() if not _dist.supports_complex(kind)
)
_BITWISE: Final = frozenset({"BAND", "BOR", "BXOR"})
#: Functions where torch raises ValueError for complex + a denied op (its Python-level check).
_COMPLEX_CHECKED: Final = frozenset({"all_reduce", "all_reduce_coalesced"})


def _premul(factor: Any) -> PremulSum:
    if isinstance(factor, torch.Tensor):
        factor = factor.detach().cpu().item()
    return colls.make_premul_sum(factor)


#: colls' op of each of torch's op kinds (all but PREMUL_SUM, which needs a factor).
_BY_TORCH_KIND: Final = {
    kind: RedOpType[name] for name, kind in _TorchRedOpType.__members__.items()
    if name in RedOpType.__members__ and name != "PREMUL_SUM"
}


def to_colls(op: Any) -> Any:
    """Return the colls op for any op spelling torch (or colls) accepts.

    Raises:
        TypeError: ``op`` is not a reduce op.
    """
    found = _BY_TORCH_KIND.get(op) if type(op) is _TorchRedOpType else None
    if found is not None:  # ReduceOp.SUM, ...: the common case, one lookup
        return found
    if isinstance(op, (RedOpType, PremulSum)):
        return op
    if isinstance(op, _TorchRedOpType):  # ReduceOp.SUM (checked first: it also passes
        if op == _TorchRedOpType.PREMUL_SUM:  # isinstance(op, ReduceOp))
            raise ValueError(
                "ReduceOp.PREMUL_SUM needs a factor: use "
                "torch.distributed._make_nccl_premul_sum(factor)"
            )
        return RedOpType[op.name]
    if isinstance(op, ReduceOp):  # an instance: opts.reduceOp, ReduceOp(...), premul sum
        if op.op == _TorchRedOpType.PREMUL_SUM:
            return _premul(op.factor)
        return RedOpType[op.op.name]
    if isinstance(op, str):
        return op  # colls accepts names ("sum", "max"), as functional collectives do
    raise TypeError(
        f"op must be a torch.distributed.ReduceOp (e.g. ReduceOp.SUM), got {type(op).__name__} "
        f"{op!r}"
    )


def kind_name(op: Any) -> str:
    """Return the op's kind as an upper-case name ("SUM", "PREMUL_SUM")."""
    if isinstance(op, PremulSum):
        return "PREMUL_SUM"
    if isinstance(op, RedOpType):
        return op.name
    return str(op).strip().upper()


def check_reduction(op: Any, dtype: torch.dtype, fn: str) -> None:
    """Refuse (op, dtype) pairs as torch does, before any communication.

    Args:
        op: a colls op (from :func:`to_colls`).
        dtype: the tensors' dtype.
        fn: the public function's name (torch checks complex only in all_reduce).

    Raises:
        ValueError: complex tensors with an op torch does not support on them (all_reduce).
        RuntimeError: an op gloo refuses for the dtype (bitwise on floats, AVG on integers).
    """
    if op is RedOpType.SUM:
        return  # every dtype torch moves can be summed
    name = kind_name(op)
    if dtype.is_complex and name in _COMPLEX_DENY:
        if fn in _COMPLEX_CHECKED:
            raise ValueError(f"{fn} does not support RedOpType.{name} on complex tensors")
        if name != "PRODUCT":  # colls multiplies complex numbers correctly; the rest is garbage
            raise RuntimeError(f"{fn}: cannot use ReduceOp.{name} with complex dtype {dtype}")
    floating = dtype.is_floating_point or dtype.is_complex
    if name in _BITWISE and floating:
        raise RuntimeError(f"Cannot use ReduceOp.{name} with non-integral dtype")
    if name in ("AVG", "PREMUL_SUM") and not floating:
        raise RuntimeError(
            f"{fn}: cannot use ReduceOp.{name} with integral dtype {dtype} (the result is not "
            "an integer); use ReduceOp.SUM and divide"
        )


__all__ = ["ReduceOp", "check_reduction", "kind_name", "to_colls"]
