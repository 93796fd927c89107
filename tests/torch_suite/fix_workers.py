"""Ranks of test_torch_suite_fixes.py (module-level, so colls.testing.spawn can start them)."""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch

#: The monitored_barrier timeout of the timing case (seconds). The bug it guards against took
#: twice the timeout, so 2 s keeps the two apart by more than a loaded machine's noise.
LIMIT_S = 2.0


def _failure(call: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        call()
    except Exception as exc:  # what a torch program would catch, measured
        return {"type": type(exc).__name__, "message": str(exc),
                "elapsed": time.monotonic() - start}
    return {"type": None, "elapsed": time.monotonic() - start}


def monitored(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 0 alone calls monitored_barrier with timeout 0, then with LIMIT_S; others stay away."""
    import colls_torch as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    zero_group, timed_group, torch_group = dist.new_group(), dist.new_group(), dist.new_group()
    out: dict[str, Any] = {}
    if rank == 0:
        out["zero"] = _failure(lambda: dist.monitored_barrier(
            zero_group, timeout=datetime.timedelta(0)))
        out["timed"] = _failure(lambda: dist.monitored_barrier(
            timed_group, timeout=datetime.timedelta(seconds=LIMIT_S)))
        # the torch face: ProcessGroupColls.monitored_barrier, as torch's suite calls it
        out["torch_class"] = type(torch_group).__name__
        out["torch_zero"] = _failure(lambda: torch_group.monitored_barrier(
            datetime.timedelta(0)))
    dist.barrier()
    dist.destroy_process_group()
    return out


def sparse(rank: int, world_size: int) -> dict[str, Any]:
    """all_reduce of sparse COO tensors through both faces; MAX is refused naming the rank."""
    import colls_torch as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    # rank r holds r + 1 entries (uneven counts), overlapping at index 0, with a dense dim
    indices = torch.tensor([list(range(rank + 1))])
    values = torch.tensor([[float(rank + 1), float(-i)] for i in range(rank + 1)])
    out: dict[str, Any] = {}
    mine = torch.sparse_coo_tensor(indices, values, (4, 2))
    direct = mine.clone()
    dist.all_reduce(direct)
    out["direct"] = (direct.layout == torch.sparse_coo, direct.to_dense().tolist())
    via_torch = mine.clone()
    torch.distributed.all_reduce(via_torch)
    out["torch"] = via_torch.to_dense().tolist()
    work = dist.all_reduce(mine.clone(), async_op=True)
    out["async"] = work.wait()
    out["max"] = _failure(lambda: dist.all_reduce(mine.clone(), op=dist.ReduceOp.MAX))
    dist.destroy_process_group()
    return out


def expected_sparse_sum(world_size: int) -> list[list[float]]:
    """The dense form of the sum :func:`sparse` computes."""
    dense = torch.zeros(4, 2)
    for rank in range(world_size):
        for i in range(rank + 1):
            dense[i] += torch.tensor([float(rank + 1), float(-i)])
    return dense.tolist()
