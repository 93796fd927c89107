"""Functional collectives: return new arrays of the input's type, never write into the input.

For immutable arrays (JAX) and for code that prefers values to mutation. Each function copies the
input once into a scratch buffer on the input's device (NumPy, or CuPy for CUDA memory), runs the
in-place collective on it, and returns the result as an array of the input's framework (NumPy,
torch, JAX, CuPy) on that device. A CUDA array needs a group whose backend moves CUDA arrays
(tcp stages them through the host; nccl; mpi), like the in-place calls.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from colls import buffers
from colls import collectives as c
from colls import dispatch as d
from colls.buffers import Buffer
from colls.reduce_ops import ReduceOp


def _result(template: Any, scratch: Buffer) -> Any:
    return buffers.new_array_like(template, scratch.array.reshape(scratch.shape))


def _group_size(group: Any, op: str) -> int:
    pg = d.resolve_group(group)
    if pg is None:
        raise ValueError(
            f"functional.{op} on rank {d.my_rank()}: this process is not a member of the group"
        )
    return pg.size


def _input(array: Any, op: str, group: Any) -> Buffer:
    pg = d.resolve_group(group)  # the device check is against this group's backend
    if any(cls.__name__.endswith("Tracer") for cls in type(array).__mro__):
        raise TypeError(
            f"functional.{op}: got a traced JAX value ({type(array).__name__}); inside jax.jit, "
            f"grad or vmap use colls_jax.{op}, which runs through ordered host callbacks"
        )
    return d.import_array(pg, array, arg="array", op=f"functional.{op}", writable=False)


#: Python scalars :func:`all_reduce` takes, and the dtype each is reduced in.
_SCALAR_DTYPES = ((bool, np.bool_), (int, np.int64), (float, np.float64),
                  (complex, np.complex128))


def all_reduce(array: Any, op: Any = ReduceOp.SUM, group: Any = None) -> Any:
    """Return the reduction of ``array`` over the group (every rank gets it).

    ``array`` may also be a Python scalar (``bool``, ``int``, ``float``, ``complex``) or a NumPy
    scalar: the result is then the reduced Python scalar (mpi4py's ``comm.allreduce(x)``), as
    a residual norm in a solver loop needs: ``total = colls.functional.all_reduce(local)``.
    An ``int`` is reduced as int64, a ``float`` as float64.
    """
    if isinstance(array, (bool, int, float, complex, np.generic)):
        return _all_reduce_scalar(array, op, group)
    buf = _input(array, "all_reduce", group)
    out = buffers.scratch(buf)
    c.all_reduce(out, op=op, group=group)
    return _result(array, out)


def _all_reduce_scalar(value: Any, op: Any, group: Any) -> Any:
    if isinstance(value, np.generic):
        box = np.array(value)  # its own dtype
    else:
        dtype = next(dt for kind, dt in _SCALAR_DTYPES if isinstance(value, kind))
        try:
            box = np.array(value, dtype=dtype)
        except OverflowError:
            raise OverflowError(
                f"functional.all_reduce on rank {d.my_rank()}: {value} does not fit in int64"
            ) from None
    box = box.reshape(1)  # 1-D: the fast path's common case
    c.all_reduce(box, op=op, group=group)
    return box[0].item()


def broadcast(array: Any, src: int | None = None, group: Any = None,
              group_src: int | None = None) -> Any:
    """Return rank ``src``'s ``array`` on every rank."""
    buf = _input(array, "broadcast", group)
    out = buffers.scratch(buf)
    c.broadcast(out, src=src, group=group, group_src=group_src)
    return _result(array, out)


def all_gather(array: Any, group: Any = None) -> Any:
    """Return every rank's ``array`` stacked along a new leading axis (shape ``(size, *shape)``)."""
    buf = _input(array, "all_gather", group)
    size = _group_size(group, "all_gather")
    out = buffers.scratch(buf, numel=buf.numel * size, shape=(size, *buf.shape))
    c.all_gather_into_tensor(out, buf, group=group)
    return _result(array, out)


def reduce_scatter(array: Any, op: Any = ReduceOp.SUM, group: Any = None) -> Any:
    """Reduce ``array`` over the group and return this rank's slice of dim 0."""
    buf = _input(array, "reduce_scatter", group)
    size = _group_size(group, "reduce_scatter")
    rows = buf.shape[0] if buf.shape else 1
    if rows % size:
        raise ValueError(
            f"functional.reduce_scatter on rank {d.my_rank()}: dim 0 of array ({rows}) must be "
            f"divisible by the group size {size}"
        )
    shape = (rows // size, *buf.shape[1:])
    out = buffers.scratch(buf, numel=buf.numel // size, shape=shape)
    c.reduce_scatter_tensor(out, buf, op=op, group=group)
    return _result(array, out)


def all_to_all(array: Any, group: Any = None) -> Any:
    """Split dim 0 of ``array`` into group-size pieces, send piece j to rank j, return what came."""
    buf = _input(array, "all_to_all", group)
    out = buffers.scratch(buf, numel=buf.numel, shape=buf.shape)
    c.all_to_all_single(out, buf, group=group)
    return _result(array, out)
