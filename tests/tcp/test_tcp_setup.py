"""Connection setup of the tcp backend: addresses, hellos, strangers, timeouts, the plugin."""

from __future__ import annotations

import logging
import socket
import threading
import time
from importlib import metadata

import numpy as np
import pytest
from _support import on_threads
from tcp_helpers import options

from colls.errors import CollsTimeoutError
from colls.store import HashStore, PrefixStore, TCPStore
from colls_plugins.tcp import plugin
from colls_plugins.tcp._frames import Hello, HelloError, decode_hello
from colls_plugins.tcp.backend import TcpBackend
from colls_plugins.tcp.connections import advertised_host


class _FakeTcpStore:
    def __init__(self, host):
        self.host = host
        self.port = 29500


class _FakePrefix:
    def __init__(self, inner):
        self.underlying_store = inner


def test_plugin_declares_the_tcp_backend():
    (spec,) = plugin.colls_backends()
    assert (spec.name, spec.devices, spec.create) == ("tcp", ("cpu", "cuda"), TcpBackend)
    assert spec.available() is None


def test_entry_point_points_at_the_plugin_module():
    try:
        dist = metadata.distribution("colls")
    except metadata.PackageNotFoundError:
        pytest.skip("colls is not installed (no entry point metadata)")
    points = [e for e in dist.entry_points if e.group == "colls" and e.name == "tcp"]
    assert [e.value for e in points] == ["colls_plugins.tcp.plugin"]


def test_advertised_host(monkeypatch):
    monkeypatch.delenv("COLLS_TCP_HOST", raising=False)
    assert advertised_host(PrefixStore("g", HashStore())) == "127.0.0.1"
    assert advertised_host(_FakePrefix(_FakeTcpStore("localhost"))) == "127.0.0.1"
    assert advertised_host(_FakePrefix(_FakeTcpStore("127.0.0.5"))) == "127.0.0.1"
    monkeypatch.setenv("COLLS_TCP_HOST", "127.0.0.2")
    assert advertised_host(_FakeTcpStore("localhost")) == "127.0.0.2"


def _non_loopback_ipv4():
    psutil = pytest.importorskip("psutil")
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    pytest.skip("this host has no non-loopback IPv4 address")


def test_advertised_host_routes_towards_a_remote_store(monkeypatch):
    monkeypatch.delenv("COLLS_TCP_HOST", raising=False)
    own = _non_loopback_ipv4()  # a store on this address is reached from this address
    assert advertised_host(_FakePrefix(_FakeTcpStore(own))) == own


def test_hello_round_trip_and_rejections():
    hello = Hello(3, 5, "grp/ü", "10.0.0.1:4000")
    data = hello.encode()
    assert decode_hello(data[:-1]) == (None, 0)
    assert decode_hello(data + b"rest") == (hello, len(data))
    with pytest.raises(HelloError, match="bad magic"):
        decode_hello(b"GET / HTTP/1.1\r\nHost: x\r\n")
    with pytest.raises(HelloError, match="protocol version"):
        decode_hello(data[:4] + b"\x63\x00" + data[6:])


@pytest.mark.timeout(60)
def test_setup_bounded_by_timeout_names_missing_ranks():
    store = HashStore()

    def body(rank):
        with pytest.raises(CollsTimeoutError) as info:
            TcpBackend(PrefixStore("g", store), rank, 3, options(3, timeout=1.5))
        return str(info.value)

    start = time.monotonic()
    messages = on_threads(body, 2)  # rank 2 never comes
    assert time.monotonic() - start < 10
    for rank, message in enumerate(messages):
        assert f"rank {rank} of group 'g' could not connect within 1.5 s" in message
        assert "ranks [2]" in message


@pytest.mark.timeout(60)
def test_setup_timeout_names_ranks_that_never_published():
    with pytest.raises(CollsTimeoutError, match=r"no address published by ranks \[0\]"):
        TcpBackend(PrefixStore("g", HashStore()), 1, 2, options(2, timeout=1.0))


