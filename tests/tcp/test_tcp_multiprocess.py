"""The tcp backend between real processes (spawned), rendezvous through a TCPStore."""

from __future__ import annotations

import multiprocessing
import time

import numpy as np
import pytest
import tcp_workers
from tcp_helpers import options

from colls.errors import NetworkError
from colls.store import PrefixStore, TCPStore
from colls_plugins.tcp.backend import TcpBackend

JOIN_TIMEOUT = 60.0


@pytest.mark.timeout(120)
def test_two_processes_exchange_arrays():
    ctx = multiprocessing.get_context("spawn")
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=60)
    results = ctx.Queue()
    procs = [ctx.Process(target=tcp_workers.exchange, args=(r, master.port, results))
             for r in range(2)]
    try:
        for p in procs:
            p.start()
        got = sorted(results.get(timeout=JOIN_TIMEOUT) for _ in procs)
        for p in procs:
            p.join(JOIN_TIMEOUT)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        master.close()
    total = float(np.arange(tcp_workers.COUNT, dtype=np.float64).sum())
    assert got == [(0, 1, 2 * total, 1, 101), (1, 0, total, 0, 100)]


@pytest.mark.timeout(120)
def test_killed_peer_fails_pending_receive_within_seconds():
    ctx = multiprocessing.get_context("spawn")
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=60)
    child = ctx.Process(target=tcp_workers.send_then_hang, args=(1, master.port))
    child.start()
    backend = None
    try:
        backend = TcpBackend(PrefixStore("kill", master), 0, 2, options(2, timeout=60, name="kill"))
        first = np.zeros(10, np.int32)
        assert backend.irecv(first, 1, 0).result() == 1
        assert first.tolist() == list(range(10))
        pending = backend.irecv(np.zeros(4), 1, 1)
        child.kill()
        start = time.monotonic()
        with pytest.raises(NetworkError, match=r"tcp: connection to rank 1 \(127\.0\.0\.1:\d+\) "
                                                r"lost"):
            pending.wait(30)
        assert time.monotonic() - start < 5.0
    finally:
        if child.is_alive():
            child.kill()
        child.join(JOIN_TIMEOUT)
        if backend is not None:
            backend.close()
        master.close()
