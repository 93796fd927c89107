"""Point-to-point for JAX: send, recv, ppermute and its ring form shift, and barrier.

``send``/``recv`` are blocking pairs, as in ``colls.send``/``colls.recv``; under jit they are
ordered callbacks like every collective, so a program that would deadlock eagerly (both ranks
receive first) deadlocks under jit too. ``ppermute`` (as ``jax.lax.ppermute``: a list of
``(source, destination)`` group ranks) and ``shift`` start all their sends and receives before
waiting, so rings and exchanges are safe, and they are differentiable (VJP: the inverse
permutation).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from colls import dtypes
from colls.process_group import ProcessGroup
from colls_jax import _args, _grad, _host, _jit
from colls_jax._host import Target
from colls_jax._host import bind as _bind
from colls_jax._jit import HostOp, call


def _same(shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape


def _check_perm(perm: Any, size: int) -> tuple[tuple[int, int], ...]:
    """Return ``perm`` as a tuple of (source, destination) pairs, checked like jax.lax.ppermute.

    Raises:
        TypeError: not a sequence of pairs of ints.
        ValueError: a rank out of range, or a rank twice as source or twice as destination.
    """
    where = _args.where("ppermute")
    try:
        pairs = tuple((s, t) for s, t in perm)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: perm must be a sequence of (source, destination) pairs of "
                        f"group ranks, got {perm!r}") from None
    for source, dest in pairs:
        for value in (source, dest):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{where}: perm holds {value!r}; ranks must be ints")
            if not 0 <= value < size:
                raise ValueError(f"{where}: perm holds rank {value}, out of range for a group "
                                 f"of size {size} (expected 0..{size - 1})")
    for index, label in ((0, "source"), (1, "destination")):
        ranks = [pair[index] for pair in pairs]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"{where}: perm names a {label} rank more than once: {list(pairs)}")
    return tuple((int(s), int(t)) for s, t in pairs)


def _op_ppermute(x: jax.Array, perm: tuple[tuple[int, int], ...], target: Target
                 ) -> jax.Array:
    hop = HostOp("ppermute", _bind(_host.ppermute, target, "ppermute", perm=perm), _same)
    inverse = tuple((t, s) for s, t in perm)
    return _grad.linear(x, partial(call, hop), lambda g: _op_ppermute(g, inverse, target))


def ppermute(x: Any, perm: Sequence[tuple[int, int]], group: Any = None) -> jax.Array | None:
    """Send ``x`` from each source rank to its destination, as ``jax.lax.ppermute``.

    Args:
        x: The local array; the same shape and dtype on every rank.
        perm: (source, destination) pairs of group ranks; each rank at most once as a source
            and at most once as a destination.
        group: A colls process group (default: the world).

    Returns:
        The array sent to this rank, or zeros if no pair has this rank as destination.
        Differentiable (VJP: the inverse permutation of the cotangents).
    """
    pg = _args.group_of(group)
    if pg is None:
        return None
    x = _args.as_jax(x, "ppermute")
    return _op_ppermute(x, _check_perm(perm, pg.size), Target(group, pg.size))


def shift(x: Any, offset: int = 1, group: Any = None) -> jax.Array | None:
    """Return the ``x`` of group rank ``(rank - offset) % size``: a ring shift by ``offset``.

    Group rank r sends ``x`` to rank ``(r + offset) % size``. Differentiable (VJP: the shift by
    ``-offset``).
    """
    pg = _args.group_of(group)
    if pg is None:
        return None
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
        raise TypeError(f"{_args.where('shift')}: offset must be an int, got {offset!r}")
    x = _args.as_jax(x, "shift")
    size = pg.size
    perm = tuple((r, (r + int(offset)) % size) for r in range(size))
    return _op_ppermute(x, perm, Target(group, pg.size))


def send(x: Any, dst: int | None = None, group: Any = None, tag: int = 0, *,
         group_dst: int | None = None) -> None:
    """Send ``x`` to rank ``dst`` (a world rank; or ``group_dst``); the peer calls :func:`recv`.

    Under jit the send is an ordered callback with no output: it runs even though nothing uses
    it. No gradient flows through a send (it has no output); ``x`` is passed through
    ``jax.lax.stop_gradient``.
    """
    pg = _args.group_of(group)
    if pg is None:
        return None
    x = _args.as_jax(x, "send")
    tag = _args.tag(tag, "send")
    peer = _args.root(pg, dst, group_dst, arg="dst", name="send")
    _check_not_self(pg, peer, "send", "dst")
    if _jit.is_traced(x):
        x = jax.lax.stop_gradient(x)
    host = _bind(_host.send, Target(group, pg.size), "send", dest=peer, tag=tag)
    call(HostOp("send", host, None, batchable=False), x)
    return None


def recv(shape: Sequence[int], dtype: Any, src: int | None = None, group: Any = None,
         tag: int = 0, *, group_src: int | None = None) -> jax.Array | None:
    """Return a new array of ``shape`` and ``dtype`` received from rank ``src`` (or group_src).

    The source must be given (receiving from any rank is not offered: under jit the sender
    would be a runtime value).
    """
    pg = _args.group_of(group)
    if pg is None:
        return None
    tag = _args.tag(tag, "recv")
    try:
        shape = tuple(int(n) for n in shape)
        np_dtype = np.dtype(jnp.dtype(dtype))
        dtypes.from_any(np_dtype)
    except TypeError as exc:
        raise TypeError(f"{_args.where('recv')}: shape must be a sequence of ints and dtype a "
                        f"dtype colls can move, got shape={shape!r}, dtype={dtype!r} ({exc})"
                        ) from None
    if any(n < 0 for n in shape):
        raise ValueError(f"{_args.where('recv')}: shape {shape} has a negative dimension")
    np_dtype = np.dtype(jax.dtypes.canonicalize_dtype(np_dtype))
    peer = _args.root(pg, src, group_src, arg="src", name="recv")
    _check_not_self(pg, peer, "recv", "src")
    host = _bind(_host.recv, Target(group, pg.size), "recv", source=peer, tag=tag)
    return _jit.call_nullary("recv", host, jax.ShapeDtypeStruct(shape, np_dtype))


def barrier(group: Any = None) -> None:
    """Wait until every rank of the group has reached the barrier (ordered under jit)."""
    pg = _args.group_of(group)
    if pg is None:
        return None
    _jit.call_nullary("barrier", _bind(_host.barrier, Target(group, pg.size), "barrier"),
                      jax.ShapeDtypeStruct((), np.int32))
    return None


def _check_not_self(pg: ProcessGroup, peer: int, name: str, arg: str) -> None:
    if peer == pg.rank:
        raise ValueError(f"{_args.where(name)}: {arg} is this rank's own rank "
                         f"({pg.global_rank(peer)}); point-to-point needs another rank")
