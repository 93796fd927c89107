"""The ``*_multigpu`` collectives of the original torch.distributed API.

Each process passes a list of k arrays (one per local device in the original API); the group then
behaves as if it had ``world_size * k`` participants, ordered by (rank, list index). colls reduces
the local list first, runs one collective, and fans the result out, so these work over every
backend.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from colls import buffers
from colls import collectives as c
from colls import dispatch as d
from colls.buffers import Buffer
from colls.reduce_ops import ReduceOp
from colls.work import Work, chain


def _finish(group: Any, work: Work | None, after: Any, async_op: bool) -> Work | None:
    """Run ``after`` once the collective is done: now (sync) or as a chained Work (async).

    A synchronous collective returns None just like a non-member's call, so membership is
    asked of the group, not read from ``work``.
    """
    if d.resolve_group(group) is None:
        return None
    if async_op:
        assert work is not None  # a member's async collective always returns a Work
        return chain(work, lambda _r: after())
    after()
    return None


def _plain_spec(op: Any, buf: Buffer, name: str, group: Any) -> Any:
    """Check ``op``; AVG and PREMUL_SUM are refused (their scaling counts processes, not arrays)."""
    spec = d.reduce_spec(d.resolve_group(group), op, buf, op_name=name)
    if spec.kind.name in ("AVG", "PREMUL_SUM"):
        raise ValueError(
            f"{name} on rank {d.my_rank()}: op {spec.kind.name} is not supported by the multigpu "
            "forms; use SUM and scale the result"
        )
    return spec


def _check_index(index: Any, length: int, arg: str, name: str) -> None:
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < length:
        raise ValueError(
            f"{name} on rank {d.my_rank()}: {arg}={index!r} must index tensor_list "
            f"(0..{length - 1})"
        )


def _joined(bufs: list[Buffer]) -> Buffer:
    """Concatenate buffers into one scratch Buffer of their dtype."""
    joined = buffers.scratch(bufs[0], numel=sum(b.numel for b in bufs))
    np.concatenate([b.array for b in bufs], out=joined.array)
    return joined


def _local_list(tensor_list: Any, op: str, writable: bool, group: Any) -> list[Buffer]:
    pg = d.resolve_group(group)  # the device check is against this group's backend
    bufs = d.import_list(pg, tensor_list, arg="tensor_list", op=op, writable=writable,
                         length=None)
    if not bufs:
        raise ValueError(f"{op} on rank {d.my_rank()}: tensor_list must not be empty")
    d.check_same_dtype(bufs[0], bufs[1:], names="tensor_list", op=op)
    for i, b in enumerate(bufs[1:], 1):
        d.check_numel(b, bufs[0].numel, arg=f"tensor_list[{i}]", op=op,
                      why="the size of tensor_list[0]")
    return bufs


def all_reduce_multigpu(tensor_list: list[Any], op: Any = ReduceOp.SUM, group: Any = None,
                        async_op: bool = False) -> Work | None:
    """Reduce every array of every process's list; every array gets the result."""
    name = "all_reduce_multigpu"
    bufs = _local_list(tensor_list, name, writable=True, group=group)
    spec = _plain_spec(op, bufs[0], name, group)
    staged = buffers.scratch(bufs[0])
    for b in bufs[1:]:
        spec.combine(staged.array, b.array)
    work = c.all_reduce(staged, op=op, group=group, async_op=async_op)

    def fan_out() -> None:
        for b in bufs:
            np.copyto(b.array, staged.array)
            b.write_back()

    return _finish(group, work, fan_out, async_op)


def broadcast_multigpu(tensor_list: list[Any], src: int, group: Any = None,
                       async_op: bool = False, src_tensor: int = 0) -> Work | None:
    """Copy ``tensor_list[src_tensor]`` of rank ``src`` into every array of every list."""
    name = "broadcast_multigpu"
    bufs = _local_list(tensor_list, name, writable=True, group=group)
    _check_index(src_tensor, len(bufs), "src_tensor", name)
    staged = buffers.scratch(bufs[src_tensor])
    work = c.broadcast(staged, src=src, group=group, async_op=async_op)

    def fan_out() -> None:
        for b in bufs:
            np.copyto(b.array, staged.array)
            b.write_back()

    return _finish(group, work, fan_out, async_op)


def reduce_multigpu(tensor_list: list[Any], dst: int, op: Any = ReduceOp.SUM, group: Any = None,
                    async_op: bool = False, dst_tensor: int = 0) -> Work | None:
    """Reduce every array of every list into ``tensor_list[dst_tensor]`` of rank ``dst``."""
    name = "reduce_multigpu"
    bufs = _local_list(tensor_list, name, writable=True, group=group)
    spec = _plain_spec(op, bufs[0], name, group)
    _check_index(dst_tensor, len(bufs), "dst_tensor", name)
    staged = buffers.scratch(bufs[0])
    for b in bufs[1:]:
        spec.combine(staged.array, b.array)
    work = c.reduce(staged, dst=dst, op=op, group=group, async_op=async_op)

    def store() -> None:
        if d.my_rank() == dst:
            np.copyto(bufs[dst_tensor].array, staged.array)
            bufs[dst_tensor].write_back()

    return _finish(group, work, store, async_op)


def all_gather_multigpu(output_tensor_lists: list[list[Any]], input_tensor_list: list[Any],
                        group: Any = None, async_op: bool = False) -> Work | None:
    """Every output list i gets all inputs of all processes, ordered by (rank, index)."""
    name = "all_gather_multigpu"
    ins = _local_list(input_tensor_list, name, writable=False, group=group)
    pg = d.resolve_group(group)
    if pg is None:
        return None
    k, n = len(ins), ins[0].numel
    outs = [d.import_list(pg, lst, arg=f"output_tensor_lists[{i}]", op=name, writable=True,
                          length=pg.size * k) for i, lst in enumerate(output_tensor_lists)]
    local = _joined(ins)
    gathered = buffers.scratch(ins[0], numel=local.numel * pg.size)
    work = c.all_gather_into_tensor(gathered, local, group=group, async_op=async_op)

    def fan_out() -> None:
        for out_list in outs:
            for j, b in enumerate(out_list):
                np.copyto(b.array, gathered.array[j * n : (j + 1) * n])
                b.write_back()

    return _finish(group, work, fan_out, async_op)


def reduce_scatter_multigpu(output_tensor_list: list[Any], input_tensor_lists: list[list[Any]],
                            op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
                            ) -> Work | None:
    """Output i of rank r gets entry ``r * k + i`` reduced over every input list everywhere."""
    name = "reduce_scatter_multigpu"
    outs = _local_list(output_tensor_list, name, writable=True, group=group)
    pg = d.resolve_group(group)
    if pg is None:
        return None
    k, n = len(outs), outs[0].numel
    spec = _plain_spec(op, outs[0], name, group)
    lists = [d.import_list(pg, lst, arg=f"input_tensor_lists[{i}]", op=name, writable=False,
                           length=pg.size * k) for i, lst in enumerate(input_tensor_lists)]
    staged = _joined(lists[0])
    for other in lists[1:]:
        spec.combine(staged.array, _joined(other).array)
    result = buffers.scratch(outs[0], numel=n * k)
    work = c.reduce_scatter_tensor(result, staged, op=op, group=group, async_op=async_op)

    def fan_out() -> None:
        for i, b in enumerate(outs):
            np.copyto(b.array, result.array[i * n : (i + 1) * n])
            b.write_back()

    return _finish(group, work, fan_out, async_op)
