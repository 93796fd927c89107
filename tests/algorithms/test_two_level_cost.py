"""The link traffic of the two-level shapes equals docs/algorithms.md's formulas.

Bytes that leave a host are what a host's link carries; the threaded transport records every
send (destination, tag, bytes), so the test sums, per host, the bytes sent to ranks of other
hosts and compares them with the cost model: two_level all_reduce 2(K-1)/K·m against the flat
ring's 2(N-1)/N·m, all_gather and reduce_scatter (K-1)/K·m, leader broadcast m into every other
host.
"""

from __future__ import annotations

import numpy as np
import pytest
from alg_data import TAG, spec
from threaded_world import ThreadedWorld, run_ranks

from colls.algorithms import hierarchical, ring
from colls.algorithms.hosts import HostMap

pytestmark = pytest.mark.timeout(120)

#: K hosts of L ranks, ranks of a host numbered contiguously (as launchers place them).
LAYOUTS = [((0, 1), (2, 3)), ((0, 1), (2, 3), (4, 5), (6, 7)), ((0, 1, 2), (3, 4, 5))]
#: Elements: divisible by every N and L here, so every chunk and slice is equal.
COUNT = 2 * 3 * 4 * 5 * 8


def _leaving(world: ThreadedWorld, hosts: HostMap) -> list[int]:
    """Bytes each host sent to other hosts."""
    out = [0] * hosts.num_hosts
    for comm in world.comms:
        mine = hosts.host_of(comm.rank)
        out[mine] += sum(nbytes for dst, _, nbytes in comm.stats.sends
                         if hosts.host_of(dst) != mine)
    return out


def _run(hosts: HostMap, body) -> list[int]:
    world = ThreadedWorld(hosts.world_size)

    def fn(comm):
        local = hosts.hosts[hosts.host_of(comm.rank)]
        level = hierarchical.P2PLevel(hierarchical.SubComm(comm, local))
        body(comm, hierarchical.Topology(comm, hosts, level))

    run_ranks(hosts.world_size, fn, world=world)
    return _leaving(world, hosts)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_level_all_reduce_sends_2_k_minus_1_over_k_of_the_message_per_host(layout,
                                                                                monkeypatch):
    monkeypatch.setenv("COLLS_SMALL_MESSAGE_BYTES", "8")  # the columns run rings, as at scale
    hosts = HostMap(layout)
    k, n = hosts.num_hosts, hosts.world_size
    m = COUNT * 4
    op = spec("SUM", "float32")

    def two_level(comm, t):
        hierarchical.all_reduce_two_level(t, np.ones(COUNT, np.float32), op, TAG)

    def flat_ring(comm, t):
        ring.all_reduce(comm, np.ones(COUNT, np.float32), op, TAG)

    assert _run(hosts, two_level) == [2 * (k - 1) * m // k] * k
    flat = _run(hosts, flat_ring)
    assert flat == [2 * (n - 1) * m // n] * k
    assert flat[0] / (2 * (k - 1) * m // k) == pytest.approx((n - 1) * k / ((k - 1) * n))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_level_all_gather_and_reduce_scatter_send_k_minus_1_over_k(layout, monkeypatch):
    monkeypatch.setenv("COLLS_SMALL_MESSAGE_BYTES", "8")
    hosts = HostMap(layout)
    k, n = hosts.num_hosts, hosts.world_size
    per_rank = COUNT // n
    m = COUNT * 4
    op = spec("SUM", "float32")

    def gather(comm, t):
        out = np.empty(COUNT, np.float32)
        hierarchical.all_gather_two_level(t, out, np.ones(per_rank, np.float32), TAG)

    def scatter(comm, t):
        out = np.empty(per_rank, np.float32)
        hierarchical.reduce_scatter_two_level(t, out, np.ones(COUNT, np.float32), op, TAG)

    assert _run(hosts, gather) == [(k - 1) * m // k] * k
    assert _run(hosts, scatter) == [(k - 1) * m // k] * k


def test_leader_broadcast_brings_the_message_into_every_other_host_once(monkeypatch):
    monkeypatch.setenv("COLLS_SMALL_MESSAGE_BYTES", "8")
    monkeypatch.setenv("COLLS_ALGORITHM", "broadcast=scatter_allgather")
    hosts = HostMap(((0, 1), (2, 3), (4, 5)))
    m = COUNT * 4
    world = ThreadedWorld(hosts.world_size)
    root = 3

    def fn(comm):
        local = hosts.hosts[hosts.host_of(comm.rank)]
        level = hierarchical.P2PLevel(hierarchical.SubComm(comm, local))
        t = hierarchical.Topology(comm, hosts, level)
        hierarchical.broadcast_leader(t, np.ones(COUNT, np.float32), root, TAG)

    run_ranks(hosts.world_size, fn, world=world)
    received = [0] * hosts.num_hosts
    for comm in world.comms:
        src_host = hosts.host_of(comm.rank)
        for dst, _, nbytes in comm.stats.sends:
            if hosts.host_of(dst) != src_host:
                received[hosts.host_of(dst)] += nbytes
    # scatter-allgather among the 3 representatives: each other host's representative gets its
    # chunk (m/3) and then the other two (2m/3); the ring all-gather also brings 2m/3 back to the
    # root's host, which already had them
    assert received == [m, 2 * m // 3, m]
