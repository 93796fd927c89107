"""A torchrun worker on both torch faces: colls_torch's own rendezvous, and DDP over colls.

Usage: ``ddp_worker.py OUT_DIR``. ``colls_torch.init_process_group("gloo", "env://")`` joins
colls' world through torchrun's agent store; ``torch.distributed.init_process_group("colls")``
joins torch's through the same store (torch's own rendezvous, another key namespace), and DDP
averages gradients over it. Each rank writes OUT_DIR/rank<R>.json: its DDP gradients after one
backward pass, the gradients gathered from every rank through colls_torch, and the average of
every rank's local gradients computed here with plain torch (what DDP must produce).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import colls_torch as dist
import torch
import torch.distributed
from torch.nn.parallel import DistributedDataParallel

FEATURES, OUTPUTS, BATCH = 8, 3, 16


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, OUTPUTS).double()


def shard(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(BATCH, FEATURES, generator=gen, dtype=torch.float64)
    return x, torch.randn(BATCH, OUTPUTS, generator=gen, dtype=torch.float64)


def gradients(net: torch.nn.Module, rank: int) -> torch.Tensor:
    x, y = shard(rank)
    torch.nn.functional.mse_loss(net(x), y).backward()
    return torch.cat([p.grad.flatten() for p in net.parameters()])


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", init_method="env://")
    torch.distributed.init_process_group("colls")
    rank, size = dist.get_rank(), dist.get_world_size()
    ddp = gradients(DistributedDataParallel(model()), rank)
    every = [torch.empty_like(ddp) for _ in range(size)]
    dist.all_gather(every, ddp)
    expected = torch.stack([gradients(model(), r) for r in range(size)]).mean(dim=0)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "size": size, "ddp": ddp.tolist(),
        "gathered": [g.tolist() for g in every], "expected": expected.tolist(),
        "torch_backend": torch.distributed.get_backend(), "colls_backend": str(dist.get_backend()),
    }))
    torch.distributed.destroy_process_group()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
