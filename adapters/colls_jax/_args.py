"""Argument checks of colls_jax, done at trace time so that mistakes never reach a callback.

An exception raised inside a host callback surfaces as an XLA runtime error after the program
has started, and possibly on one rank only. Everything that can be checked from shapes, dtypes
and ranks is therefore checked here, in Python, while the function is traced (or called
eagerly), with messages that name the op, the rank, the argument and what was expected. Rank
arguments go through the core's own translation (world rank ``src``/``dst`` or group rank
``group_src``/``group_dst``), so they mean exactly what they mean in ``colls``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from colls import dispatch as d
from colls import dtypes
from colls.process_group import ProcessGroup
from colls.reduce_ops import ReduceSpec, resolve_op


def where(name: str) -> str:
    """Return the message prefix of op ``name`` on this rank ("colls_jax.gather on rank 1")."""
    return f"colls_jax.{name} on rank {d.my_rank()}"


def as_jax(x: Any, name: str) -> jax.Array:
    """Return ``x`` as a JAX array (tracers and arrays unchanged, array-likes converted).

    Raises:
        TypeError: ``x`` is not array-like, or its dtype is one colls cannot move.
    """
    if not isinstance(x, jax.Array):
        try:
            x = jnp.asarray(x)
        except TypeError as exc:
            raise TypeError(f"{where(name)}: x must be a jax.Array or array-like, got "
                            f"{type(x).__name__} ({exc})") from None
    try:
        dtypes.from_any(x.dtype)
    except TypeError as exc:
        raise TypeError(f"{where(name)}: x has dtype {x.dtype}, which colls cannot move: {exc}"
                        ) from None
    return x


def group_of(group: Any) -> ProcessGroup | None:
    """Resolve ``group`` as the core does (None for a non-member)."""
    return d.resolve_group(group)


def root(pg: ProcessGroup, rank: int | None, group_rank: int | None, *, arg: str, name: str,
         default: int | None = None) -> int:
    """Return the group rank of a root given as world rank ``rank`` or as ``group_rank``.

    Raises:
        ValueError: both given, neither given (and no default), or out of range.
        TypeError: not an int.
    """
    if rank is None and group_rank is None and default is not None:
        rank = default
    found = d.group_rank_of(pg, rank, group_rank, arg=arg, op=f"colls_jax.{name}")
    assert found is not None  # allow_any is False, so a rank was returned or an error raised
    return found


def reduce_op(op: Any, x: jax.Array, name: str) -> ReduceSpec:
    """Check that reduce op ``op`` applies to ``x``'s dtype (TypeError otherwise)."""
    return resolve_op(op, dtypes.from_any(x.dtype), op_name=f"colls_jax.{name}",
                      rank=d.my_rank())


def need_axis0(x: jax.Array, name: str, why: str) -> int:
    """Return ``x.shape[0]``; ``x`` must have at least one axis.

    Raises:
        ValueError: ``x`` is 0-d.
    """
    if x.ndim == 0:
        raise ValueError(f"{where(name)}: x must have at least one axis ({why}), got a 0-d "
                         "array")
    return int(x.shape[0])


def axis0_equal(x: jax.Array, size: int, name: str, why: str) -> None:
    """Require ``x.shape[0] == size`` (ValueError naming the shape otherwise)."""
    rows = need_axis0(x, name, why)
    if rows != size:
        raise ValueError(f"{where(name)}: x has shape {tuple(x.shape)}; axis 0 must equal the "
                         f"group size {size} ({why})")


def axis0_divisible(x: jax.Array, size: int, name: str, why: str) -> None:
    """Require ``x.shape[0] % size == 0`` (ValueError naming the shape otherwise)."""
    rows = need_axis0(x, name, why)
    if rows % size:
        raise ValueError(f"{where(name)}: x has shape {tuple(x.shape)}; axis 0 ({rows}) must "
                         f"be divisible by the group size {size} ({why})")


def tag(value: Any, name: str) -> int:
    """Check a point-to-point tag (an int >= 0), as the core does."""
    return d.check_tag(value, op=f"colls_jax.{name}")
