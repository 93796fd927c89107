"""colls.algorithms.hierarchical: every two-level shape against NumPy, on even and uneven hosts.

The local level here is point-to-point (P2PLevel) on the strict threaded transport, so each shape
is checked for data movement and message matching; tests/launcher/test_multihost.py runs them over
shared memory and sockets across network namespaces.
"""

from __future__ import annotations

import numpy as np
import pytest
from alg_data import TAG, equal, make, reference, run, spec

from colls.algorithms import _p2p, hierarchical
from colls.algorithms.hosts import HostMap
from colls.errors import CollsTimeoutError
from colls.work import Work

pytestmark = pytest.mark.timeout(120)

#: Host maps: even (2x2, 3x2, interleaved ranks) and uneven (3+1, 1+3, 2+1+2).
EVEN = [((0, 1), (2, 3)), ((0, 1), (2, 3), (4, 5)), ((0, 2), (1, 3))]
UNEVEN = [((0, 1, 2), (3,)), ((0,), (1, 2, 3)), ((0, 1), (2,), (3, 4))]
COUNTS = (1, 7, 40)  # 1 < L (empty slices), odd (padding), many 16-byte segments


def _topology(comm, hosts: HostMap) -> hierarchical.Topology:
    local = hosts.hosts[hosts.host_of(comm.rank)]
    level = hierarchical.P2PLevel(hierarchical.SubComm(comm, local))
    return hierarchical.Topology(comm, hosts, level)


def _shapes(collective: str, layout) -> list[str]:
    hosts = HostMap(layout)
    shapes = ["leader"]
    if hosts.uniform and collective in ("all_reduce", "all_gather", "reduce_scatter"):
        shapes.append("two_level")
    return shapes


def _cases(collective: str):
    return [
        (layout, shape)
        for layout in EVEN + UNEVEN
        for shape in _shapes(collective, layout)
    ]


@pytest.mark.parametrize(("layout", "shape"), _cases("all_reduce"))
@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize(("dtype", "op"), [("float32", "SUM"), ("int64", "MAX"),
                                            ("bfloat16", "SUM"), ("bool", "BOR")])
def test_all_reduce(layout, shape, count, dtype, op):
    hosts = HostMap(layout)
    n = hosts.world_size
    inputs = [make(dtype, count, r) for r in range(n)]
    reduce_spec = spec(op, dtype)
    expected = reference(reduce_spec, [x.copy() for x in inputs])

    def fn(comm):
        array = inputs[comm.rank].copy()
        hierarchical.run("all_reduce", shape, _topology(comm, hosts), array, reduce_spec, TAG)
        return array

    results = run(n, fn)
    for rank, result in enumerate(results):
        equal(result, expected, f"all_reduce {shape} {layout} count={count} rank {rank}")
        assert result.tobytes() == results[0].tobytes(), "ranks disagree bitwise"


@pytest.mark.parametrize(("layout", "shape"), _cases("broadcast"))
def test_broadcast_from_every_root(layout, shape):
    hosts = HostMap(layout)
    n = hosts.world_size
    inputs = [make("float64", 29, r, seed=3) for r in range(n)]
    for root in range(n):

        def fn(comm, root=root):
            array = inputs[comm.rank].copy()
            hierarchical.run("broadcast", shape, _topology(comm, hosts), array, root, TAG)
            return array

        for rank, result in enumerate(run(n, fn)):
            equal(result, inputs[root], f"broadcast {layout} root={root} rank {rank}")


@pytest.mark.parametrize(("layout", "shape"), _cases("reduce"))
def test_reduce_to_every_root_leaves_the_others_unchanged(layout, shape):
    hosts = HostMap(layout)
    n = hosts.world_size
    inputs = [make("int32", 23, r, seed=4) for r in range(n)]
    reduce_spec = spec("SUM", "int32")
    expected = reference(reduce_spec, [x.copy() for x in inputs])
    for root in range(n):

        def fn(comm, root=root):
            array = inputs[comm.rank].copy()
            hierarchical.run("reduce", shape, _topology(comm, hosts), array, root,
                             reduce_spec, TAG)
            return array

        for rank, result in enumerate(run(n, fn)):
            want = expected if rank == root else inputs[rank]
            equal(result, want, f"reduce {layout} root={root} rank {rank}")


@pytest.mark.parametrize(("layout", "shape"), _cases("all_gather"))
@pytest.mark.parametrize("count", (1, 9))
def test_all_gather(layout, shape, count):
    hosts = HostMap(layout)
    n = hosts.world_size
    inputs = [make("uint8", count, r, seed=5) for r in range(n)]

    def fn(comm):
        output = np.zeros(n * count, dtype=np.uint8)
        source = inputs[comm.rank].copy()
        hierarchical.run("all_gather", shape, _topology(comm, hosts), output, source, TAG)
        equal(source, inputs[comm.rank], "all_gather changed its input")
        return output

    for rank, result in enumerate(run(n, fn)):
        equal(result, np.concatenate(inputs), f"all_gather {shape} {layout} rank {rank}")


@pytest.mark.parametrize(("layout", "shape"), _cases("reduce_scatter"))
@pytest.mark.parametrize("count", (1, 9))
def test_reduce_scatter(layout, shape, count):
    hosts = HostMap(layout)
    n = hosts.world_size
    inputs = [make("float32", n * count, r, seed=6) for r in range(n)]
    reduce_spec = spec("SUM", "float32")
    total = reference(reduce_spec, [x.copy() for x in inputs])

    def fn(comm):
        output = np.zeros(count, dtype=np.float32)
        source = inputs[comm.rank].copy()
        hierarchical.run("reduce_scatter", shape, _topology(comm, hosts), output, source,
                         reduce_spec, TAG)
        equal(source, inputs[comm.rank], "reduce_scatter changed its input")
        return output

    for rank, result in enumerate(run(n, fn)):
        equal(result, total[rank * count : (rank + 1) * count],
              f"reduce_scatter {shape} {layout} rank {rank}")


