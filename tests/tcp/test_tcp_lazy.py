"""Lazy connections: who connects to whom, simultaneous first contact, peers that never answer.

Shared memory is off here: with it, small messages between ranks of one host go through
shared memory and open no connection at all (colls_plugins/tcp/shm/p2p.py).
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import numpy as np
import pytest
from _support import on_threads
from tcp_helpers import WAIT, options

from colls.errors import BackendError, CollsTimeoutError, NetworkError
from colls.store import HashStore, PrefixStore
from colls_plugins.tcp.connections import ADDRESS_KEY, Mesh
from colls_plugins.tcp.engine import Engine

#: Group timeout of the "never answers" tests: the error must come within it (plus slack).
SHORT = 1.5


@pytest.fixture(autouse=True)
def _sockets_only(monkeypatch):
    """Keep point-to-point on the sockets: with shared memory, host peers need no connection."""
    monkeypatch.setenv("COLLS_SHM", "0")


def _pairing(backends) -> dict[tuple[int, int], bool]:
    """Return, per connected pair (a < b), whether both ends hold the same socket pair."""
    ends = {}
    for backend in backends:
        for rank, peer in backend._engine._peers.items():
            ends[backend.rank, rank] = (peer.sock.getsockname(), peer.sock.getpeername(),
                                        peer.dialed)
    pairs = {}
    for (a, b), (local, remote, _) in ends.items():
        if a < b:
            other = ends.get((b, a))
            pairs[a, b] = other is not None and other[0] == remote and other[1] == local
    return pairs


@pytest.mark.timeout(60)
def test_a_new_group_holds_only_its_ring_neighbours(group):
    backends = group(8, name="ring8")
    for backend in backends:
        r = backend.rank
        assert backend._engine.connected_ranks() == sorted({(r - 1) % 8, (r + 1) % 8})


@pytest.mark.timeout(60)
def test_a_send_connects_and_a_receive_waits_for_the_peer_to_connect(group, monkeypatch):
    monkeypatch.setenv("COLLS_SHM", "0")  # host peers' small messages need no connection
    backends = group(8, name="lazy8")
    out = np.zeros(4)
    receive = backends[5].irecv(out, 1, 3)  # rank 1 has no connection to rank 5 yet
    time.sleep(0.2)
    assert not receive.is_completed()
    backends[1].isend(np.arange(4.0) + 1, 5, 3).wait(WAIT)
    assert receive.wait(WAIT) and receive.result() == 1 and out.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert 5 in backends[1]._engine.connected_ranks()
    assert 1 in backends[5]._engine.connected_ranks()
    assert backends[3]._engine.connected_ranks() == [2, 4]  # nobody else connected


@pytest.mark.timeout(60)
def test_an_any_source_receive_takes_a_message_from_a_rank_not_yet_connected(group):
    backends = group(6, name="any6")
    out = np.zeros(2)
    receive = backends[0].irecv(out, None, 9)
    backends[3].isend(np.array([7.0, 8.0]), 0, 9).wait(WAIT)
    assert receive.wait(WAIT) and receive.result() == 3 and out.tolist() == [7.0, 8.0]


def _hold_dials_until_both_are_in_flight(backends, ranks, monkeypatch) -> None:
    """Make the dials of ``ranks`` wait for each other once connected, before the hello."""
    meeting = threading.Barrier(len(ranks), timeout=WAIT)
    for rank in ranks:
        mesh = backends[rank]._engine._mesh
        connect = mesh._connect

        def held(peer, deadline, abandon, connect=connect):
            connected = connect(peer, deadline, abandon)
            meeting.wait()  # both ranks are now in each other's "dialling" set
            return connected

        monkeypatch.setattr(mesh, "_connect", held)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("attempt", range(3))
def test_two_ranks_opening_their_pair_at_once_keep_the_lower_ranks_connection(
    group, monkeypatch, attempt
):
    backends = group(4, name=f"pair{attempt}")  # ranks 0 and 2 are not ring neighbours
    _hold_dials_until_both_are_in_flight(backends, (0, 2), monkeypatch)
    got = {0: np.zeros(1), 2: np.zeros(1)}

    def exchange(rank: int) -> int:
        other = 2 - rank
        receive = backends[rank].irecv(got[rank], other, 1)
        backends[rank].isend(np.array([rank + 0.5]), other, 1).wait(WAIT)
        receive.wait(WAIT)
        return receive.result()

    threads = [threading.Thread(target=exchange, args=(r,)) for r in (0, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert got[0].tolist() == [2.5] and got[2].tolist() == [0.5]
    assert backends[0]._engine._peers[2].dialed  # rank 0's connection was kept ...
    assert not backends[2]._engine._peers[0].dialed  # ... and rank 2's declined
    assert _pairing(backends)[0, 2]


@pytest.mark.timeout(90)
def test_concurrent_first_contact_between_every_pair(group, monkeypatch):
    """Every rank sends to every other at once: one connection per pair, every message intact."""
    monkeypatch.setenv("COLLS_SHM", "0")  # host peers' small messages need no connection
    n = 7
    backends = group(n, name="all7")
    barrier = threading.Barrier(n)

    def exchange(rank: int) -> list[float]:
        backend = backends[rank]
        got = [np.zeros(1) for _ in range(n)]
        receives = [backend.irecv(got[s], s, 5) for s in range(n) if s != rank]
        barrier.wait()
        sends = [backend.isend(np.array([rank * 10.0 + d]), d, 5) for d in range(n) if d != rank]
        for work in sends + receives:
            work.wait(WAIT)
        return [float(g[0]) for g in got]

    results = on_threads(exchange, n, timeout=60)
    for rank, got in enumerate(results):
        assert got == [0.0 if s == rank else s * 10.0 + rank for s in range(n)]
    for backend in backends:
        assert backend._engine.connected_ranks() == [r for r in range(n) if r != backend.rank]
    assert all(_pairing(backends).values())
    assert len(_pairing(backends)) == n * (n - 1) // 2


def _silent_listener() -> socket.socket:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.listen(8)
    return listener  # the kernel accepts connections; nobody ever answers a hello


@pytest.mark.timeout(60)
def test_creating_a_group_fails_naming_a_neighbour_that_never_answers():
    store = HashStore()
    silent = _silent_listener()
    try:
        store.set("g/" + ADDRESS_KEY.format(rank=0), b"127.0.0.1:%d" % silent.getsockname()[1])
        from colls_plugins.tcp.backend import TcpBackend

        start = time.monotonic()
        with pytest.raises(CollsTimeoutError) as info:  # rank 1 dials its ring neighbour 0
            TcpBackend(PrefixStore("g", store), 1, 2, options(2, timeout=SHORT))
        elapsed = time.monotonic() - start
    finally:
        silent.close()
    assert "rank 1 of group 'g' could not connect within 1.5 s: no answer from ranks [0]" in str(
        info.value)
    assert SHORT * 0.9 < elapsed < SHORT + 10


def _lazy_engine(store: HashStore, rank: int, world_size: int, timeout: float) -> Engine:
    prefixed = PrefixStore("g", store)
    mesh = Mesh(prefixed, rank, world_size, options(world_size, timeout=timeout))
    mesh.publish()
    return Engine(rank, {}, timeout, "g", mesh=mesh)


@pytest.mark.timeout(60)
def test_a_send_to_a_peer_that_never_answers_fails_naming_it_and_tells_health():
    store = HashStore()
    silent = _silent_listener()
    engine = _lazy_engine(store, 0, 3, SHORT)
    lost: list[tuple[int, BaseException]] = []
    engine.set_failure_listener(lambda rank, exc: lost.append((rank, exc)))
    try:
        store.set("g/" + ADDRESS_KEY.format(rank=2), b"127.0.0.1:%d" % silent.getsockname()[1])
        start = time.monotonic()
        work = engine.isend(np.ones(4), 2, 0)
        with pytest.raises(NetworkError, match=r"rank 0 cannot reach rank 2: .*no answer from "
                           r"ranks \[2\]"):
            work.wait(WAIT)
        assert time.monotonic() - start < SHORT + 10
        assert [rank for rank, _ in lost] == [2]
    finally:
        engine.close()
        silent.close()


@pytest.mark.timeout(60)
def test_a_broken_group_stops_waiting_for_a_peer_that_never_answers():
    store = HashStore()
    silent = _silent_listener()
    engine = _lazy_engine(store, 0, 3, 60.0)
    try:
        store.set("g/" + ADDRESS_KEY.format(rank=2), b"127.0.0.1:%d" % silent.getsockname()[1])
        failed: list[float] = []

        def send() -> None:
            start = time.monotonic()
            with pytest.raises(BackendError, match="rank 1 died"):
                engine.isend(np.ones(4), 2, 0).wait(WAIT)
            failed.append(time.monotonic() - start)

        sender = threading.Thread(target=send)
        sender.start()
        time.sleep(0.5)
        engine.abort(BackendError("colls: group 'g' is broken: rank 1 died"))
        sender.join(WAIT)
        assert failed and failed[0] < 5.0  # not the 60 s group timeout
    finally:
        engine.close()
        silent.close()


@pytest.mark.timeout(60)
def test_a_duplicate_connection_from_a_connected_rank_is_refused(group, caplog):
    from colls_plugins.tcp._frames import Hello

    caplog.set_level(logging.WARNING, logger="colls.tcp")
    backends = group(3, name="dup3")
    address = backends[0]._engine._mesh.address
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(Hello(1, 3, "dup3", "x:1").encode())  # rank 1 connected to rank 0 already
        sock.settimeout(5)
        assert sock.recv(64) == b""
    assert "a duplicate connection of rank 1" in caplog.text
    out = np.zeros(1)
    receive = backends[0].irecv(out, 1, 0)
    backends[1].isend(np.ones(1), 0, 0).wait(WAIT)
    assert receive.wait(WAIT) and receive.result() == 1
