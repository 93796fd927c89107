"""The collectives of the public API, with torch.distributed's names, arguments and semantics.

Each function reads as the same recipe: begin the call on its group (non-members get None),
canonicalise the root, import and check the arrays, check the op, then submit a job that calls
the backend on contiguous 1-D arrays and writes staged results back. Each names its operation
once, in :meth:`Call.begin <colls.dispatch.Call.begin>`; all checking lives in
:mod:`colls.dispatch`; the latency-bound common cases first try :mod:`colls._fast_path`.
"""

from __future__ import annotations

import datetime
from typing import Any

import numpy as np

from colls import _fast_path as fast
from colls import algorithms, buffers
from colls.buffers import Buffer
from colls.dispatch import Call
from colls.reduce_ops import ReduceOp
from colls.work import Work


def _write_back(*bufs: Buffer) -> None:
    for buf in bufs:
        buf.write_back()


def _scatter_flat(flat: np.ndarray, outputs: list[Buffer]) -> None:
    """Copy consecutive chunks of ``flat`` into each output buffer and write them back."""
    offset = 0
    for out in outputs:
        np.copyto(out.array, flat[offset : offset + out.numel])
        offset += out.numel
        out.write_back()


def _concat(bufs: list[Buffer]) -> np.ndarray:
    if not bufs:
        return np.empty(0, dtype=np.uint8)
    return np.concatenate([b.array for b in bufs])


def all_reduce(tensor: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
               ) -> Work | None:
    """Reduce ``tensor`` across the group, in place; every rank gets the result."""
    if not async_op and fast.all_reduce(tensor, op, group):
        return None  # the common case, planned once (colls._fast_path)
    call = Call.begin("all_reduce", group)
    if call is None:
        return None
    pg = call.group
    buf = call.buffer(tensor, arg="tensor", writable=True)
    spec = call.reduce_spec(op, buf)

    def job(tag: int) -> None:
        spec.prepare(buf.array)
        pg.backend.all_reduce(buf.array, spec, tag)
        spec.finish(buf.array, pg.size)
        buf.write_back()

    return call.submit(job, async_op=async_op)


def broadcast(tensor: Any, src: int | None = None, group: Any = None, async_op: bool = False,
              group_src: int | None = None) -> Work | None:
    """Copy ``tensor`` of rank ``src`` into ``tensor`` of every rank of the group."""
    if group_src is None and not async_op and fast.broadcast(tensor, src, group):
        return None  # the common case, planned once (colls._fast_path)
    call = Call.begin("broadcast", group)
    if call is None:
        return None
    pg = call.group
    root = call.group_rank(src, group_src, arg="src")
    buf = call.buffer(tensor, arg="tensor", writable=pg.rank != root)

    def job(tag: int) -> None:
        pg.backend.broadcast(buf.array, root, tag)
        buf.write_back()

    return call.submit(job, async_op=async_op)


def reduce(tensor: Any, dst: int | None = None, op: Any = ReduceOp.SUM, group: Any = None,
           async_op: bool = False, group_dst: int | None = None) -> Work | None:
    """Reduce ``tensor`` of every rank into ``tensor`` of rank ``dst``; others are unchanged."""
    call = Call.begin("reduce", group)
    if call is None:
        return None
    pg = call.group
    root = call.group_rank(dst, group_dst, arg="dst")
    is_root = pg.rank == root
    buf = call.buffer(tensor, arg="tensor", writable=is_root)
    spec = call.reduce_spec(op, buf)

    def job(tag: int) -> None:
        data = buf.array if is_root or not spec.modifies_input else buf.array.copy()
        spec.prepare(data)
        pg.backend.reduce(data, root, spec, tag)
        if is_root:
            spec.finish(data, pg.size)
            buf.write_back()

    return call.submit(job, async_op=async_op)


def all_gather(tensor_list: list[Any], tensor: Any, group: Any = None, async_op: bool = False
               ) -> Work | None:
    """Gather ``tensor`` of every rank into ``tensor_list`` (one array per rank) on every rank."""
    call = Call.begin("all_gather", group)
    if call is None:
        return None
    pg = call.group
    src = call.buffer(tensor, arg="tensor", writable=False)
    outs = call.rank_list(tensor_list, src, arg="tensor_list", writable=True,
                          why="the number of elements of tensor")

    def job(tag: int) -> None:
        flat = buffers.empty_array(src.numel * pg.size, src.dtype, src.device)
        pg.backend.all_gather(flat, src.array, tag)
        _scatter_flat(flat, outs)

    return call.submit(job, async_op=async_op)


