"""A torchrun worker: one import swapped, then DDP as a training script has it.

Usage: ``ddp_worker.py OUT_DIR [FAIL_RANK]``. ``colls_torch.init_process_group("gloo")`` is the
only init: it joins colls' world through torchrun's agent store and makes it torch's default
group, so ``DistributedDataParallel(model)`` (no ``process_group``) averages gradients over colls.
Each rank writes OUT_DIR/attempt<A>.rank<R>.json (A = TORCHELASTIC_RESTART_COUNT): its DDP
gradients after one backward pass, the gradients gathered from every rank through colls_torch,
the average of every rank's local gradients computed here with plain torch (what DDP must
produce), the backends both faces report, how many calls torch's default group ran through
colls, and whether torch is left initialised after colls_torch's destroy. In the first
attempt, FAIL_RANK (when given) exits 3 after its report, so that torchrun restarts the group.
"""

from __future__ import annotations

import json
import os
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
    fail_rank = int(sys.argv[2]) if len(sys.argv) > 2 else -1
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    ddp = gradients(DistributedDataParallel(model()), rank)
    every = [torch.empty_like(ddp) for _ in range(size)]
    dist.all_gather(every, ddp)
    expected = torch.stack([gradients(model(), r) for r in range(size)]).mean(dim=0)
    report = {
        "rank": rank, "size": size, "ddp": ddp.tolist(), "pid": os.getpid(),
        "gathered": [g.tolist() for g in every], "expected": expected.tolist(),
        "torch_backend": torch.distributed.get_backend(), "colls_backend": str(dist.get_backend()),
        "torch_calls_through_colls": torch.distributed.group.WORLD.calls_run,
    }
    if attempt == 0 and rank == fail_rank:
        (out / f"attempt{attempt}.rank{rank}.json").write_text(json.dumps(report))
        sys.exit(3)
    dist.barrier()
    dist.destroy_process_group()
    report["torch_initialized_after_destroy"] = torch.distributed.is_initialized()
    (out / f"attempt{attempt}.rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
