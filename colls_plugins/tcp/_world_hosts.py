"""The world group's host map, kept so that a subgroup derives its own instead of asking the store.

Every tcp group needs to know which of its ranks share a host (:mod:`~colls_plugins.tcp.shm.setup`).
The world group finds out through the store: every rank publishes its host identity and rank 0
publishes the map. A subgroup (``new_group``, ``new_subgroups``: 64 groups of 4 at 256 ranks) would
repeat that exchange, although the answer is already known: a process's host never changes, so the
subgroup's map is the world's map restricted to its members. Every member derives the same map from
the same world map, so they still agree without a message.

The map is kept per store under the groups' prefixes (``colls.new_group`` puts every group in a
:class:`~colls.store.PrefixStore` of the world's store), so a subgroup of another job's store, or
of a world that was destroyed (its backend forgets the map when it closes), exchanges as before.
Where the world group is not tcp no map is kept, so every member of a tcp subgroup exchanges:
all members of a group take the same path.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from colls.algorithms.hosts import HostMap
from colls.store.base import Store, innermost

#: For each job store: the lowest world rank on the host of every world rank.
_FIRST_ON_HOST: weakref.WeakKeyDictionary[Store, tuple[int, ...]] = weakref.WeakKeyDictionary()


def remember(store: Store, hosts: HostMap) -> bool:
    """Keep the world group's ``hosts`` for ``store``'s job store, unless a map is kept already.

    Returns whether it was kept: the backend that kept it forgets it when it closes.
    """
    job = innermost(store)
    if job in _FIRST_ON_HOST:
        return False
    first = [0] * hosts.world_size
    for host in hosts.hosts:
        for rank in host:
            first[rank] = host[0]
    _FIRST_ON_HOST[job] = tuple(first)
    return True


def forget(store: Store) -> None:
    """Drop the map kept for ``store``'s job store (its world group is closing)."""
    _FIRST_ON_HOST.pop(innermost(store), None)


def derive(store: Store, global_ranks: Sequence[int] | None) -> HostMap | None:
    """Return the host map of a group of the world ranks ``global_ranks``, or None if unknown."""
    first = _FIRST_ON_HOST.get(innermost(store))
    if first is None or not global_ranks or any(not 0 <= r < len(first) for r in global_ranks):
        return None
    return HostMap.from_identities([str(first[r]) for r in global_ranks])


__all__ = ["derive", "forget", "remember"]
