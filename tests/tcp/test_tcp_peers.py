"""Let no one in, on the tcp backend's peer connections.

The peer listener binds only the advertised address and is closed with the group; a
stranger that connects and says nothing is dropped after COLLS_HANDSHAKE_TIMEOUT while setup goes
on; with a token every peer connection must pass the HMAC challenge-response, and a rank with
another token cannot join (a clear error, logged).
"""

from __future__ import annotations

import logging
import socket
import time

import numpy as np
import psutil
import pytest
from _support import on_threads
from sec_helpers import backend

from colls.errors import CollsError
from colls.store import HashStore
from colls_plugins.tcp.connections import ADDRESS_KEY, open_listener

#: The group's token, and another one (both long enough to be accepted).
TOKEN = "open sesame, at least 16 bytes"
WRONG = "a wrong token, long enough too"


def _close_all(items) -> None:
    for item in items:
        if hasattr(item, "close"):
            item.close()


def _exchange(backends) -> list[float]:
    a, b = backends[0], backends[1]
    out = np.zeros(3)
    recv = b.irecv(out, 0, 7)
    a.isend(np.array([1.0, 2.0, 3.0]), 1, 7).wait(10)
    recv.wait(10)
    return out.tolist()


def test_the_listener_binds_only_the_address_it_is_given():
    listener = open_listener("127.0.0.1", backlog=4)
    try:
        host, port = listener.getsockname()[:2]
        assert host == "127.0.0.1"
        other = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                 if a.family == socket.AF_INET and not a.address.startswith("127.")]
        for address in other:  # the same port on another interface of this host: refused
            with pytest.raises(OSError):
                socket.create_connection((address, port), timeout=2).close()
    finally:
        listener.close()


@pytest.mark.timeout(60)
def test_one_loopback_listener_per_rank_while_the_group_lives_and_none_after():
    store = HashStore()
    me = psutil.Process()

    def listening() -> set:
        return {c.laddr for c in me.net_connections("tcp") if c.status == psutil.CONN_LISTEN}

    before = listening()
    backends = on_threads(lambda r: backend(store, r, 3), 3, errors_as_results=True)
    try:
        opened = listening() - before  # lazy connections: peers may connect at any time
        published = {store.get(f"sec/{ADDRESS_KEY.format(rank=r)}").decode() for r in range(3)}
        assert {f"{a.ip}:{a.port}" for a in opened} == published
        assert all(a.ip == "127.0.0.1" for a in opened)
        assert _exchange(backends) == [1.0, 2.0, 3.0]
    finally:
        _close_all(backends)
    assert listening() == before


@pytest.mark.timeout(60)
def test_a_silent_stranger_is_dropped_and_setup_goes_on(monkeypatch, caplog):
    monkeypatch.setenv("COLLS_HANDSHAKE_TIMEOUT", "0.5")
    monkeypatch.setenv("COLLS_SHM", "0")
    caplog.set_level(logging.WARNING, logger="colls.tcp")
    store = HashStore()
    strangers: list[socket.socket] = []
    dropped_after: list[float] = []

    def rank(r: int):
        if r == 1:  # a stranger connects to rank 0's listener first and says nothing
            address = store.get("sec/" + ADDRESS_KEY.format(rank=0)).decode()
            host, port = address.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=5)
            strangers.append(sock)
            start = time.monotonic()
            assert sock.recv(1) == b""  # the listener side closes it
            dropped_after.append(time.monotonic() - start)
        return backend(store, r, 2)

    backends = on_threads(rank, 2, errors_as_results=True)
    try:
        assert not any(isinstance(b, BaseException) for b in backends), backends
        assert 0.3 < dropped_after[0] < 5.0
        assert "dropped a half-open connection" in caplog.text
        assert _exchange(backends) == [1.0, 2.0, 3.0]
    finally:
        _close_all(strangers + backends)


@pytest.mark.timeout(60)
def test_peers_with_the_same_token_connect(monkeypatch):
    monkeypatch.setenv("COLLS_SHM", "0")
    store = HashStore()
    backends = on_threads(lambda r: backend(store, r, 3, token=TOKEN), 3,
                          errors_as_results=True)
    try:
        assert not any(isinstance(b, BaseException) for b in backends), backends
        assert _exchange(backends) == [1.0, 2.0, 3.0]
    finally:
        _close_all(backends)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("other", [WRONG, None])
def test_a_rank_with_another_token_cannot_join(monkeypatch, caplog, other):
    monkeypatch.delenv("COLLS_AUTH_TOKEN", raising=False)
    caplog.set_level(logging.WARNING, logger="colls.tcp")
    store = HashStore()
    tokens = [TOKEN, other]
    results = on_threads(lambda r: backend(store, r, 2, token=tokens[r], timeout=2.0), 2,
                         errors_as_results=True)
    try:
        assert all(isinstance(r, CollsError) for r in results), results
        assert "refused a connection" in caplog.text
        if other:  # rank 1 rejects rank 0's proof first; both sides say why
            assert "could not prove it knows COLLS_AUTH_TOKEN" in str(results[1])
            assert "a different COLLS_AUTH_TOKEN" in caplog.text
        else:
            assert "unauthenticated connection refused" in caplog.text
    finally:
        _close_all(results)