def all_gather_into_tensor(output_tensor: Any, input_tensor: Any, group: Any = None,
                           async_op: bool = False) -> Work | None:
    """Gather ``input_tensor`` of every rank, concatenated, into ``output_tensor``."""
    if not async_op and fast.all_gather_into_tensor(output_tensor, input_tensor, group):
        return None  # the common case, planned once (colls._fast_path)
    call = Call.begin("all_gather_into_tensor", group)
    if call is None:
        return None
    pg = call.group
    src = call.buffer(input_tensor, arg="input_tensor", writable=False)
    out = call.buffer(output_tensor, arg="output_tensor", writable=True)
    call.same_dtype(src, [out], names="output_tensor")
    call.numel(out, src.numel * pg.size, arg="output_tensor",
               why=f"input_tensor's {src.numel} elements times the group size {pg.size}")

    def job(tag: int) -> None:
        pg.backend.all_gather(out.array, buffers.apart_from(src.array, out.array), tag)
        out.write_back()

    return call.submit(job, async_op=async_op)


def gather(tensor: Any, gather_list: list[Any] | None = None, dst: int | None = None,
           group: Any = None, async_op: bool = False, group_dst: int | None = None
           ) -> Work | None:
    """Gather ``tensor`` of every rank into ``gather_list`` on rank ``dst``."""
    call = Call.begin("gather", group)
    if call is None:
        return None
    pg = call.group
    if dst is None and group_dst is None:
        dst = 0  # torch's default root for gather and scatter
    root = call.group_rank(dst, group_dst, arg="dst")
    src = call.buffer(tensor, arg="tensor", writable=False)
    outs = _root_list(call, root, gather_list, src, arg="gather_list", writable=True)

    def job(tag: int) -> None:
        flat = buffers.empty_array(src.numel * pg.size, src.dtype, src.device) if outs else None
        pg.backend.gather(flat, src.array, root, tag)
        if flat is not None:
            _scatter_flat(flat, outs)

    return call.submit(job, async_op=async_op)


def scatter(tensor: Any, scatter_list: list[Any] | None = None, src: int | None = None,
            group: Any = None, async_op: bool = False, group_src: int | None = None
            ) -> Work | None:
    """Give rank r the r-th array of ``scatter_list`` of rank ``src``, in ``tensor``."""
    call = Call.begin("scatter", group)
    if call is None:
        return None
    pg = call.group
    if src is None and group_src is None:
        src = 0  # torch's default root for scatter and gather
    root = call.group_rank(src, group_src, arg="src")
    out = call.buffer(tensor, arg="tensor", writable=True)
    ins = _root_list(call, root, scatter_list, out, arg="scatter_list", writable=False)

    def job(tag: int) -> None:
        flat = _concat(ins) if ins else None
        pg.backend.scatter(out.array, flat, root, tag)
        out.write_back()

    return call.submit(job, async_op=async_op)


def _root_list(call: Call, root: int, objs: Any, like: Buffer, *, arg: str, writable: bool
               ) -> list[Buffer]:
    """Import the per-rank list a rooted op needs on the root (arrays like ``tensor``) and
    forbids elsewhere."""
    if call.group.rank == root:
        if objs is None:
            raise ValueError(f"{call.where}: argument {arg} must be specified on the root rank")
        return call.rank_list(objs, like, arg=arg, writable=writable,
                              why="the number of elements of tensor")
    if objs:
        raise ValueError(
            f"{call.where}: argument {arg} must NOT be specified on non-root ranks (the root "
            f"is group rank {root})"
        )
    return []


def reduce_scatter(output: Any, input_list: list[Any], op: Any = ReduceOp.SUM,
                   group: Any = None, async_op: bool = False) -> Work | None:
    """Reduce ``input_list`` element-wise across ranks; rank r gets entry r in ``output``."""
    call = Call.begin("reduce_scatter", group)
    if call is None:
        return None
    pg = call.group
    out = call.buffer(output, arg="output", writable=True)
    ins = call.rank_list(input_list, out, arg="input_list", writable=False,
                         why="the number of elements of output")
    spec = call.reduce_spec(op, out)

    def job(tag: int) -> None:
        flat = _concat(ins)
        spec.prepare(flat)
        pg.backend.reduce_scatter(out.array, flat, spec, tag)
        spec.finish(out.array, pg.size)
        out.write_back()

    return call.submit(job, async_op=async_op)


