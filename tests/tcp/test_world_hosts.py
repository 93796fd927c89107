"""colls_plugins.tcp._world_hosts: a subgroup's host map from the world's, per job store."""

from __future__ import annotations

from colls.algorithms.hosts import HostMap
from colls.store import HashStore, PrefixStore
from colls_plugins.tcp import _world_hosts

WORLD = HostMap(((0, 1, 4), (2, 3), (5,)))


def test_a_subgroup_gets_the_world_map_restricted_to_its_ranks_through_any_prefix() -> None:
    job = HashStore()
    assert _world_hosts.remember(PrefixStore("default_pg", job), WORLD)
    try:
        subgroup_store = PrefixStore("group/3", job)
        assert _world_hosts.derive(subgroup_store, [1, 2, 4, 5]) == HostMap(((0, 2), (1,), (3,)))
        assert _world_hosts.derive(subgroup_store, [3, 5]) == HostMap(((0,), (1,)))
        assert _world_hosts.derive(subgroup_store, [0, 6]) is None  # not a rank of that world
        assert _world_hosts.derive(PrefixStore("group/3", HashStore()), [0, 1]) is None
    finally:
        _world_hosts.forget(job)
    assert _world_hosts.derive(PrefixStore("group/4", job), [0, 1]) is None


def test_only_the_first_map_of_a_job_store_is_kept_until_it_is_forgotten() -> None:
    job = HashStore()
    assert _world_hosts.remember(job, WORLD)
    try:
        assert not _world_hosts.remember(job, HostMap.single(6))  # a second world of one host
        assert _world_hosts.derive(job, [0, 2]) == HostMap(((0,), (1,)))
    finally:
        _world_hosts.forget(job)
    assert _world_hosts.remember(job, HostMap.single(6))
    _world_hosts.forget(job)
