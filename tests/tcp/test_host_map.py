"""The tcp backend's host map and two levels, in one process (no namespaces, no root needed).

Ranks are threads; each thread reports the host identity of its emulated host (shm_setup's
``host_identity`` is replaced by one that reads the thread's name), so one process holds a
group that spans hosts. Checks: every rank agrees on the map with O(N) store requests and leaves
no key behind; the backend runs the two-level shapes over shared memory within a host and
sockets between hosts, with results equal to NumPy's.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from _support import on_threads

from colls import dtypes, fingerprint
from colls.algorithms import hierarchical
from colls.algorithms.hosts import HostMap
from colls.errors import BackendError
from colls.options import BackendOptions
from colls.reduce_ops import resolve_op
from colls.store import HashStore, PrefixStore
from colls_plugins.tcp.backend import TcpBackend
from colls_plugins.tcp.shm import collectives as shm_collectives
from colls_plugins.tcp.shm import setup as shm_setup

pytestmark = pytest.mark.timeout(120)
JOIN_S = 60.0


class CountingStore(HashStore):
    """A HashStore that counts the requests made to it."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: Counter[str] = Counter()
        self._count_lock = threading.Lock()

    def _count(self, name: str) -> None:
        with self._count_lock:
            self.requests[name] += 1

    def set(self, key: str, value: bytes) -> None:
        self._count("set")
        super().set(key, value)

    def get(self, key: str) -> bytes:
        self._count("get")
        return super().get(key)

    def add(self, key: str, amount: int) -> int:
        self._count("add")
        return super().add(key, amount)

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self._count("wait")
        super().wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        self._count("delete_key")
        return super().delete_key(key)

    def multi_get(self, keys: list[str], timeout: Any = None) -> list[bytes]:
        self._count("multi_get")
        return super().multi_get(keys, timeout)

    def delete_keys(self, keys: list[str]) -> int:
        self._count("delete_keys")
        return super().delete_keys(keys)


@pytest.fixture
def hosts_by_thread(monkeypatch: pytest.MonkeyPatch) -> Callable[[list[int]], None]:
    """Return ``use(layout)``: thread ``rank<r>`` reports host ``layout[r]``."""

    def use(layout: list[int]) -> None:
        def identity() -> str:
            rank = int(threading.current_thread().name.removeprefix("rank"))
            return f"host{layout[rank]}"

        monkeypatch.setattr(shm_setup, "host_identity", identity)

    return use


def test_every_rank_agrees_on_the_map_with_o_n_requests_and_no_key_left(hosts_by_thread):
    layout = [0, 1, 0, 2, 1, 0, 3, 3]
    hosts_by_thread(layout)
    store = CountingStore()
    n = len(layout)
    maps = on_threads(
        lambda r: shm_setup.exchange_hosts(store, r, n, float("inf"), "g"), n, JOIN_S)
    assert maps == [HostMap(((0, 2, 5), (1, 4), (3,), (6, 7)))] * n
    assert store.num_keys() == 0, "the exchange must not leave keys behind"
    # rank 0: one multi_get of the others' identities, the map's set, one delete of them all;
    # the others: a set, a multi_get of the map, an add; the last reader: one delete
    assert store.requests == {"multi_get": n, "set": n, "add": n - 1, "delete_keys": 2}, \
        store.requests


def _make_group(layout: list[int], name: str) -> list[TcpBackend]:
    base = HashStore()
    n = len(layout)

    def create(rank: int) -> TcpBackend:
        options = BackendOptions(timeout=30.0, group_name=name, global_ranks=tuple(range(n)))
        return TcpBackend(PrefixStore(name, base), rank, n, options)

    return on_threads(create, n, JOIN_S)


def test_the_backend_runs_two_levels_over_shared_memory_and_sockets(hosts_by_thread,
                                                                     monkeypatch):
    layout = [0, 0, 1, 1]
    hosts_by_thread(layout)
    shapes: Counter[str] = Counter()
    real_run = hierarchical.run

    def counting(collective: str, shape: str, *args: Any) -> None:
        shapes[f"{collective}:{shape}"] += 1
        real_run(collective, shape, *args)

    monkeypatch.setattr(hierarchical, "run", counting)
    backends = _make_group(layout, "two")
    try:
        assert [b.hosts for b in backends] == [HostMap(((0, 1), (2, 3)))] * 4
        assert [b.uses_shm for b in backends] == [True] * 4
        count = 20_001  # 160 KB of float64: above the small-message bound, odd (padding)
        inputs = [np.arange(count, dtype=np.float64) * (r + 1) for r in range(4)]
        arrays = [x.copy() for x in inputs]
        out = [np.zeros(4 * 5, dtype=np.int32) for _ in range(4)]
        total = resolve_op("SUM", dtypes.by_name("float64"), op_name="test")

        tags = [fingerprint.collective_tag(seq, 0) for seq in range(3)]  # calls 0, 1, 2

        def body(r: int) -> None:
            backends[r].all_reduce(arrays[r], total, tags[0])
            backends[r].all_gather(out[r], np.full(5, r, dtype=np.int32), tags[1])
            backends[r].barrier(tags[2])

        on_threads(body, 4, JOIN_S)
        for r in range(4):
            np.testing.assert_array_equal(arrays[r], sum(inputs))
            np.testing.assert_array_equal(out[r], np.repeat(np.arange(4, dtype=np.int32), 5))
        assert shapes == {"all_reduce:two_level": 4, "all_gather:two_level": 4,
                          "barrier:leader": 4}
    finally:
        for b in backends:
            b.close()


def test_shared_memory_errors_name_group_ranks_not_host_indices(hosts_by_thread):
    layout = [0, 0, 1, 1]
    hosts_by_thread(layout)
    backends = _make_group(layout, "names")
    try:
        second_host = [backends[2]._shm, backends[3]._shm]
        assert [g.group_ranks for g in second_host] == [(2, 3), (2, 3)]
        tags = [fingerprint.collective_tag(7, 0), fingerprint.collective_tag(8, 0)]

        def mismatched(i: int) -> str:
            with pytest.raises(BackendError) as info:
                shm_collectives.barrier(second_host[i], tags[i])
            return str(info.value)

        messages = on_threads(mismatched, 2, JOIN_S)
        assert messages[0].startswith("rank 2: barrier (shm): "), messages[0]
        assert "rank 3" in messages[0] and "rank 1" not in messages[0], messages[0]
        assert messages[1].startswith("rank 3: barrier (shm): "), messages[1]
    finally:
        for b in backends:
            b.close()
