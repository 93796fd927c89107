"""The collectives as NumPy functions on the host: what runs eagerly and inside jit callbacks.

Each function takes arrays that NumPy can view (a concrete ``jax.Array``, which is what
``io_callback`` hands its callback, or a NumPy array), runs one collective of the colls core on
them and returns a new NumPy array (or None). Inputs are read in place: ``np.asarray`` of a CPU
``jax.Array`` is a zero-copy, read-only view, which the core's out-of-place calls accept as is.
Only ops that reduce in place (all_reduce, broadcast, reduce) copy the input once into the output.

Ranks and roots here are *group* ranks, already checked by :mod:`colls_jax._ops`; the arguments
were validated at trace time, so nothing here raises for a caller mistake.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

import colls

#: Tag of the point-to-point messages of ppermute/shift. User tags are small non-negative ints;
#: a fixed large one keeps permutation traffic apart from the caller's own send/recv.
PPERMUTE_TAG: Final = 0x3C0_11A


@dataclass(frozen=True)
class Target:
    """The group a call runs on: the caller's ``group`` argument and its size at trace time.

    The caller's argument is kept, not the group it resolved to at trace time: None means "the
    default group when this runs", so a jitted function cached by JAX keeps working after
    ``destroy_process_group`` and a new ``init_process_group``.
    """

    group: Any
    size: int


def bind(fn: Callable[..., Any], target: Target, name: str, **static: Any) -> Callable[..., Any]:
    """Return ``fn`` with its static arguments bound, checking the group size when it runs.

    Output shapes were fixed at trace time from ``target.size``; a group re-created with
    another size is refused with a clear error instead of results of the wrong shape.
    """

    def run(*arrays: Any) -> Any:
        current = colls.get_world_size(target.group)
        if current != target.size:
            raise ValueError(
                f"colls_jax.{name} on rank {colls.get_rank()}: this call was traced for a group "
                f"of {target.size} ranks but the group now has {current}; the process group "
                "was re-created with another size. Call jax.clear_caches() or jit a new function."
            )
        return fn(*arrays, group=target.group, **static)

    return run


def _view(x: Any) -> np.ndarray:
    """Return ``x`` as a NumPy array without copying when possible (read-only for JAX)."""
    return np.asarray(x)


def _rows(array: np.ndarray) -> list[np.ndarray]:
    """Return the views ``array[i, ...]`` (arrays even when 0-d, unlike ``list(array)``)."""
    return [array[i, ...] for i in range(array.shape[0])]


def _copy(x: Any) -> np.ndarray:
    """Return a writable C-contiguous copy of ``x`` (the output of an in-place collective)."""
    return np.array(x, copy=True, order="C")


def all_reduce(x: Any, *, op: Any, group: Any) -> np.ndarray:
    """Return the reduction of ``x`` over the group."""
    out = _copy(x)
    colls.all_reduce(out, op=op, group=group)
    return out


def broadcast(x: Any, *, root: int, group: Any) -> np.ndarray:
    """Return group rank ``root``'s ``x``."""
    out = _copy(x)
    colls.broadcast(out, group=group, group_src=root)
    return out


def reduce(x: Any, *, root: int, op: Any, group: Any) -> np.ndarray:
    """Return the reduction of ``x`` on group rank ``root``, zeros of ``x``'s shape elsewhere."""
    out = _copy(x)
    colls.reduce(out, op=op, group=group, group_dst=root)
    if colls.get_rank(group) != root:
        out[...] = 0
    return out


def all_gather(x: Any, *, tiled: bool, group: Any) -> np.ndarray:
    """Return every rank's ``x`` stacked on a new axis 0, or concatenated along axis 0 if tiled."""
    src = _view(x)
    size = colls.get_world_size(group)
    out = np.empty((size, *src.shape), dtype=src.dtype)
    colls.all_gather_into_tensor(out, src, group=group)
    return out.reshape(size * src.shape[0], *src.shape[1:]) if tiled else out


def reduce_scatter(x: Any, *, op: Any, tiled: bool, group: Any) -> np.ndarray:
    """Reduce ``x`` over the group; return this rank's block of axis 0 (squeezed if not tiled)."""
    src = _view(x)
    size = colls.get_world_size(group)
    rows = src.shape[0] // size
    out = np.empty((rows, *src.shape[1:]), dtype=src.dtype)
    colls.reduce_scatter_tensor(out, src, op=op, group=group)
    return out if tiled else out.reshape(src.shape[1:])


def all_to_all(x: Any, *, group: Any) -> np.ndarray:
    """Send block j of axis 0 of ``x`` to rank j; return the blocks received, in rank order."""
    src = _view(x)
    out = np.empty_like(src, order="C")
    colls.all_to_all_single(out, src, group=group)
    return out


def gather(x: Any, *, root: int, group: Any) -> np.ndarray:
    """Return every rank's ``x`` stacked on axis 0 on group rank ``root``; zeros elsewhere."""
    src = _view(x)
    size = colls.get_world_size(group)
    out = np.zeros((size, *src.shape), dtype=src.dtype)
    is_root = colls.get_rank(group) == root
    colls.gather(src, _rows(out) if is_root else None, group=group, group_dst=root)
    return out


def scatter(x: Any, *, root: int, group: Any) -> np.ndarray:
    """Return ``x[r]`` of group rank ``root`` on group rank r (``x`` is ignored off the root)."""
    src = _view(x)
    out = np.empty(src.shape[1:], dtype=src.dtype)
    is_root = colls.get_rank(group) == root
    colls.scatter(out, _rows(src) if is_root else None, group=group, group_src=root)
    return out


def ppermute(x: Any, *, perm: Sequence[tuple[int, int]], group: Any) -> np.ndarray:
    """Send ``x`` along the (source, destination) pairs of ``perm``; zeros where nothing arrives.

    Every send and receive of this rank is started before any is waited for, so a ring (every
    rank both sends and receives) cannot deadlock however large the message.
    """
    src = _view(x)
    me = colls.get_rank(group)
    out = np.zeros(src.shape, dtype=src.dtype)
    works = []
    for source, dest in perm:
        if source == me and dest == me:
            np.copyto(out, src)
        elif dest == me:
            works.append(colls.irecv(out, group=group, group_src=source, tag=PPERMUTE_TAG))
    for source, dest in perm:
        if source == me and dest != me:
            works.append(colls.isend(src, group=group, group_dst=dest, tag=PPERMUTE_TAG))
    for work in works:
        work.wait()
    return out


def send(x: Any, *, dest: int, tag: int, group: Any) -> None:
    """Send ``x`` to group rank ``dest``."""
    colls.send(_view(x), group=group, group_dst=dest, tag=tag)


def recv(*, shape: tuple[int, ...], dtype: Any, source: int, tag: int, group: Any
         ) -> np.ndarray:
    """Return a new array of ``shape`` and ``dtype`` received from group rank ``source``."""
    out = np.empty(shape, dtype=dtype)
    colls.recv(out, group=group, group_src=source, tag=tag)
    return out


def barrier(*, group: Any) -> np.ndarray:
    """Wait for every rank of the group; return a dummy int32 scalar (a value jit can order)."""
    colls.barrier(group=group)
    return np.zeros((), dtype=np.int32)

