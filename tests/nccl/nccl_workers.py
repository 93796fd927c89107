"""Ranks of the nccl plugin's CPU tests: the unique-id exchange and the GPU check over a TCPStore.

They run in a real colls world over tcp (``spawn(..., backend="tcp")``), whose groups' stores
are PrefixStores over the world's TCPStore, exactly what the nccl backend is given.
"""

from __future__ import annotations

import colls
from colls_plugins.nccl import runtime

#: Seconds a rank waits for rank 0's id (generous: a loaded 2-core machine).
EXCHANGE_TIMEOUT_S = 60.0


def unique_ids(rank: int, world_size: int) -> dict[str, str]:
    """Return the NCCL unique id this rank gets for the world and for a subgroup (hex)."""
    from cupy.cuda import nccl

    world = colls.group.WORLD
    pair = colls.new_group([0, 1])
    ids = {}
    for name, group in (("world", world), ("pair", pair)):
        pg = colls.dispatch.resolve_group(group)
        if pg is None:
            continue
        unique_id = runtime.exchange_unique_id(
            pg.store, pg.rank, nccl.get_unique_id, EXCHANGE_TIMEOUT_S
        )
        ids[name] = unique_id.hex()
    return ids


def device_check(rank: int, world_size: int, identities: list[str]) -> str:
    """Publish ``identities[rank]`` as this rank's GPU; return "ok" or the refusal's message."""
    pg = colls.dispatch.default_group()
    try:
        runtime.check_distinct_devices(
            pg.store, pg.rank, pg.size, identities[rank],
            f"CUDA device {identities[rank]}", EXCHANGE_TIMEOUT_S,
        )
    except ValueError as exc:
        return str(exc)
    return "ok"
