"""The older forms: coalesced collectives and the ``*_multigpu`` functions.

``all_reduce_coalesced`` and ``all_gather_coalesced`` (deprecated in torch, still used) pack
their tensors into one flat buffer, run one collective and unpack; like torch's, their async
form returns a ``torch.futures.Future`` rather than a Work. The ``*_multigpu`` functions are
gone from torch 2.x; colls keeps them (a list of tensors per process, see
:mod:`colls.multigpu`) and colls_torch exposes them with the torch 1.x signatures.
"""

from __future__ import annotations

from typing import Any

import torch

import colls
from colls_torch import _groups
from colls_torch._errors import boundary
from colls_torch._ops import ReduceOp, check_reduction, to_colls
from colls_torch._submit import submit
from colls_torch._tensors import Staging, check_tensor_list, ensure_same_dtype
from colls_torch._work import Work


def _future(work: Work | None) -> Any:
    return None if work is None else work.get_future()


def _unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        with torch.no_grad():
            t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


@boundary
def all_reduce_coalesced(tensors, op=ReduceOp.SUM, group=None, async_op: bool = False) -> Any:
    """All-reduce several tensors of one dtype as one message; async returns a Future."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    check_tensor_list(tensors, "tensor")
    ensure_same_dtype(tensors)
    pg = _groups.member(group, "all_reduce_coalesced", tensors)
    if pg is None:
        return None
    cop = to_colls(op)
    if tensors:
        check_reduction(cop, tensors[0].dtype, "all_reduce_coalesced")
    flat = torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else torch.empty(0)
    st = Staging(pg.backend.devices)
    target = st.target(flat)
    work = submit(st, lambda a: colls.all_reduce(target, op=cop, group=pg, async_op=a),
                  tensors, async_op, after=lambda: _unflatten(flat, tensors))
    return _future(work) if async_op else None


@boundary
def all_gather_coalesced(output_tensor_lists, input_tensor_list, group=None,
                         async_op: bool = False) -> Any:
    """``output_tensor_lists[r][j]`` gets ``input_tensor_list[j]`` of rank r; async: a Future."""
    pg = _groups.member(group, "all_gather_coalesced", input_tensor_list)
    if pg is None:
        return None
    check_tensor_list(input_tensor_list, "input_tensor_list")
    ensure_same_dtype(input_tensor_list)
    if not isinstance(output_tensor_lists, list):
        raise TypeError("Invalid function argument: output_tensor_lists should be a list")
    for out_list in output_tensor_lists:
        check_tensor_list(out_list, "output_tensor_lists")
        ensure_same_dtype(out_list)
    if len(output_tensor_lists) != pg.size:
        raise RuntimeError(
            f"all_gather_coalesced: output_tensor_lists must hold {pg.size} lists (one per "
            f"rank), got {len(output_tensor_lists)}"
        )
    flat_in = torch.cat([t.detach().reshape(-1) for t in input_tensor_list])
    flat_out = torch.empty(flat_in.numel() * pg.size, dtype=flat_in.dtype, device=flat_in.device)
    st = Staging(pg.backend.devices)
    out, src = st.target(flat_out), st.source(flat_in)

    def after() -> None:
        for r, out_list in enumerate(output_tensor_lists):
            _unflatten(flat_out[r * flat_in.numel() : (r + 1) * flat_in.numel()], out_list)

    result = [t for lst in output_tensor_lists for t in lst]
    work = submit(st, lambda a: colls.all_gather_into_tensor(out, src, group=pg, async_op=a),
                  result, async_op, after=after)
    return _future(work) if async_op else None


# -- the *_multigpu forms (torch 1.x signatures) ------------------------------------------------


def _multi(tensor_list: Any, group: Any, op_name: str
           ) -> tuple[Any, Staging, list[torch.Tensor]]:
    """Check a local tensor list; return the colls group (None: a non-member), its staging and
    what colls moves. colls gets the resolved group, never the torch group object."""
    check_tensor_list(tensor_list, "tensor_list")
    ensure_same_dtype(tensor_list)
    pg = _groups.member(group, op_name, tensor_list)
    st = Staging(pg.backend.devices if pg is not None else ())
    return pg, st, st.targets(tensor_list)


@boundary
def all_reduce_multigpu(tensor_list, op=ReduceOp.SUM, group=None, async_op=False
                        ) -> Work | None:
    """Reduce every tensor of every process's list; every tensor gets the result."""
    pg, st, ts = _multi(tensor_list, group, "all_reduce_multigpu")
    if pg is None:
        return None
    cop = to_colls(op)
    if tensor_list:
        check_reduction(cop, tensor_list[0].dtype, "all_reduce_multigpu")
    return submit(
        st, lambda a: colls.all_reduce_multigpu(ts, op=cop, group=pg, async_op=a),
        tensor_list, async_op,
    )


