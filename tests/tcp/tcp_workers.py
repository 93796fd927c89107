"""Worker functions of the multi-process tcp tests (importable by spawned children)."""

from __future__ import annotations

import time

import numpy as np
from tcp_helpers import options

from colls.store import PrefixStore, TCPStore
from colls_plugins.tcp.backend import TcpBackend

COUNT = 1 << 20


def exchange(rank: int, port: int, results) -> None:
    """Join a 2-rank group and swap arrays with the other rank; report what arrived."""
    store = TCPStore("127.0.0.1", port, timeout=30)
    backend = TcpBackend(PrefixStore("mp", store), rank, 2, options(2, name="mp"))
    try:
        peer = 1 - rank
        out = np.zeros(COUNT, np.float64)
        recv = backend.irecv(out, peer, 0)
        backend.isend(np.arange(COUNT, dtype=np.float64) * (rank + 1), peer, 0).wait(30)
        source = recv.result()
        small = np.zeros(1, np.int64)
        any_recv = backend.irecv(small, None, 1)
        backend.isend(np.array([100 + rank]), peer, 1).wait(30)
        results.put((rank, source, float(out.sum()), any_recv.result(), int(small[0])))
    finally:
        backend.close()
        store.close()


def send_then_hang(rank: int, port: int) -> None:
    """Join as rank 1, send one message to rank 0, then wait to be killed."""
    store = TCPStore("127.0.0.1", port, timeout=30)
    backend = TcpBackend(PrefixStore("kill", store), rank, 2, options(2, name="kill"))
    backend.isend(np.arange(10, dtype=np.int32), 0, 0).wait(30)
    time.sleep(120)
