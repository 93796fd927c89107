"""The collectives of torch.distributed, with torch's signatures, over colls.

Each function follows torch's own order of steps, so the same mistake raises the same
exception: torch's Python checks (tensor types, dtypes, ``src``/``group_src``), the non-member
early return (with torch's warning), the reduce-op rules, then the colls call through
:func:`colls_torch._submit.submit`, which returns None or a :class:`colls_torch.Work`.
Complex tensors are reduced as complex numbers (torch views them as pairs of reals).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

import colls
from colls_torch import _groups
from colls_torch._errors import backend_call, boundary, translated
from colls_torch._ops import ReduceOp, check_reduction, to_colls
from colls_torch._sparse import all_reduce_sparse, is_sparse
from colls_torch._submit import submit
from colls_torch._tensors import (
    Staging,
    check_single_tensor,
    check_tensor_list,
    ensure_same_dtype,
    shared_numpy,
)
from colls_torch._work import Work, completed


def _staging(pg: Any) -> Staging:
    return Staging(pg.backend.devices)


@boundary
def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` across the group in place; every rank gets the result."""
    check_single_tensor(tensor, "tensor")
    pg = _groups.member(group, "all_reduce", tensor)
    if pg is None:
        return None
    cop = to_colls(op)
    if is_sparse(tensor):  # gloo's semantics: the sum of every rank's sparse tensor
        all_reduce_sparse(tensor, cop, pg)
        return completed([tensor]) if async_op else None
    check_reduction(cop, tensor.dtype, "all_reduce")
    if not async_op:
        array = shared_numpy(tensor)
        if array is not None:  # a loss or a metric: the core's fast path (colls._fast_path),
            with backend_call():  # which takes a subgroup too
                colls.all_reduce(array, op=cop, group=pg)
            return None
    st = _staging(pg)
    t = st.target(tensor)
    return submit(st, lambda a: colls.all_reduce(t, op=cop, group=pg, async_op=a), [tensor],
                  async_op)


@boundary
def broadcast(tensor: torch.Tensor, src: int | None = None, group: Any = None,
              async_op: bool = False, group_src: int | None = None) -> Work | None:
    """Copy ``tensor`` of rank ``src`` (or group rank ``group_src``) to every rank."""
    check_single_tensor(tensor, "tensor")
    pg = _groups.member(group, "broadcast", tensor)
    if pg is None:
        return None
    root = _groups.group_rank(pg, src, group_src, op="broadcast")
    st = _staging(pg)
    t = st.target(tensor)
    return submit(st, lambda a: colls.broadcast(t, group=pg, async_op=a, group_src=root),
                  [tensor], async_op)


@boundary
def reduce(tensor: torch.Tensor, dst: int | None = None, op=ReduceOp.SUM, group: Any = None,
           async_op: bool = False, group_dst: int | None = None) -> Work | None:
    """Reduce ``tensor`` of every rank into ``tensor`` of rank ``dst``."""
    check_single_tensor(tensor, "tensor")
    pg = _groups.member(group, "reduce", tensor)
    if pg is None:
        return None
    root = _groups.group_rank(pg, dst, group_dst, op="reduce")
    cop = to_colls(op)
    check_reduction(cop, tensor.dtype, "reduce")
    st = _staging(pg)
    t = st.target(tensor)
    return submit(st, lambda a: colls.reduce(t, op=cop, group=pg, async_op=a, group_dst=root),
                  [tensor], async_op)


@boundary
def all_gather(tensor_list, tensor, group=None, async_op=False) -> Work | None:
    """Gather ``tensor`` of every rank into ``tensor_list`` on every rank."""
    check_tensor_list(tensor_list, "tensor_list")
    check_single_tensor(tensor, "tensor")
    ensure_same_dtype(tensor_list, tensor)
    pg = _groups.member(group, "all_gather", tensor)
    if pg is None:
        return None
    st = _staging(pg)
    outs, src = st.targets(tensor_list), st.source(tensor)
    return submit(st, lambda a: colls.all_gather(outs, src, group=pg, async_op=a), tensor_list,
                  async_op)


@boundary
def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False
                           ) -> Work | None:
    """Gather ``input_tensor`` of every rank, concatenated in rank order, into ``output_tensor``."""
    check_single_tensor(input_tensor, "input_tensor")
    check_single_tensor(output_tensor, "output_tensor")
    pg = _groups.member(group, "all_gather_into_tensor", input_tensor)
    if pg is None:
        return None
    st = _staging(pg)
    out, src = st.target(output_tensor), st.source(input_tensor)
    return submit(
        st, lambda a: colls.all_gather_into_tensor(out, src, group=pg, async_op=a),
        [output_tensor], async_op,
    )


@boundary
def all_gather_single(output_tensor, input_tensor, group=None, async_op=False) -> Work | None:
    """torch 2.13's name for :func:`all_gather_into_tensor`."""
    return all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


def _root_list(pg: Any, root: int, tensors: list[torch.Tensor], what: str, verb: str) -> None:
    """Apply torch's rule: the list is required on the root and forbidden elsewhere."""
    if pg.rank == root:
        if not tensors:
            raise ValueError(f"Argument ``{what}`` must be specified on {verb} rank.")
    elif tensors:
        raise ValueError(f"Argument ``{what}`` must NOT be specified on non-{verb} ranks.")


