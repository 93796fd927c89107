"""Train a small model with DistributedDataParallel over colls.

Run with the colls launcher (or torchrun; both set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)::

    colls-run --nproc-per-node 2 examples/ddp_train.py
    colls-run --nproc-per-node 2 examples/ddp_train.py --backend gloo   # torch's own, to compare
    COLLS_TORCH_TRANSPORT=mpi ...                                        # another colls transport

Importing colls_torch registers the ``colls`` backend with torch.distributed; after that,
``init_process_group("colls")`` is all a script changes. Each rank trains on its own shard of a
synthetic regression problem; DDP averages the gradients over colls, so every replica ends with
the same weights (checked at the end).
"""

from __future__ import annotations

import argparse

import colls_torch  # noqa: F401  (registers the "colls" backend)
import torch
import torch.distributed as dist
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
    parser.add_argument("--backend", default="colls", help="torch.distributed backend")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    args = parser.parse_args()

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
              f"{dist.get_backend()} (weight checksum {checksum.item():.6f})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
