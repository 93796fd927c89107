"""What the Ray tests run inside actors (sent by value, see conftest.py).

The functions take the actor instance first, as ``actor.__ray_call__.remote(fn, ...)`` passes
it. Inputs are a function of rank and size only, so the driver computes NumPy's answer itself.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import ray
import ray.util.collective as col
from ray.util.collective.types import ReduceOp

#: Elements of the large allreduce: 1 MiB of float32, past colls' segment and eager sizes.
LARGE = 1 << 18


@ray.remote(num_cpus=0)
class Peer:
    """An actor with nothing of its own: the tests run functions in it with __ray_call__."""

    def pid(self) -> int:
        import os

        return os.getpid()


def data(rank: int, count: int, dtype: Any, salt: int = 0) -> np.ndarray:
    """Return rank ``rank``'s input: small integers (exact in every dtype and product)."""
    values = (np.arange(count, dtype=np.int64) * (rank + 2) + 3 * salt + rank) % 5 + 1
    return values.astype(dtype)


def every_collective(actor: Any, group: str) -> dict[str, Any]:
    """Run every collective of ray.util.collective on this rank; return what each produced."""
    del actor
    import torch

    rank, size = col.get_rank(group), col.get_collective_group_size(group)
    out: dict[str, Any] = {"rank": rank, "size": size}
    for salt, op in enumerate(ReduceOp):
        for dtype in (np.float32, np.int64):
            x = data(rank, 7, dtype, salt)
            col.allreduce(x, group_name=group, op=op)
            out[f"allreduce/{op.name}/{np.dtype(dtype).name}"] = x
    x = data(rank, LARGE, np.float32)
    col.allreduce(x, group_name=group)
    out["allreduce/large"] = x
    t = torch.from_numpy(data(rank, 5, np.float64))
    col.allreduce(t, group_name=group, op=ReduceOp.MAX)
    out["allreduce/torch"] = t.numpy()
    col.barrier(group_name=group)
    for root in range(size):
        x = data(rank, 6, np.float64, salt=root)
        col.reduce(x, dst_rank=root, group_name=group, op=ReduceOp.SUM)
        out[f"reduce/{root}"] = x
        y = data(rank, 4, np.int32, salt=root)
        col.broadcast(y, src_rank=root, group_name=group)
        out[f"broadcast/{root}"] = y
    gathered = [np.zeros(3, np.float32) for _ in range(size)]
    col.allgather(gathered, data(rank, 3, np.float32), group_name=group)
    out["allgather"] = np.stack(gathered)
    for op in (ReduceOp.SUM, ReduceOp.MAX):
        chunk = np.zeros(4, np.float32)
        pieces = [data(rank, 4, np.float32, salt=i) for i in range(size)]
        col.reducescatter(chunk, pieces, group_name=group, op=op)
        out[f"reducescatter/{op.name}"] = chunk
    sent, got = data(rank, 9, np.float32, salt=7), np.zeros(9, np.float32)
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    if rank % 2 == 0:
        col.send(sent, nxt, group_name=group)
        col.recv(got, prev, group_name=group)
    else:
        col.recv(got, prev, group_name=group)
        col.send(sent, nxt, group_name=group)
    out["recv"] = got
    return out


def allreduce_until_it_fails(actor: Any, group: str, count: int) -> dict[str, Any]:
    """Allreduce in a loop until a call raises; return the error and when it was raised."""
    del actor
    x = np.ones(count, np.float32)
    calls = 0
    while True:
        try:
            col.allreduce(x, group_name=group)
        except Exception as exc:  # noqa: BLE001 - the test looks at what it was
            return {"time": time.time(), "calls": calls, "type": type(exc).__name__,
                    "mro": [c.__name__ for c in type(exc).__mro__], "message": str(exc),
                    "dead_ranks": getattr(exc, "dead_ranks", None)}
        calls += 1


def actor_id(actor: Any) -> str:
    """Return this actor's id as Ray prints it."""
    del actor
    return ray.get_runtime_context().get_actor_id()


def leave(actor: Any, group: str) -> None:
    """Leave ``group`` in this actor, if it is in it."""
    del actor
    if col.is_group_initialized(group):
        col.destroy_collective_group(group)


def one_ddp_step(config: dict[str, Any]) -> None:
    """One forward/backward of a small model under DDP; write each rank's averaged gradients.

    Each rank writes ``config["out"] + f".{rank}"`` (JSON): Ray Train 2.60 keeps no metrics of a
    report without a checkpoint.
    """
    import json

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ddp = DistributedDataParallel(model)
    rank = dist.get_rank()
    batches = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(32, 8, generator=batches), torch.randn(32, 1, generator=batches)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    grads = [p.grad.detach().double().flatten().tolist() for p in model.parameters()]
    with open(f"{config['out']}.{rank}", "w") as out:
        json.dump({"grads": grads, "backend": dist.get_backend(),
                   "world": dist.get_world_size(), "rank": rank}, out)


def join_plain(actor: Any, world_size: int, rank: int, group: str) -> None:
    """Join ``group`` Ray's own way: register in this actor, then init_collective_group."""
    del actor
    import colls.ray

    colls.ray.register()
    col.init_collective_group(world_size, rank, backend="colls", group_name=group)


def allreduce_value(actor: Any, group: str, value: float) -> list[float]:
    """All-reduce ``value`` (4 float64 copies) in ``group``; return the result."""
    del actor
    x = np.full(4, value)
    col.allreduce(x, group_name=group)
    return x.tolist()