@boundary
def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None,
           dst: int | None = None, group: Any = None, async_op: bool = False,
           group_dst: int | None = None) -> Work | None:
    """Gather ``tensor`` of every rank into ``gather_list`` on rank ``dst`` (default 0)."""
    check_single_tensor(tensor, "tensor")
    if gather_list:
        check_tensor_list(gather_list, "gather_list")
    else:
        gather_list = []
    ensure_same_dtype(tensor, gather_list)
    pg = _groups.member(group, "gather", tensor)
    if pg is None:
        return None
    root = _groups.root_rank(pg, dst, group_dst, op="gather")
    _root_list(pg, root, gather_list, "gather_list", "destination")
    st = _staging(pg)
    outs, src = st.targets(gather_list) or None, st.source(tensor)
    return submit(
        st, lambda a: colls.gather(src, outs, group=pg, async_op=a, group_dst=root),
        gather_list, async_op,
    )


@boundary
def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None,
            src: int | None = None, group: Any = None, async_op: bool = False,
            group_src: int | None = None) -> Work | None:
    """Give rank r entry r of ``scatter_list`` of rank ``src`` (default 0), in ``tensor``."""
    check_single_tensor(tensor, "tensor")
    if scatter_list:
        check_tensor_list(scatter_list, "scatter_list")
    else:
        scatter_list = []
    ensure_same_dtype(tensor, scatter_list)
    pg = _groups.member(group, "scatter", tensor)
    if pg is None:
        return None
    root = _groups.root_rank(pg, src, group_src, op="scatter")
    _root_list(pg, root, scatter_list, "scatter_list", "source")
    st = _staging(pg)
    out, ins = st.target(tensor), st.sources(scatter_list) or None
    return submit(
        st, lambda a: colls.scatter(out, ins, group=pg, async_op=a, group_src=root),
        [tensor], async_op,
    )


@boundary
def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op: bool = False
                   ) -> Work | None:
    """Reduce ``input_list`` across ranks element-wise; rank r gets entry r in ``output``."""
    check_single_tensor(output, "output")
    check_tensor_list(input_list, "input_list")
    ensure_same_dtype(output, input_list)
    pg = _groups.member(group, "reduce_scatter", output)
    if pg is None:
        return None
    cop = to_colls(op)
    check_reduction(cop, output.dtype, "reduce_scatter")
    st = _staging(pg)
    out, ins = st.target(output), st.sources(input_list)
    return submit(
        st, lambda a: colls.reduce_scatter(out, ins, op=cop, group=pg, async_op=a), [output],
        async_op,
    )


@boundary
def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False
                          ) -> Work | None:
    """Reduce ``input`` (group-size chunks of dim 0) across ranks; rank r gets chunk r."""
    check_single_tensor(output, "output")
    check_single_tensor(input, "input")
    pg = _groups.member(group, "reduce_scatter_tensor", input)
    if pg is None:
        return None
    cop = to_colls(op)
    check_reduction(cop, output.dtype, "reduce_scatter_tensor")
    st = _staging(pg)
    out, src = st.target(output), st.source(input)
    return submit(
        st, lambda a: colls.reduce_scatter_tensor(out, src, op=cop, group=pg, async_op=a),
        [output], async_op,
    )


@boundary
def reduce_scatter_single(output, input, op=ReduceOp.SUM, group=None, async_op=False
                          ) -> Work | None:
    """torch 2.13's name for :func:`reduce_scatter_tensor`."""
    return reduce_scatter_tensor(output, input, op, group, async_op)


@boundary
def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False
               ) -> Work | None:
    """Send ``input_tensor_list[j]`` to rank j; receive rank j's into ``output_tensor_list[j]``."""
    pg = _groups.member(group, "all_to_all", input_tensor_list)
    if pg is None:
        return None
    check_tensor_list(output_tensor_list, "output_tensor_list")
    check_tensor_list(input_tensor_list, "input_tensor_list")
    ensure_same_dtype(output_tensor_list, input_tensor_list)
    st = _staging(pg)
    outs, ins = st.targets(output_tensor_list), st.sources(input_tensor_list)
    return submit(st, lambda a: colls.all_to_all(outs, ins, group=pg, async_op=a),
                  output_tensor_list, async_op)


@boundary
def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op: bool = False) -> Work | None:
    """Split ``input`` along dim 0, send piece j to rank j, concatenate arrivals in ``output``."""
    pg = _groups.member(group, "all_to_all_single", input)
    if pg is None:
        return None
    check_single_tensor(output, "output")
    check_single_tensor(input, "input")
    ensure_same_dtype(output, input)
    st = _staging(pg)
    out, src = st.target(output), st.source(input)
    return submit(
        st,
        lambda a: colls.all_to_all_single(out, src, output_split_sizes or None,
                                          input_split_sizes or None, group=pg, async_op=a),
        [output], async_op,
    )


@boundary
def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None,
            timeout: datetime.timedelta | None = None) -> Work | None:
    """Return once every rank of the group has called barrier (``device_ids`` is ignored).

    ``timeout`` bounds this barrier instead of the group's timeout (colls.barrier's per-call
    timeout: every rank of one barrier passes a timeout, or none).
    """
    pg = _groups.member(group, "barrier")
    if pg is None:
        return None
    return submit(_staging(pg),
                  lambda a: colls.barrier(group=pg, async_op=a, timeout=timeout), [], async_op)


@boundary
def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False
                      ) -> None:
    """A barrier whose rank 0 names the ranks that did not arrive within ``timeout``.

    Works over every colls backend (torch's runs on gloo only).
    """
    pg = _groups.member(group, "monitored_barrier")
    if pg is None:
        return None
    with translated():
        colls.monitored_barrier(group=pg, timeout=timeout, wait_all_ranks=wait_all_ranks)
    return None


__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "gather",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
]
