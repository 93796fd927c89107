"""all_reduce of sparse COO tensors, with gloo's semantics.

gloo reduces a sparse tensor by gathering every rank's (coalesced) indices and values and
summing them: each rank ends with the same sparse tensor, the sum of all ranks' tensors. colls
moves dense arrays only, so it does the same in three dense all_gathers over the colls group:
the non-zero counts, then the indices and the values (padded to the largest count), and sums
the pieces locally. The caller's tensor gets the coalesced result in place (``copy_``), as
gloo's. Only ``ReduceOp.SUM`` is defined on sparse tensors, as in gloo; other layouts than COO
(CSR, ...) are refused naming the layout. The reduction runs when called; an ``async_op``
caller gets a completed Work.
"""

from __future__ import annotations

from typing import Any

import torch

import colls
from colls.process_group import ProcessGroup
from colls_torch._errors import backend_call
from colls_torch._ops import kind_name


def is_sparse(tensor: Any) -> bool:
    """Return whether ``tensor`` is a torch tensor of a sparse layout (not strided)."""
    return isinstance(tensor, torch.Tensor) and tensor.layout is not torch.strided


def check_sparse(tensor: torch.Tensor, op: Any, pg: ProcessGroup, fn: str) -> None:
    """Refuse what gloo refuses on sparse tensors, naming the caller's rank.

    Raises:
        RuntimeError: a layout other than sparse COO, an op other than SUM, or a CUDA tensor.
    """
    where = f"{fn} on rank {pg.global_rank(pg.rank)}"
    if tensor.layout is not torch.sparse_coo:
        raise RuntimeError(
            f"{where}: only sparse COO tensors can be reduced (as gloo), got layout "
            f"{tensor.layout}; convert with .to_sparse_coo() or .to_dense()"
        )
    if kind_name(op) != "SUM":
        raise RuntimeError(
            f"{where}: sparse tensors support ReduceOp.SUM only (as gloo), got {kind_name(op)}"
        )
    if tensor.device.type != "cpu":
        raise RuntimeError(
            f"{where}: sparse tensors must be on the CPU, got a tensor on {tensor.device}"
        )


def _gather(pg: ProcessGroup, piece: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(piece) for _ in range(pg.size)]
    colls.all_gather(out, piece, group=pg)
    return out


def all_reduce_sparse(tensor: torch.Tensor, op: Any, pg: ProcessGroup,
                      fn: str = "all_reduce") -> None:
    """Sum the sparse COO ``tensor`` over ``pg`` in place (see the module docstring).

    Args:
        tensor: this rank's sparse COO tensor (same size and dense shape on every rank).
        op: the colls reduce op (SUM only).
        pg: the colls group (this process is a member).
        fn: the public function's name, for errors.
    """
    check_sparse(tensor, op, pg, fn)
    mine = tensor.detach().coalesce()
    indices, values = mine.indices().contiguous(), mine.values().contiguous()
    with backend_call():
        counts = _gather(pg, torch.tensor([values.shape[0]], dtype=torch.int64))
        most = max(int(c.item()) for c in counts)
        padded_indices = indices.new_zeros((indices.shape[0], most))
        padded_indices[:, : indices.shape[1]] = indices
        padded_values = values.new_zeros((most, *values.shape[1:]))
        padded_values[: values.shape[0]] = values
        all_indices = _gather(pg, padded_indices)
        all_values = _gather(pg, padded_values)
    used = [int(c.item()) for c in counts]
    total = torch.sparse_coo_tensor(
        torch.cat([i[:, :n] for i, n in zip(all_indices, used, strict=True)], dim=1),
        torch.cat([v[:n] for v, n in zip(all_values, used, strict=True)]),
        mine.shape,
    ).coalesce()
    with torch.no_grad():
        tensor.copy_(total)


__all__ = ["all_reduce_sparse", "check_sparse", "is_sparse"]
