"""Scenarios for the ``colls`` backend inside torch.distributed, run on fresh processes.

Each function initialises torch.distributed itself (``init_process_group("colls")``), which
the persistent pool cannot do (its torch world is gloo).
"""

from __future__ import annotations

import datetime
from typing import Any

import colls_torch as C
import torch
import torch._dynamo  # noqa: F401  (imported on first use by functional collectives and DDP:
import torch.distributed as T  # 3+ s per process; preloading it here lets forked workers share it)
import torch.distributed._functional_collectives as fc

TIMEOUT = datetime.timedelta(seconds=60)


def _init(rank: int, size: int, method: str, where: str) -> None:
    if method == "env":
        T.init_process_group("colls", timeout=TIMEOUT)  # env:// from MASTER_ADDR etc.
    elif method == "tcp":
        T.init_process_group("colls", init_method=f"tcp://127.0.0.1:{where}", rank=rank,
                             world_size=size, timeout=TIMEOUT)
    elif method == "file":
        T.init_process_group("colls", init_method=f"file://{where}", rank=rank,
                             world_size=size, timeout=TIMEOUT)
    else:
        raise ValueError(method)


def init_and_run(rank: int, size: int, method: str, where: str) -> dict[str, Any]:
    """Initialise through ``method``; run collectives, functional collectives, objects."""
    _init(rank, size, method, where)
    out: dict[str, Any] = {
        "backend": str(T.get_backend()),
        "pg type": type(T.group.WORLD).__name__,
        "is colls pg": isinstance(T.group.WORLD, C.ProcessGroupColls),
        "rank": T.get_rank(), "size": T.get_world_size(),
    }
    t = torch.full((3,), float(rank + 1))
    T.all_reduce(t)
    out["all_reduce"] = t
    w = T.all_reduce(torch.ones(2, dtype=torch.bfloat16), op=T.ReduceOp.MAX, async_op=True)
    out["async Work"] = (isinstance(w, C.Work), w.wait(), w.is_completed())
    out["functional all_reduce"] = fc.all_reduce(torch.full((2,), float(rank)), "sum",
                                                 T.group.WORLD).wait()
    out["functional all_gather"] = fc.all_gather_tensor(torch.tensor([rank]), 0,
                                                        T.group.WORLD).wait()
    out["functional reduce_scatter"] = fc.reduce_scatter_tensor(
        torch.arange(size, dtype=torch.float32), "sum", 0, T.group.WORLD).wait()
    objs: list[Any] = [None] * size
    T.all_gather_object(objs, {"rank": rank})
    out["all_gather_object"] = objs
    T.barrier()
    T.destroy_process_group()
    return out


def failing_work(rank: int, size: int) -> dict[str, Any]:
    """A receive whose message is larger than its tensor fails: wait() and the future raise."""
    T.init_process_group("colls", timeout=TIMEOUT)
    out: dict[str, Any] = {}
    if rank == 0:
        T.send(torch.ones(8), 1)
    elif rank == 1:
        work = T.irecv(torch.zeros(2), 0)
        try:
            work.wait()
            out["wait"] = "no error"
        except Exception as exc:  # the type is what the test checks
            out["wait"] = type(exc).__name__
            out["is torch DistError"] = isinstance(exc, T.DistError)
        try:
            work.get_future().wait()
            out["future"] = "no error"
        except Exception as exc:
            out["future"] = type(exc).__name__
        out["is_success"] = work.is_success()
    # Rank 0 (which hosts torch's store) stays until rank 1 has its outcome: leaving at once
    # could take the store away while rank 1 is still setting up its side of the group.
    store = T.distributed_c10d._get_default_store()
    if rank == 1:
        store.set("failing_work/done", "1")
    else:
        store.wait(["failing_work/done"])
    T.destroy_process_group()
    return out


def transports(rank: int, size: int) -> dict[str, Any]:
    """pg_options chooses the transport; a bad name is refused on every rank."""
    T.init_process_group("colls", timeout=TIMEOUT)
    out: dict[str, Any] = {"default": T.group.WORLD.transport}
    g = T.new_group(backend="colls", pg_options={"transport": "gloo"})
    t = torch.ones(1)
    T.all_reduce(t, group=g)
    out["gloo alias"] = (g.transport, t.item())
    g2 = T.new_group(backend="colls", pg_options=C.ProcessGroupColls.Options(transport="tcp"))
    out["Options"] = g2.transport
    try:
        T.new_group(backend="colls", pg_options={"transport": "no-such-transport"})
        out["bad"] = "accepted"
    except Exception as exc:
        out["bad"] = (type(exc).__name__, "no-such-transport" in str(exc))
    T.destroy_process_group()
    return out


def bad_env_transport(rank: int, size: int) -> str:
    """COLLS_TORCH_TRANSPORT naming an unknown backend fails init_process_group clearly."""
    try:
        T.init_process_group("colls", timeout=TIMEOUT)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    T.destroy_process_group()
    return "accepted"


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _train(model: torch.nn.Module, group: Any, rank: int, steps: int) -> list[torch.Tensor]:
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 3, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def ddp_colls_vs_gloo(rank: int, size: int, steps: int) -> dict[str, list[torch.Tensor]]:
    """Train one model with DDP over init_process_group("colls") and one over gloo."""
    T.init_process_group("colls", timeout=TIMEOUT)
    gloo = T.new_group(backend="gloo")
    weights = {
        "colls": _train(_model(0), None, rank, steps),
        "gloo": _train(_model(0), gloo, rank, steps),
        "start": [p.detach().clone() for p in _model(0).parameters()],
    }
    T.destroy_process_group()
    return weights
