"""CUDA tensors through colls_torch on the tcp transport (staged through host memory)."""

from __future__ import annotations

import colls_torch as dist
import torch


def staged_collectives(rank: int, size: int) -> str:
    """Run collectives on CUDA tensors and check the results land back on the device."""
    dist.init_process_group("gloo")
    dev = torch.device("cuda", 0)
    t = torch.full((4,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    assert t.device == dev and torch.equal(t.cpu(), torch.full((4,), float(size * (size + 1) // 2)))
    outs = [torch.zeros(2, device=dev, dtype=torch.bfloat16) for _ in range(size)]
    work = dist.all_gather(outs, torch.full((2,), rank, device=dev, dtype=torch.bfloat16),
                           async_op=True)
    work.wait()
    for r, o in enumerate(outs):
        assert o.device == dev and torch.equal(o.cpu(), torch.full((2,), r, dtype=torch.bfloat16))
    b = torch.arange(3.0, device=dev) * rank
    dist.broadcast(b, size - 1)
    assert torch.equal(b.cpu(), torch.arange(3.0) * (size - 1))
    if rank == 0:
        dist.send(torch.ones(2, device=dev), 1)
    elif rank == 1:
        got = torch.zeros(2, device=dev)
        dist.recv(got, 0)
        assert torch.equal(got.cpu(), torch.ones(2))
    dist.destroy_process_group()
    return "ok"
