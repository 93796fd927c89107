"""Many small groups: created cheaply, correct, and connected only where their collectives go."""

from __future__ import annotations

import pytest
from scale_workers import GROUP_SIZE, many_subgroups, subgroups_on_two_hosts

from colls.testing.spawn import spawn

WORLD = 16


def _ring(rank: int, size: int) -> list[int]:
    return sorted({(rank - 1) % size, (rank + 1) % size} - {rank})


@pytest.mark.timeout(120)
def test_four_groups_of_four_and_a_subset_group_reduce_correctly_over_few_connections():
    results = spawn(many_subgroups, WORLD, timeout=100, env={"COLLS_SHM": "0"})
    for rank, got in enumerate(results):
        first = rank // GROUP_SIZE * GROUP_SIZE
        assert got["sub"] == [float(sum(range(first, first + GROUP_SIZE)))] * 5, rank
        # 4 ranks: the all_reduce partners (recursive doubling) are within distance 2
        assert len(got["sub_connected"]) <= GROUP_SIZE - 1
        # the world group made no connection beyond its ring: the subgroups have their own
        assert got["world_connected"] == _ring(rank, WORLD), rank
        if rank % 2:
            assert got["odd"] == [float(sum(range(1, WORLD, 2)))] * 3, rank
            me, size = rank // 2, WORLD // 2
            ring = set(_ring(me, size))
            partners = {me ^ 1, me ^ 2, me ^ 4}  # recursive doubling over 8 ranks
            assert set(got["odd_connected"]) <= ring | partners, (rank, got["odd_connected"])


@pytest.mark.timeout(120)
def test_subgroups_derive_their_host_maps_from_the_world_without_asking_the_store():
    """Hosts {0, 1} and {2, 3}: the world exchanges identities once; each subgroup's map is the
    world's restricted to its ranks (a rank alone on its host meets the others over TCP)."""
    results = spawn(subgroups_on_two_hosts, 4, backend=None, timeout=100)
    for rank, got in enumerate(results):
        assert got["exchanges"] == ["default_pg"], rank  # the world's, and no subgroup's
        if rank >= 1:
            assert got["across"]["hosts"] == [[0], [1, 2]], rank
            assert got["across"]["sum"] == [2.0 + 3.0 + 4.0] * 3, rank
            assert got["across"]["shm"] == (rank >= 2), rank
        if rank <= 1:
            assert got["pair"]["hosts"] == [[0, 1]], rank
            assert got["pair"]["sum"] == [1.0 + 2.0] * 3, rank
            assert got["pair"]["shm"] is True, rank
