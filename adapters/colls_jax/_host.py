"""The collectives as NumPy functions on the host: what runs eagerly, in the FFI handler and in
the fallback callbacks.

Each function takes its input ``x`` (any array NumPy can view without a copy: a concrete
``jax.Array``, a NumPy array, a view of one of XLA's buffers) and its output ``out``, a writable
C-contiguous NumPy array of the result's shape and dtype, allocated by the caller: on the FFI
path (:mod:`colls_jax._ffi`) it is XLA's own output buffer, so the core writes the result where
XLA wants it. Inputs are read in place. Ops that reduce in place (all_reduce, broadcast, reduce)
copy ``x`` into ``out`` first, unless they are the same memory (the FFI path aliases them).

On the FFI path of XLA's CUDA platform the buffers are CuPy arrays on the device instead
(:mod:`colls_jax._ffi`), so nothing here may assume NumPy: :func:`_array` leaves a device array
as it is, and copies and fills are written as indexing, which both array types do.

Ranks and roots here are *group* ranks, already checked by :mod:`colls_jax._ops`; the arguments
were validated at trace time, so nothing here raises for a caller mistake.
"""

from __future__ import annotations

import functools
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

    group, size = target.group, target.size
    call = functools.partial(fn, group=group, **static)  # its keywords merge in C, per call

    def run(*arrays: Any) -> Any:
        current = colls.get_world_size(group)
        if current != size:
            raise ValueError(
                f"colls_jax.{name} on rank {colls.get_rank()}: this call was traced for a group "
                f"of {size} ranks but the group now has {current}; the process group "
                "was re-created with another size. Call jax.clear_caches() or jit a new function."
            )
        return call(*arrays)

    return run


def _rows(array: Any) -> list[Any]:
    """Return the views ``array[i, ...]`` (arrays even when 0-d, unlike ``list(array)``)."""
    return [array[i, ...] for i in range(array.shape[0])]


def _array(x: Any) -> Any:
    """``x`` as an array colls takes: a device array (CuPy, on the CUDA FFI path) as it is,
    anything else viewed by NumPy (a concrete ``jax.Array``, a NumPy array or view)."""
    if hasattr(x, "__cuda_array_interface__"):
        return x
    return np.asarray(x)


def _address(array: Any) -> int:
    """The address of ``array``'s first element, host or device."""
    return int(array.ctypes.data) if isinstance(array, np.ndarray) else int(array.data.ptr)


def _load(x: Any, out: Any) -> None:
    """Copy ``x`` into ``out`` (the buffer of an in-place collective) unless it is already there."""
    if x is out:  # aliased (the FFI path) or copied already (the eager path): in place
        return
    src = _array(x)
    if src.size and _address(src) != _address(out):
        out[...] = src


def all_reduce(x: Any, out: Any, *, op: Any, group: Any) -> None:
    """Write the reduction of ``x`` over the group into ``out``."""
    _load(x, out)
    colls.all_reduce(out, op, group)


def broadcast(x: Any, out: Any, *, root: int, group: Any) -> None:
    """Write group rank ``root``'s ``x`` into ``out``."""
    _load(x, out)
    colls.broadcast(out, group=group, group_src=root)


def reduce(x: Any, out: Any, *, root: int, op: Any, group: Any) -> None:
    """Write the reduction of ``x`` on group rank ``root``, zeros elsewhere."""
    _load(x, out)
    colls.reduce(out, op=op, group=group, group_dst=root)
    if colls.get_rank(group) != root:
        out[...] = 0


def all_gather(x: Any, out: Any, *, tiled: bool, group: Any) -> None:
    """Write every rank's ``x`` stacked on a new axis 0 (or concatenated if tiled) into ``out``."""
    src = _array(x)
    size = colls.get_world_size(group)
    colls.all_gather_into_tensor(out.reshape(size, *src.shape), src, group=group)


def reduce_scatter(x: Any, out: Any, *, op: Any, tiled: bool, group: Any) -> None:
    """Reduce ``x`` over the group; write this rank's block of axis 0 (squeezed if not tiled)."""
    src = _array(x)
    rows = src.shape[0] // colls.get_world_size(group)
    colls.reduce_scatter_tensor(out.reshape(rows, *src.shape[1:]), src, op=op, group=group)


def all_to_all(x: Any, out: Any, *, group: Any) -> None:
    """Send block j of axis 0 of ``x`` to rank j; write the blocks received, in rank order."""
    colls.all_to_all_single(out, _array(x), group=group)


def gather(x: Any, out: Any, *, root: int, group: Any) -> None:
    """Write every rank's ``x`` stacked on axis 0 on group rank ``root``; zeros elsewhere."""
    is_root = colls.get_rank(group) == root
    if not is_root:
        out[...] = 0
    colls.gather(_array(x), _rows(out) if is_root else None, group=group, group_dst=root)


def scatter(x: Any, out: Any, *, root: int, group: Any) -> None:
    """Write ``x[r]`` of group rank ``root`` on group rank r (``x`` is ignored off the root)."""
    src = _array(x)
    is_root = colls.get_rank(group) == root
    colls.scatter(out, _rows(src) if is_root else None, group=group, group_src=root)


def ppermute(x: Any, out: Any, *, perm: Sequence[tuple[int, int]], group: Any) -> None:
    """Send ``x`` along the (source, destination) pairs of ``perm``; zeros where nothing arrives.

    Every send and receive of this rank is started before any is waited for, so a ring (every
    rank both sends and receives) cannot deadlock however large the message.
    """
    src = _array(x)
    me = colls.get_rank(group)
    works = []
    received = False
    for source, dest in perm:
        if source == me and dest == me:
            out[...] = src
            received = True
        elif dest == me:
            works.append(colls.irecv(out, group=group, group_src=source, tag=PPERMUTE_TAG))
            received = True
    if not received:
        out[...] = 0
    for source, dest in perm:
        if source == me and dest != me:
            works.append(colls.isend(src, group=group, group_dst=dest, tag=PPERMUTE_TAG))
    for work in works:
        work.wait()


def send(x: Any, *, dest: int, tag: int, group: Any) -> None:
    """Send ``x`` to group rank ``dest`` (no output)."""
    colls.send(_array(x), group=group, group_dst=dest, tag=tag)


def recv(out: Any, *, source: int, tag: int, group: Any) -> None:
    """Receive from group rank ``source`` into ``out``."""
    colls.recv(out, group=group, group_src=source, tag=tag)


def barrier(out: Any, *, group: Any) -> None:
    """Wait for every rank of the group; write a dummy int32 zero (a value jit can order)."""
    colls.barrier(group=group)
    out[...] = 0
