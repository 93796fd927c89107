"""Run under ``mpiexec -n N``: colls_torch over colls' mpi backend, checked against known values.

Prints one ``OK <rank> <checks>`` line per rank; any failure raises (non-zero exit).
"""

from __future__ import annotations

import colls_torch as dist
import torch


def main() -> None:
    dist.init_process_group("mpi")
    rank, size = dist.get_rank(), dist.get_world_size()
    checks = 0
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.complex64):
        t = torch.full((5,), rank + 1).to(dtype)
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((5,), size * (size + 1) // 2).to(dtype)), (dtype, t)
        b = torch.full((3,), rank).to(dtype)
        dist.broadcast(b, size - 1)
        assert torch.equal(b, torch.full((3,), size - 1).to(dtype)), (dtype, b)
        outs = [torch.zeros(2).to(dtype) for _ in range(size)]
        work = dist.all_gather(outs, torch.full((2,), rank).to(dtype), async_op=True)
        assert work.wait() and all(torch.equal(o, torch.full((2,), r).to(dtype))
                                   for r, o in enumerate(outs))
        checks += 3
    objs = [None] * size
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in range(size)]
    if rank == 0:
        dist.send(torch.arange(4.0), 1)
    elif rank == 1:
        got = torch.zeros(4)
        assert dist.recv(got) == 0 and torch.equal(got, torch.arange(4.0))
    assert str(dist.get_backend()) == "mpi"
    checks += one_world_groups(rank, size)
    dist.barrier()
    dist.destroy_process_group()
    print(f"OK {rank} {checks + 3}", flush=True)


def one_world_groups(rank: int, size: int) -> int:
    """Groups torch makes itself (its new_group, DeviceMesh) in colls' world move data over mpi.

    No MASTER_ADDR here: colls' world store is local to the process, so a group that
    rendezvoused over tcp would hang; the world's backend needs no rendezvous.
    """
    import torch.distributed as T
    from torch.distributed.device_mesh import init_device_mesh

    assert T.is_initialized() and T.get_backend() == "colls"
    pair = T.new_group([0, 1])
    t = torch.full((2,), float(rank + 1))
    T.all_reduce(t, group=pair)
    if rank in (0, 1):
        assert t.tolist() == [3.0, 3.0] and pair.transport == "mpi", (t, pair)
    mesh = init_device_mesh("cpu", (size,))
    m = torch.full((1,), float(rank))
    T.all_reduce(m, group=mesh.get_group())
    assert m.item() == size * (size - 1) / 2
    return 2


if __name__ == "__main__":
    main()
