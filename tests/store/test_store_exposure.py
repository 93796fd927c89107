"""Let no one in, on the TCPStore server: bind only the given host, drop half-open connections.

A connection must send its first complete frame within the handshake timeout (the server is
built here with 0.5 s), and a frame it starts must be finished that fast; a client that is idle
*between* requests is a normal client and is kept.
"""

from __future__ import annotations

import socket
import time

import pytest

from colls.store import TCPStore, _wire
from colls.store._wire import Command
from colls.store.tcp_server import StoreServer

HANDSHAKE_S = 0.5


#: Two loopback addresses: Linux routes all of 127.0.0.0/8 to lo, so a server bound to one is a
#: server bound to one interface address, and the tests never leave loopback.
BOUND, OTHER = "127.0.0.1", "127.0.0.2"


@pytest.fixture
def server():
    srv = StoreServer("127.0.0.1", 0, handshake_timeout=HANDSHAKE_S)
    srv.start()
    yield srv
    srv.stop()


def _closed_after(sock: socket.socket, limit: float = 5.0) -> float:
    """Return the seconds until the server closes ``sock`` (fails past ``limit``)."""
    sock.settimeout(limit)
    start = time.monotonic()
    assert sock.recv(1) == b"", "expected the server to close the connection"
    return time.monotonic() - start


def test_store_binds_only_the_host_it_is_given():
    with TCPStore(BOUND, 0, is_master=True, timeout=5) as store:
        assert store.server is not None
        assert store.server.listener_address()[0] == BOUND
        with pytest.raises(OSError):
            socket.create_connection((OTHER, store.port), timeout=2).close()


def test_a_store_bound_to_another_address_is_not_reachable_on_the_first():
    with TCPStore(OTHER, 0, is_master=True, timeout=5) as store:
        assert store.server is not None
        assert store.server.listener_address()[0] == OTHER
        with pytest.raises(OSError):
            socket.create_connection((BOUND, store.port), timeout=2).close()
        with TCPStore(OTHER, store.port, timeout=5) as client:
            client.set("reachable", b"yes")
            assert store.get("reachable") == b"yes"


def test_a_client_that_sends_nothing_is_dropped(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        assert HANDSHAKE_S * 0.8 < _closed_after(sock) < HANDSHAKE_S + 3.0


@pytest.mark.timeout(30)
def test_a_frame_left_half_sent_is_dropped(server):
    frame = _wire.encode_frame(Command.SET, [b"key", b"value"])
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(_wire.encode_frame(Command.NUM_KEYS, []))  # a complete first request
        sock.recv(64)
        sock.sendall(frame[:-3])  # then a frame that never completes
        assert _closed_after(sock) < HANDSHAKE_S + 3.0


@pytest.mark.timeout(30)
def test_an_idle_client_between_requests_is_kept(server):
    with TCPStore("127.0.0.1", server.port, timeout=5) as client:
        client.set("a", b"1")
        time.sleep(HANDSHAKE_S * 3)
        assert client.get("a") == b"1"
        client.set("b", b"2")  # the same pooled connection is still being served


@pytest.mark.timeout(30)
def test_a_parked_wait_longer_than_the_handshake_timeout_is_kept(server):
    with TCPStore("127.0.0.1", server.port, timeout=10) as waiter:
        start = time.monotonic()
        with pytest.raises(Exception, match="timed out"):
            waiter.wait(["never"], HANDSHAKE_S * 3)
        assert time.monotonic() - start >= HANDSHAKE_S * 3 * 0.9
        waiter.set("still", b"served")


@pytest.mark.timeout(30)
def test_frames_are_capped_before_their_payload_is_buffered(server):
    header = _wire.HEADER.pack(_wire.MAGIC, _wire.VERSION, Command.SET,
                               _wire.MAX_PAYLOAD_BYTES + 1)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(header)
        assert _closed_after(sock) < 2.0  # refused at the header, not after a GiB