def reduce_scatter_tensor(output: Any, input: Any, op: Any = ReduceOp.SUM, group: Any = None,
                          async_op: bool = False) -> Work | None:
    """Reduce ``input`` (group-size chunks) across ranks; rank r gets chunk r in ``output``."""
    call = Call.begin("reduce_scatter_tensor", group)
    if call is None:
        return None
    pg = call.group
    out = call.buffer(output, arg="output", writable=True)
    src = call.buffer(input, arg="input", writable=False)
    call.same_dtype(out, [src], names="input")
    call.numel(src, out.numel * pg.size, arg="input",
               why=f"output's {out.numel} elements times the group size {pg.size}")
    spec = call.reduce_spec(op, out)

    def job(tag: int) -> None:
        data = src.array.copy() if spec.modifies_input else buffers.apart_from(src.array,
                                                                               out.array)
        spec.prepare(data)
        pg.backend.reduce_scatter(out.array, data, spec, tag)
        spec.finish(out.array, pg.size)
        out.write_back()

    return call.submit(job, async_op=async_op)


def all_to_all(output_tensor_list: list[Any], input_tensor_list: list[Any], group: Any = None,
               async_op: bool = False) -> Work | None:
    """Send ``input_tensor_list[j]`` to rank j; receive rank j's into ``output_tensor_list[j]``."""
    call = Call.begin("all_to_all", group)
    if call is None:
        return None
    pg = call.group
    outs = call.buffer_list(output_tensor_list, arg="output_tensor_list", writable=True,
                            length=pg.size)
    ins = call.buffer_list(input_tensor_list, arg="input_tensor_list", writable=False,
                           length=pg.size)
    call.same_dtype(ins[0], ins[1:] + outs, names="output/input_tensor_list")

    def job(tag: int) -> None:
        flat_out = buffers.empty_array(sum(b.numel for b in outs), outs[0].dtype, outs[0].device)
        pg.backend.all_to_all(flat_out, _concat(ins), [b.numel for b in outs],
                              [b.numel for b in ins], tag)
        _scatter_flat(flat_out, outs)

    return call.submit(job, async_op=async_op)


def all_to_all_single(output: Any, input: Any, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: Any = None,
                      async_op: bool = False) -> Work | None:
    """Split ``input`` along dim 0, send piece j to rank j, concatenate what arrives in ``output``.

    Split sizes count rows of dim 0 (as in torch); None means equal splits.
    """
    call = Call.begin("all_to_all_single", group)
    if call is None:
        return None
    pg = call.group
    out = call.buffer(output, arg="output", writable=True)
    src = call.buffer(input, arg="input", writable=False)
    call.same_dtype(out, [src], names="input")
    in_splits = call.row_splits(src, input_split_sizes, arg="input")
    out_splits = call.row_splits(out, output_split_sizes, arg="output")

    def job(tag: int) -> None:
        pg.backend.all_to_all(out.array, buffers.apart_from(src.array, out.array), out_splits,
                              in_splits, tag)
        out.write_back()

    return call.submit(job, async_op=async_op)


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None,
            timeout: float | datetime.timedelta | None = None) -> Work | None:
    """Return once every rank of the group has called barrier (``device_ids`` is ignored).

    Without ``timeout`` the backend's own barrier runs, bounded by the group's timeout. With it
    (seconds or a timedelta, shorter or longer than the group's), the barrier runs the
    dissemination algorithm over the backend's point-to-point, every wait bounded by
    ``timeout``; running past it fails the call with CollsTimeoutError and breaks the group, as
    the group's timeout does. The two paths exchange different messages: every rank of one
    barrier must pass a timeout, or none.
    """
    if not async_op and timeout is None and fast.barrier(group):
        return None
    call = Call.begin("barrier", group)
    if call is None:
        return None
    pg = call.group
    limit = call.timeout(timeout)
    if limit is None:
        return call.submit(pg.backend.barrier, async_op=async_op)
    bounded = _WithTimeout(pg.backend, limit)

    def job(tag: int) -> None:
        algorithms.barrier(bounded, tag)

    return call.submit(job, async_op=async_op, timeout=limit)


class _WithTimeout:
    """A backend whose ``timeout`` is one call's: what :mod:`colls.algorithms` waits with."""

    __slots__ = ("_backend", "timeout")

    def __init__(self, backend: Any, timeout: float) -> None:
        self._backend = backend
        self.timeout = timeout

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)  # rank, world_size, isend, irecv, poll, ...
