"""A torchrun worker: torch's own libraries through one face, for a comparison with gloo.

Usage: ``libs_worker.py FACE OUT_DIR`` with FACE ``gloo`` (``import torch.distributed as dist``)
or ``dropin`` (``import colls_torch as dist``). Either way the script calls only
``dist.init_process_group("gloo")`` and ``dist.new_group``; everything else goes through the
libraries, which reach torch.distributed themselves: DDP, FSDP2, DeviceMesh and DTensor, DCP,
``torch.distributed.nn.functional``, the functional collectives (eager and compiled), the
``*_object`` collectives and torchmetrics. Each rank writes OUT_DIR/FACE.rank<R>.json: every
case's results (as lists), and, for the drop-in face, how many calls each case ran through
colls and the backends of every group torch held.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as T

CASES: dict[str, Callable[[Any, int, int], Any]] = {}


def case(fn: Callable[[Any, int, int], Any]) -> Callable[[Any, int, int], Any]:
    CASES[fn.__name__] = fn
    return fn


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


def train(net: torch.nn.Module, rank: int, steps: int = 3) -> dict[str, Any]:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = batch(rank, step)
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": flat(net)}


def flat(net: torch.nn.Module) -> list[float]:
    parts = []
    for p in net.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        parts.append(full.detach().flatten())
    return torch.cat(parts).tolist()


@case
def ddp(dist: Any, rank: int, size: int) -> Any:
    return train(torch.nn.parallel.DistributedDataParallel(mlp()), rank)


@case
def ddp_on_groups(dist: Any, rank: int, size: int) -> Any:
    made = dist.new_group(list(range(size)))
    first = train(torch.nn.parallel.DistributedDataParallel(mlp(), process_group=made), rank)
    world = dist.group.WORLD
    second = train(torch.nn.parallel.DistributedDataParallel(mlp(1), process_group=world), rank)
    return {"new_group": first, "group.WORLD": second}


@case
def fsdp2(dist: Any, rank: int, size: int) -> Any:
    from torch.distributed.fsdp import fully_shard

    net = mlp()
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(net)
    return train(net, rank)


@case
def dtensor(dist: Any, rank: int, size: int) -> Any:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = torch.arange(4.0 * size * 3).reshape(4 * size, 3)
    mesh = init_device_mesh("cpu", (size,))
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    local = sharded.to_local().tolist()
    sharded = sharded * (rank + 1)  # not a DTensor op that keeps replicas equal: local only
    summed = sharded.redistribute(mesh, [Replicate()]).to_local().tolist()
    from_group = DeviceMesh.from_group(dist.new_group(list(range(size))), "cpu")
    again = distribute_tensor(full, from_group, [Shard(1)]).redistribute(
        from_group, [Replicate()]).to_local().tolist()
    return {"local": local, "replicated": summed, "from_group": again}


@case
def dcp(dist: Any, rank: int, size: int) -> Any:
    import torch.distributed.checkpoint as dcp_

    saved = mlp(3)
    where = [tempfile.mkdtemp(prefix="colls-dcp-") if rank == 0 else None]
    T.broadcast_object_list(where, src=0)
    try:
        dcp_.save(saved.state_dict(), checkpoint_id=where[0])
        loaded = mlp(4)
        state = loaded.state_dict()
        dcp_.load(state, checkpoint_id=where[0], process_group=dist.new_group(list(range(size))))
        loaded.load_state_dict(state)
        T.barrier()
    finally:
        if rank == 0:
            shutil.rmtree(where[0], ignore_errors=True)
    return {"equal": flat(saved) == flat(loaded), "params": flat(loaded)}


@case
def nn_functional(dist: Any, rank: int, size: int) -> Any:
    from torch.distributed.nn import functional as F

    x = torch.arange(5.0, requires_grad=True) * 1.0
    x.retain_grad()
    y = F.all_reduce(x * (rank + 1))
    (y * torch.arange(5.0)).sum().backward()
    gathered = F.all_gather(torch.full((2,), float(rank)))
    return {"y": y.tolist(), "grad": x.grad.tolist(), "gathered": [g.tolist() for g in gathered]}


@case
def functional_collectives(dist: Any, rank: int, size: int) -> Any:
    import torch.distributed._functional_collectives as funcol

    world = T.group.WORLD
    t = torch.arange(6.0) + rank
    eager = funcol.all_reduce(t, "sum", world)
    gathered = funcol.all_gather_tensor(t, 0, world)
    scattered = funcol.reduce_scatter_tensor(torch.arange(2.0 * size) * (rank + 1), "sum", 0,
                                             world)

    def step(x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x * 2, "sum", world) + 1

    compiled = torch.compile(step, backend="aot_eager")(t)
    return {"eager": eager.tolist(), "gathered": gathered.tolist(),
            "scattered": scattered.tolist(), "compiled": compiled.tolist()}


@case
def objects(dist: Any, rank: int, size: int) -> Any:
    every: list[Any] = [None] * size
    T.all_gather_object(every, {"rank": rank, "name": f"r{rank}"})
    sent = [{"from": 0, "payload": list(range(3))}] if rank == 0 else [None]
    T.broadcast_object_list(sent, src=0)
    gathered: list[Any] | None = [None] * size if rank == 0 else None
    T.gather_object(("g", rank), gathered, dst=0)
    out: list[Any] = [None]
    T.scatter_object_list(out, [f"to{r}" for r in range(size)] if rank == 0 else None, src=0)
    return {"all": every, "broadcast": sent, "gather": gathered, "scatter": out}


def torchmetrics(dist: Any, rank: int, size: int) -> Any:
    from torchmetrics import MeanSquaredError
    from torchmetrics.classification import MulticlassAccuracy

    mse, acc = MeanSquaredError(), MulticlassAccuracy(num_classes=3)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(rank + 2):  # uneven shards
        preds, target = torch.randn(7, generator=gen), torch.randn(7, generator=gen)
        mse.update(preds, target)
        acc.update(torch.randn(5, 3, generator=gen), torch.randint(0, 3, (5,), generator=gen))
    return {"mse": mse.compute().item(), "accuracy": acc.compute().item()}


if importlib.util.find_spec("torchmetrics") is not None:  # an optional peer
    case(torchmetrics)


def torch_groups() -> list[Any]:
    return list(T.distributed_c10d._world.pg_map)


def calls_through_colls() -> int:
    from colls_torch import ProcessGroupColls

    return sum(pg.calls_run for pg in torch_groups() if isinstance(pg, ProcessGroupColls))


def main() -> None:
    face, out = sys.argv[1], Path(sys.argv[2])
    dist = importlib.import_module("torch.distributed" if face == "gloo" else "colls_torch")
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    report: dict[str, Any] = {"rank": rank, "results": {}, "calls": {}, "groups": []}
    for name, fn in CASES.items():
        before = calls_through_colls() if face != "gloo" else 0
        report["results"][name] = fn(dist, rank, size)
        report["calls"][name] = (calls_through_colls() if face != "gloo" else 0) - before
        report["groups"] += [[type(pg).__name__, T.get_backend(pg)] for pg in torch_groups()]
    report["backend"] = T.get_backend()
    dist.destroy_process_group()
    (out / f"{face}.rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