@pytest.mark.parametrize("layout", EVEN + UNEVEN)
def test_barrier_waits_for_every_host(layout):
    hosts = HostMap(layout)
    n = hosts.world_size
    entered: list[int] = []

    def fn(comm):
        if comm.rank == n - 1:
            import time

            time.sleep(0.2)  # the last rank arrives late: nobody may leave before it enters
        entered.append(comm.rank)
        hierarchical.run("barrier", "leader", _topology(comm, hosts), TAG)
        return len(entered)

    assert run(n, fn) == [n] * n


def test_sub_comm_refuses_a_rank_outside_it_and_any_source():
    class Comm:
        rank, world_size, timeout = 2, 4, 1.0

    with pytest.raises(ValueError, match=r"rank 2 is not in the sub-group \(0, 1\)"):
        hierarchical.SubComm(Comm(), (0, 1))
    sub = hierarchical.SubComm(Comm(), (1, 2))
    assert (sub.rank, sub.world_size) == (1, 2)
    with pytest.raises(ValueError, match="receives must name their source"):
        sub.irecv(np.zeros(1), None, TAG)


@pytest.mark.parametrize("layout", EVEN)
@pytest.mark.parametrize("count", (41, 64))
def test_all_reduce_pipelined_over_a_helper_thread(layout, count, monkeypatch):
    """With overlap, pieces cross on a helper thread while this one runs the local steps."""
    monkeypatch.setattr(hierarchical, "PIPELINE_PIECE_BYTES", 32)  # 41 or 64 float32: 5-8 pieces
    hosts = HostMap(layout)
    n = hosts.world_size
    inputs = [make("float32", count, r, seed=7) for r in range(n)]
    reduce_spec = spec("SUM", "float32")
    expected = reference(reduce_spec, [x.copy() for x in inputs])
    threads: set[str] = set()
    real = hierarchical.flat.all_reduce

    def recording(comm, *args):
        threads.add(hierarchical.threading.current_thread().name)
        real(comm, *args)

    monkeypatch.setattr(hierarchical.flat, "all_reduce", recording)

    def fn(comm):
        local = hosts.hosts[hosts.host_of(comm.rank)]
        level = hierarchical.P2PLevel(hierarchical.SubComm(comm, local))
        t = hierarchical.Topology(comm, hosts, level, overlap=True)
        array = inputs[comm.rank].copy()
        hierarchical.all_reduce_two_level(t, array, reduce_spec, TAG)
        return array

    results = run(n, fn)
    for rank, result in enumerate(results):
        equal(result, expected, f"pipelined all_reduce {layout} count={count} rank {rank}")
        assert result.tobytes() == results[0].tobytes()
    assert "colls-two-level" in threads, "the column all_reduces ran on the helper thread"


def test_a_failing_column_step_fails_the_pipelined_all_reduce(monkeypatch):
    monkeypatch.setattr(hierarchical, "PIPELINE_PIECE_BYTES", 32)
    hosts = HostMap(((0, 1), (2, 3)))

    def broken(comm, *args):
        raise RuntimeError(f"column step failed on sub-rank {comm.rank}")

    monkeypatch.setattr(hierarchical.flat, "all_reduce", broken)

    def fn(comm):
        local = hosts.hosts[hosts.host_of(comm.rank)]
        level = hierarchical.P2PLevel(hierarchical.SubComm(comm, local))
        t = hierarchical.Topology(comm, hosts, level, overlap=True)
        hierarchical.all_reduce_two_level(t, np.ones(64, np.float32), spec("SUM", "float32"),
                                          TAG)

    with pytest.raises(RuntimeError, match="column step failed"):
        run(4, fn)


def test_hosts_with_and_without_overlap_exchange_the_same_pieces(monkeypatch):
    """One host pipelines (shared memory), the other does not: the columns must still match."""
    monkeypatch.setattr(hierarchical, "PIPELINE_PIECE_BYTES", 32)
    hosts = HostMap(((0, 1), (2, 3)))
    inputs = [make("float32", 70, r, seed=8) for r in range(4)]
    reduce_spec = spec("SUM", "float32")
    expected = reference(reduce_spec, [x.copy() for x in inputs])

    def fn(comm):
        local = hosts.hosts[hosts.host_of(comm.rank)]
        level = hierarchical.P2PLevel(hierarchical.SubComm(comm, local))
        t = hierarchical.Topology(comm, hosts, level, overlap=hosts.host_of(comm.rank) == 0)
        array = inputs[comm.rank].copy()
        hierarchical.all_reduce_two_level(t, array, reduce_spec, TAG)
        return array

    for rank, result in enumerate(run(4, fn)):
        equal(result, expected, f"mixed overlap rank {rank}")


def test_a_sub_group_step_that_times_out_names_the_groups_rank_first():
    class Silent:  # a backend whose messages never arrive
        rank, world_size, timeout = 3, 4, 0.05

        def isend(self, array, dst, tag):
            return Work(description=f"send to {dst}")

        def irecv(self, array, src, tag):
            return Work(description=f"recv from {src}")

    sub = hierarchical.SubComm(Silent(), (2, 3))
    step = _p2p.Pending(sub, TAG, "all_reduce ring: receive from rank 0")
    step.recv(np.zeros(4), 0)
    with pytest.raises(CollsTimeoutError) as info:
        step.wait()
    assert str(info.value) == (
        "rank 3 (rank 1 of its sub-group of ranks [2, 3], which numbers the ranks below): "
        "all_reduce ring: receive from rank 0 did not complete within 0.1 s")
