"""The collectives of colls_jax: functional, on jax.Array, eager or under jit/grad/vmap.

Every function follows the same steps: resolve the group (a non-member gets None, as in the
core), check the arguments at trace time (:mod:`colls_jax._args`), bind the static arguments
into a :class:`~colls_jax._jit.HostOp`, and run it through :mod:`colls_jax._grad` (which gives
the linear collectives their VJP) and :mod:`colls_jax._jit` (eager call or ordered callback).
The ``_op_*`` builders take checked arguments and a :class:`~colls_jax._host.Target` (the
caller's group argument and its size); the VJPs reuse them.

Shapes follow ``jax.lax``: ``all_gather`` stacks on a new axis 0 (``tiled=True`` concatenates
along axis 0 instead), ``reduce_scatter`` expects axis 0 equal to the group size and removes it
(``tiled=True``: axis 0 divisible by the group size, kept). Results have the same shape on
every rank; rooted ops give zeros where the MPI/torch op leaves nothing (``gather``, ``reduce``
off the root).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax

from colls.reduce_ops import RedOpType, ReduceOp
from colls_jax import _args, _grad, _host
from colls_jax._host import Target
from colls_jax._host import bind as _bind
from colls_jax._jit import HostOp, call

# Reductions whose result is a linear map of the inputs, and whose VJP is the same all_reduce.
_LINEAR_REDUCTIONS = frozenset({RedOpType.SUM, RedOpType.AVG, RedOpType.PREMUL_SUM})


def _same(shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape


# -- builders: resolved arguments -> differentiable calls ---------------------------------------


def _op_all_reduce(x: jax.Array, op: Any, kind: RedOpType, target: Target) -> jax.Array:
    hop = HostOp("all_reduce", _bind(_host.all_reduce, target, "all_reduce", op=op), _same,
                 in_place=True)
    forward = partial(call, hop)
    if kind in _LINEAR_REDUCTIONS:
        return _grad.linear(x, forward, forward)
    return _grad.not_differentiable(
        x, forward,
        f"colls_jax.all_reduce with ReduceOp.{kind.name} is not differentiable; only SUM, AVG "
        "and PREMUL_SUM are (their VJP is the same all_reduce of the cotangents)",
    )


def _op_broadcast(x: jax.Array, root: int, target: Target) -> jax.Array:
    hop = HostOp("broadcast", _bind(_host.broadcast, target, "broadcast", root=root), _same,
                 in_place=True)
    return _grad.linear(x, partial(call, hop),
                        lambda g: _op_reduce(g, root, ReduceOp.SUM, RedOpType.SUM, target))


def _op_reduce(x: jax.Array, root: int, op: Any, kind: RedOpType, target: Target
               ) -> jax.Array:
    hop = HostOp("reduce", _bind(_host.reduce, target, "reduce", root=root, op=op), _same,
                 in_place=True)
    forward = partial(call, hop)
    if kind is RedOpType.SUM:
        return _grad.linear(x, forward, lambda g: _op_broadcast(g, root, target))
    return _grad.not_differentiable(
        x, forward,
        f"colls_jax.reduce with ReduceOp.{kind.name} is not differentiable; only SUM is (its "
        "VJP is a broadcast of the root's cotangent)",
    )


def _op_all_gather(x: jax.Array, tiled: bool, target: Target) -> jax.Array:
    size = target.size
    if tiled:
        hop = HostOp("all_gather", _bind(_host.all_gather, target, "all_gather", tiled=True),
                     lambda s: (size * s[0], *s[1:]), in_axis=1, out_axis=1)
    else:
        hop = HostOp("all_gather", _bind(_host.all_gather, target, "all_gather", tiled=False),
                     lambda s: (size, *s), in_axis=0, out_axis=1)
    return _grad.linear(
        x, partial(call, hop),
        lambda g: _op_reduce_scatter(g, ReduceOp.SUM, RedOpType.SUM, tiled, target))


def _op_reduce_scatter(x: jax.Array, op: Any, kind: RedOpType, tiled: bool, target: Target
                       ) -> jax.Array:
    size = target.size
    host = _bind(_host.reduce_scatter, target, "reduce_scatter", op=op, tiled=tiled)
    if tiled:
        hop = HostOp("reduce_scatter", host, lambda s: (s[0] // size, *s[1:]), 1, 1)
    else:
        hop = HostOp("reduce_scatter", host, lambda s: s[1:], in_axis=1, out_axis=0)
    forward = partial(call, hop)
    if kind is RedOpType.SUM:
        return _grad.linear(x, forward, lambda g: _op_all_gather(g, tiled, target))
    if kind is RedOpType.AVG:
        return _grad.linear(x, forward, lambda g: _op_all_gather(g / size, tiled, target))
    return _grad.not_differentiable(
        x, forward,
        f"colls_jax.reduce_scatter with ReduceOp.{kind.name} is not differentiable; only SUM "
        "and AVG are (their VJP is an all_gather of the cotangents)",
    )


def _op_all_to_all(x: jax.Array, target: Target) -> jax.Array:
    hop = HostOp("all_to_all", _bind(_host.all_to_all, target, "all_to_all"), _same, 1, 1)
    forward = partial(call, hop)
    return _grad.linear(x, forward, forward)  # a permutation of blocks that is its own inverse


def _op_gather(x: jax.Array, root: int, target: Target) -> jax.Array:
    size = target.size
    hop = HostOp("gather", _bind(_host.gather, target, "gather", root=root), lambda s: (size, *s),
                 in_axis=0, out_axis=1)
    return _grad.linear(x, partial(call, hop), lambda g: _op_scatter(g, root, target))


def _op_scatter(x: jax.Array, root: int, target: Target) -> jax.Array:
    hop = HostOp("scatter", _bind(_host.scatter, target, "scatter", root=root), lambda s: s[1:],
                 in_axis=1, out_axis=0)
    return _grad.linear(x, partial(call, hop), lambda g: _op_gather(g, root, target))


# -- the public functions -----------------------------------------------------------------------


def all_reduce(x: Any, op: Any = ReduceOp.SUM, group: Any = None) -> jax.Array | None:
    """Return the reduction of ``x`` over the group; every rank gets it.

    Args:
        x: A jax.Array (or array-like).
        op: A ``ReduceOp`` (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR) or
            ``make_premul_sum(factor)``, allowed for ``x``'s dtype as in torch.
        group: A colls process group (default: the world).

    Returns:
        A new array of ``x``'s shape and dtype; None on a rank outside ``group``.
        Differentiable for SUM, AVG and PREMUL_SUM (VJP: the same all_reduce of the cotangents).

    Raises:
        TypeError: ``op`` does not apply to ``x``'s dtype (BAND on floats, AVG on integers).
    """
    pg = _args.group_of(group)
    if pg is None:
        return None
    x = _args.as_jax(x, "all_reduce")
    spec = _args.reduce_op(op, x, "all_reduce")
    return _op_all_reduce(x, op, spec.kind, Target(group, pg.size))


def broadcast(x: Any, src: int | None = None, group: Any = None, *,
              group_src: int | None = None) -> jax.Array | None:
    """Return ``x`` of rank ``src`` (a world rank; or ``group_src``, a group rank) on every rank.

    Every rank passes an ``x`` of the same shape and dtype; only the root's values matter.
    Differentiable (VJP: the cotangents summed onto the root, zeros elsewhere).
    """
    pg = _args.group_of(group)
    if pg is None:
        return None
    x = _args.as_jax(x, "broadcast")
    root = _args.root(pg, src, group_src, arg="src", name="broadcast")
    return _op_broadcast(x, root, Target(group, pg.size))


def reduce(x: Any, dst: int | None = None, op: Any = ReduceOp.SUM, group: Any = None, *,
           group_dst: int | None = None) -> jax.Array | None:
    """Return the reduction of ``x`` on rank ``dst`` (or ``group_dst``), zeros on other ranks.

    Differentiable for SUM (VJP: a broadcast of the root's cotangent).
    """
    pg = _args.group_of(group)
    if pg is None:
        return None
    x = _args.as_jax(x, "reduce")
    root = _args.root(pg, dst, group_dst, arg="dst", name="reduce")
    spec = _args.reduce_op(op, x, "reduce")
    return _op_reduce(x, root, op, spec.kind, Target(group, pg.size))


def all_gather(x: Any, group: Any = None, *, tiled: bool = False) -> jax.Array | None:
    """Return every rank's ``x``, in rank order, on every rank.

    Args:
        x: The local array; the same shape and dtype on every rank.
        group: A colls process group (default: the world).
        tiled: False (default, as ``jax.lax.all_gather``): stack on a new axis 0, giving shape
            ``(size, *x.shape)``. True: concatenate along axis 0, giving
            ``(size * x.shape[0], *x.shape[1:])``.

    Differentiable (VJP: reduce_scatter(SUM) of the cotangents, with the same ``tiled``).
    """
    pg = _args.group_of(group)
    if pg is None:
        return None
    x = _args.as_jax(x, "all_gather")
    if tiled:
        _args.need_axis0(x, "all_gather", "tiled=True concatenates along axis 0")
    return _op_all_gather(x, bool(tiled), Target(group, pg.size))


def reduce_scatter(x: Any, op: Any = ReduceOp.SUM, group: Any = None, *, tiled: bool = False
                   ) -> jax.Array | None:
    """Reduce ``x`` over the group and return this rank's block of axis 0.

    Args:
        x: With ``tiled=False`` (default, as ``jax.lax.psum_scatter``) axis 0 must equal the
            group size and rank r gets ``reduced[r]`` (axis 0 removed). With ``tiled=True`` axis
            0 must be divisible by the group size and rank r gets the r-th block of rows.
        op: A ``ReduceOp`` allowed for ``x``'s dtype.
        group: A colls process group (default: the world).
        tiled: See ``x``.

    Differentiable for SUM and AVG (VJP: an all_gather of the cotangents).
    """
    pg = _args.group_of(group)
    if pg is None:
        return None
    x = _args.as_jax(x, "reduce_scatter")
    if tiled:
        _args.axis0_divisible(x, pg.size, "reduce_scatter", "tiled=True splits axis 0 in blocks")
    else:
        _args.axis0_equal(x, pg.size, "reduce_scatter",
                          "tiled=False gives rank r the row x[r]; pass tiled=True for blocks")
    spec = _args.reduce_op(op, x, "reduce_scatter")
    return _op_reduce_scatter(x, op, spec.kind, bool(tiled), Target(group, pg.size))


def all_to_all(x: Any, group: Any = None) -> jax.Array | None:
    """Split axis 0 of ``x`` in group-size blocks, send block j to rank j, return what came.

    The result has ``x``'s shape: block i of it is the block rank i sent to this rank (as
    ``torch.distributed.all_to_all_single`` with equal splits). Axis 0 must be divisible by the
    group size. Differentiable (the VJP is the same all_to_all).
    """
    pg = _args.group_of(group)
    if pg is None:
        return None
    x = _args.as_jax(x, "all_to_all")
    _args.axis0_divisible(x, pg.size, "all_to_all", "axis 0 is split in one block per rank")
    return _op_all_to_all(x, Target(group, pg.size))


def gather(x: Any, dst: int | None = None, group: Any = None, *, group_dst: int | None = None
           ) -> jax.Array | None:
    """Return every rank's ``x`` stacked on axis 0 on rank ``dst`` (default 0), zeros elsewhere.

    The result has shape ``(size, *x.shape)`` on every rank, so jitted code is the same on all
    ranks. Differentiable (VJP: a scatter of the root's cotangent).
    """
    pg = _args.group_of(group)
    if pg is None:
        return None
    x = _args.as_jax(x, "gather")
    root = _args.root(pg, dst, group_dst, arg="dst", name="gather", default=0)
    return _op_gather(x, root, Target(group, pg.size))


def scatter(x: Any, src: int | None = None, group: Any = None, *, group_src: int | None = None
            ) -> jax.Array | None:
    """Return ``x[r]`` of rank ``src`` (default 0) on group rank r.

    Every rank passes an ``x`` of shape ``(size, ...)`` (only the root's values are read), so
    jitted code is the same on all ranks. Differentiable (VJP: a gather of the cotangents onto
    the root, zeros elsewhere).
    """
    pg = _args.group_of(group)
    if pg is None:
        return None
    x = _args.as_jax(x, "scatter")
    _args.axis0_equal(x, pg.size, "scatter", "the root sends x[r] to rank r")
    root = _args.root(pg, src, group_src, arg="src", name="scatter", default=0)
    return _op_scatter(x, root, Target(group, pg.size))