@boundary
def broadcast_multigpu(tensor_list, src, group=None, async_op=False, src_tensor=0
                       ) -> Work | None:
    """Copy ``tensor_list[src_tensor]`` of rank ``src`` into every tensor of every list."""
    pg, st, ts = _multi(tensor_list, group, "broadcast_multigpu")
    if pg is None:
        return None
    return submit(
        st, lambda a: colls.broadcast_multigpu(ts, src, group=pg, async_op=a,
                                               src_tensor=src_tensor),
        tensor_list, async_op,
    )


@boundary
def reduce_multigpu(tensor_list, dst, op=ReduceOp.SUM, group=None, async_op=False,
                    dst_tensor=0) -> Work | None:
    """Reduce every tensor of every list into ``tensor_list[dst_tensor]`` of rank ``dst``."""
    pg, st, ts = _multi(tensor_list, group, "reduce_multigpu")
    if pg is None:
        return None
    cop = to_colls(op)
    if tensor_list:
        check_reduction(cop, tensor_list[0].dtype, "reduce_multigpu")
    return submit(
        st, lambda a: colls.reduce_multigpu(ts, dst, op=cop, group=pg, async_op=a,
                                            dst_tensor=dst_tensor),
        tensor_list, async_op,
    )


@boundary
def all_gather_multigpu(output_tensor_lists, input_tensor_list, group=None, async_op=False
                        ) -> Work | None:
    """Each output list gets every input of every process, ordered by (rank, index)."""
    pg, st, ins = _multi(input_tensor_list, group, "all_gather_multigpu")
    if pg is None:
        return None
    if not isinstance(output_tensor_lists, list):
        raise TypeError("Invalid function argument: output_tensor_lists should be a list")
    for out_list in output_tensor_lists:
        check_tensor_list(out_list, "output_tensor_lists")
    outs = [st.targets(lst) for lst in output_tensor_lists]
    result = [t for lst in output_tensor_lists for t in lst]
    return submit(
        st, lambda a: colls.all_gather_multigpu(outs, ins, group=pg, async_op=a), result,
        async_op,
    )


@boundary
def reduce_scatter_multigpu(output_tensor_list, input_tensor_lists, op=ReduceOp.SUM,
                            group=None, async_op=False) -> Work | None:
    """Output i of rank r gets entry ``r * k + i`` reduced over every input list everywhere."""
    pg, st, outs = _multi(output_tensor_list, group, "reduce_scatter_multigpu")
    if pg is None:
        return None
    if not isinstance(input_tensor_lists, list):
        raise TypeError("Invalid function argument: input_tensor_lists should be a list")
    for in_list in input_tensor_lists:
        check_tensor_list(in_list, "input_tensor_lists")
    cop = to_colls(op)
    if output_tensor_list:
        check_reduction(cop, output_tensor_list[0].dtype, "reduce_scatter_multigpu")
    ins = [st.sources(lst) for lst in input_tensor_lists]
    return submit(
        st, lambda a: colls.reduce_scatter_multigpu(outs, ins, op=cop, group=pg, async_op=a),
        output_tensor_list, async_op,
    )


__all__ = [
    "all_gather_coalesced",
    "all_gather_multigpu",
    "all_reduce_coalesced",
    "all_reduce_multigpu",
    "broadcast_multigpu",
    "reduce_multigpu",
    "reduce_scatter_multigpu",
]
