"""Ranks of the device-map tests: torch's ``"cpu:X,cuda:Y"`` backends, on CPU-only backends."""

from __future__ import annotations

import colls_torch as dist
import numpy as np
import torch
from colls_torch import _groups

import colls
from colls.testing.host_only import HOST_ONLY, register_host_only

#: CPU tensors on ``hostonly``, CUDA ones on tcp. The "meta" entry lets a tensor that exists on
#: this machine (a meta tensor) show how a call picks its group by the tensors' device.
DEVICE_MAP = f"cpu:{HOST_ONLY},cuda:gloo,meta:gloo"


def routes_by_device(rank: int, size: int) -> dict:
    """Create the world and a subgroup with a device map; report what each one runs on."""
    register_host_only()
    dist.init_process_group(DEVICE_MAP)
    world = _groups.resolve(None)
    cuda_group = world.device_groups["cuda"]
    # A CPU tensor runs on the group's own backend, through colls_torch as through torch.
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    cpu_pick = _groups.member(None, "all_reduce", t).backend_name
    meta_pick = _groups.member(None, "all_reduce", [torch.empty(0, device="meta")]).backend_name
    # The CUDA entry's group is a working group over the same ranks (its own store and order).
    x = np.full(4, rank + 1, dtype=np.int64)
    colls.all_reduce(x, group=cuda_group)
    sub = dist.new_group(list(range(size)))  # no backend: the world's device map, as in torch
    sub_cuda = _groups.resolve(sub).device_groups["cuda"]
    y = np.arange(3, dtype=np.float64) * (rank + 1)
    colls.all_reduce(y, group=sub_cuda)
    result = {
        "config": dist.get_backend_config(),
        "backend": str(dist.get_backend()),
        "world": world.backend_name,
        "cuda_group": (cuda_group.backend_name, list(cuda_group.global_ranks), cuda_group.rank),
        "cpu_pick": cpu_pick,
        "meta_pick": meta_pick,
        "device_groups": sorted(world.device_groups),
        "reduced": t.tolist(),
        "on_cuda_group": x.tolist(),
        "sub_cuda": sub_cuda.backend_name,
        "on_sub_cuda": y.tolist(),
        "pg_count": dist.get_pg_count(),
    }
    dist.destroy_process_group()
    result["closed"] = cuda_group.destroyed and sub_cuda.destroyed
    return result