@pytest.mark.timeout(60)
def test_strangers_are_refused_and_setup_goes_on(caplog):
    store = HashStore()
    backends = {}
    rank0 = threading.Thread(
        target=lambda: backends.setdefault(0, TcpBackend(PrefixStore("g", store), 0, 2, options(2)))
    )
    rank0.start()
    host, port = store.get("g/tcp/addr/0").decode().rsplit(":", 1)
    strangers = []
    for payload in (b"garbage that is long enough to be a hello header",
                    Hello(1, 2, "other-group", "x:1").encode(),
                    Hello(0, 2, "g", "x:1").encode(),  # rank 0 is not expected by rank 0
                    b""):
        sock = socket.create_connection((host, int(port)))
        sock.sendall(payload)
        strangers.append(sock)
    strangers[-1].close()  # closes without a hello
    with caplog.at_level(logging.WARNING, logger="colls.tcp"):
        time.sleep(0.3)
        rank1 = TcpBackend(PrefixStore("g", store), 1, 2, options(2))
        rank0.join(30)
    try:
        out = np.zeros(3)
        work = backends[0].irecv(out, 1, 0)
        rank1.isend(np.arange(3.0), 0, 0)
        assert work.result() == 1 and out.tolist() == [0.0, 1.0, 2.0]
        refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert any("bad magic" in m for m in refusals)
        assert any("group 'other-group'" in m for m in refusals)
        assert any("rank 0 is not one of the ranks" in m for m in refusals)
        assert any("closed before sending a hello" in m for m in refusals)
        assert store.check(["g/tcp/addr/0"])  # lazy: the listener and its address stay
    finally:
        for sock in strangers:
            sock.close()
        backends[0].close()
        rank1.close()


@pytest.mark.timeout(60)
def test_group_over_a_tcp_store_with_tuned_sockets():
    master = TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=30)
    clients = [TCPStore("127.0.0.1", master.port, timeout=30) for _ in range(2)]
    stores = [master, *clients]
    try:
        backends = on_threads(
            lambda r: TcpBackend(PrefixStore("tcpg", stores[r]), r, 3, options(3, name="tcpg")), 3
        )
        try:
            sock = backends[0]._engine._peers[1].sock
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            assert backends[0]._engine._peers[1].address.startswith("127.0.0.1:")

            def ring(rank):
                out = np.zeros(100, np.int32)
                work = backends[rank].irecv(out, (rank - 1) % 3, 0)
                backends[rank].isend(np.full(100, rank, np.int32), (rank + 1) % 3, 0).wait(20)
                work.wait(20)
                return out[0]

            assert on_threads(ring, 3) == [2, 0, 1]
        finally:
            for backend in backends:
                backend.close()
    finally:
        for store in reversed(stores):
            store.close()


class _UntouchableStore(HashStore):
    """A store every request of which fails the test: the backend must not have reached it."""

    def _refuse(self, *args: object) -> None:
        raise AssertionError("the backend made a store request before checking its settings")

    _set = _get = _add = _compare_set = _wait = _check = _delete_key = _multi_get = _refuse


@pytest.mark.parametrize(("name", "value"), [
    ("COLLS_SHM", "sometimes"), ("COLLS_SEGMENT_BYTES", "lots"),
    ("COLLS_MAX_MESSAGE_BYTES", "-1"), ("COLLS_HANDSHAKE_TIMEOUT", "soon"),
])
def test_a_bad_setting_fails_before_the_first_store_request(monkeypatch, name, value):
    """Parsed later, it could fail rank 0 first, which hosts the store, and leave the other
    ranks with a lost connection instead of the reason (a CI flake of the conformance suite)."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"environment variable {name}={value!r}"):
        TcpBackend(_UntouchableStore(), 1, 2, options(2))
