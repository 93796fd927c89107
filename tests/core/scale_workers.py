"""Workers of the scale tests (module level, so that spawned ranks can import them)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

import colls
from colls.registry import REGISTRY

#: Ranks per subgroup in the many-subgroups test.
GROUP_SIZE = 4


def _connected(group: Any) -> list[int]:
    """Return the group ranks this rank's tcp backend of ``group`` holds connections to."""
    return group.backend._engine.connected_ranks()


def _world_connected() -> list[int]:
    world = next(g for g in REGISTRY.groups.values() if g.size == REGISTRY.world_size)
    return _connected(world)


def many_subgroups(rank: int, world_size: int) -> dict[str, Any]:
    """Create world_size / GROUP_SIZE groups and an odd-ranks group; reduce in each."""
    mine = None
    for first in range(0, world_size, GROUP_SIZE):
        group = colls.new_group(list(range(first, first + GROUP_SIZE)))
        if first <= rank < first + GROUP_SIZE:
            mine = group
    odd = colls.new_group(list(range(1, world_size, 2)))
    x = np.full(5, float(rank))
    colls.all_reduce(x, group=mine)
    out: dict[str, Any] = {"sub": x.tolist(), "sub_connected": _connected(mine),
                           "world_connected": _world_connected()}
    if rank % 2:
        y = np.full(3, float(rank))
        colls.all_reduce(y, group=odd)
        out["odd"] = y.tolist()
        out["odd_connected"] = _connected(odd)
    return out


def subgroups_on_two_hosts(rank: int, world_size: int) -> dict[str, Any]:
    """On hosts {0, 1} and {2, 3} (COLLS_HOST_ID), make subgroups; count host-map exchanges."""
    from colls_plugins.tcp.shm import setup as shm_setup

    os.environ["COLLS_HOST_ID"] = f"host{rank // 2}"
    exchanges: list[str] = []
    exchange_hosts = shm_setup.exchange_hosts

    def counted(store: Any, group_rank: int, size: int, deadline: float, group: str) -> Any:
        exchanges.append(group)
        return exchange_hosts(store, group_rank, size, deadline, group)

    shm_setup.exchange_hosts = counted
    colls.init_process_group("tcp", timeout=30)
    try:
        across = colls.new_group([1, 2, 3])  # world rank 1 alone on its host, then 2 and 3
        pair = colls.new_group([0, 1])
        out: dict[str, Any] = {}
        for name, group in (("across", across), ("pair", pair)):
            if group is colls.GroupMember.NON_GROUP_MEMBER:
                continue
            x = np.full(3, float(rank + 1))
            colls.all_reduce(x, group=group)
            out[name] = {"hosts": [list(h) for h in group.backend.hosts.hosts],
                         "shm": group.backend.uses_shm, "sum": x.tolist()}
        out["exchanges"] = exchanges
        return out
    finally:
        shm_setup.exchange_hosts = exchange_hosts
        if colls.is_initialized():
            colls.destroy_process_group()
