"""Train a small model with DistributedDataParallel over colls: one import changed.

Run with the colls launcher (or torchrun; both set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)::

    colls-run --nproc-per-node 2 examples/ddp_train.py
    colls-run --nproc-per-node 2 examples/ddp_train.py --face torch     # torch's gloo, to compare
    colls-run --nproc-per-node 2 examples/ddp_train.py --backend mpi    # under mpiexec instead

``import colls_torch as dist`` instead of ``import torch.distributed as dist`` is all a script
changes: ``dist.init_process_group("gloo")`` makes colls' world torch's default group, so DDP,
built without a ``process_group``, averages the gradients over colls. Each rank trains on its
own shard of a synthetic regression problem; every replica ends with the same weights (checked
at the end).
"""

from __future__ import annotations

import argparse
import importlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

FEATURES, HIDDEN, OUTPUTS = 16, 32, 4
BATCH = 32


def make_model() -> torch.nn.Module:
    """Return the model, identical on every rank (fixed seed)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUTPUTS)
    )


def batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Return this rank's shard: inputs and targets of a fixed linear map plus noise."""
    truth = torch.Generator().manual_seed(1)
    weight = torch.randn(FEATURES, OUTPUTS, generator=truth)
    gen = torch.Generator().manual_seed(100 + rank)
    data = []
    for _ in range(steps):
        x = torch.randn(BATCH, FEATURES, generator=gen)
        data.append((x, x @ weight + 0.01 * torch.randn(BATCH, OUTPUTS, generator=gen)))
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--face", choices=["colls", "torch"], default="colls",
                        help="import colls_torch (default) or torch.distributed as dist")
    parser.add_argument("--backend", default="gloo", help="init_process_group's backend")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    args = parser.parse_args()

    # The one line a port changes: import colls_torch as dist (torch.distributed to compare).
    dist = importlib.import_module("colls_torch" if args.face == "colls" else "torch.distributed")
    dist.init_process_group(args.backend)  # env:// as set by colls-run / torchrun
    rank, size = dist.get_rank(), dist.get_world_size()
    model = DDP(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, (x, y) in enumerate(batches(rank, args.steps)):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # gradients are all-reduced over the backend here
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  mean loss {mean.item():.4f}", flush=True)

    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum()
    sums = [torch.zeros_like(checksum) for _ in range(size)]
    dist.all_gather(sums, checksum)
    if not all(torch.equal(s, sums[0]) for s in sums):
        raise SystemExit(f"replicas diverged: {[s.item() for s in sums]}")
    if rank == 0:
        print(f"{size} replicas identical after {args.steps} steps over "
              f"{torch.distributed.get_backend()} (weight checksum {checksum.item():.6f})",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
