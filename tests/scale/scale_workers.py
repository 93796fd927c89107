"""Workers of the scale tests (module level, so that spawned ranks can import them)."""

from __future__ import annotations

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
