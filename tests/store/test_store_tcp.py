"""TCPStore specifics: addresses in errors, joining, binding, bad bytes, many clients, shutdown."""

from __future__ import annotations

import logging
import re
import resource
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
from store_testutil import TEST_TIMEOUT_S

from colls.errors import NetworkError, StoreError, StoreTimeoutError
from colls.store import TCPStore, _listener, _wire
from colls.store.tcp_server import StoreServer
from colls.testing.spawn import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def master() -> TCPStore:
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=TEST_TIMEOUT_S)
    yield store
    store.close()


def _client(master: TCPStore, **kwargs: object) -> TCPStore:
    return TCPStore("127.0.0.1", master.port, timeout=TEST_TIMEOUT_S, **kwargs)  # type: ignore[arg-type]


def _server_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("colls-store-server")]


def test_wait_timeout_names_host_port_keys_and_elapsed(master: TCPStore) -> None:
    with _client(master) as client:
        start = time.monotonic()
        with pytest.raises(StoreTimeoutError) as info:
            client.wait(["rank/3"], timeout=0.5)
        assert time.monotonic() - start >= 0.49
    expected = (
        f"TCPStore 127.0.0.1:{master.port}: wait(['rank/3']) timed out after 0.5 s "
        "(timeout 0.5 s)"
    )
    assert str(info.value) == expected


def test_get_timeout_uses_store_timeout(master: TCPStore) -> None:
    with TCPStore("127.0.0.1", master.port, timeout=0.4) as client:
        with pytest.raises(StoreTimeoutError, match=r"127\.0\.0\.1:\d+: get\('k'\) timed out"):
            client.get("k")
        client.set("k", b"v")  # the connection is still usable after a timeout
        assert client.get("k") == b"v"


def test_connect_failure_names_host_port_and_elapsed() -> None:
    port = free_port()
    start = time.monotonic()
    with pytest.raises(NetworkError) as info:
        TCPStore("127.0.0.1", port, timeout=0.5)
    assert time.monotonic() - start >= 0.49
    assert re.search(rf"127\.0\.0\.1:{port}: could not connect after 0\.\d s \(timeout 0\.5 s\)",
                     str(info.value))


def test_client_retries_until_master_starts() -> None:
    port = free_port()
    result: list[bytes] = []

    def client() -> None:
        with TCPStore("127.0.0.1", port, timeout=TEST_TIMEOUT_S) as store:
            result.append(store.get("hello"))

    thread = threading.Thread(target=client)
    thread.start()
    time.sleep(0.4)  # the client is now retrying
    with TCPStore("127.0.0.1", port, is_master=True, timeout=TEST_TIMEOUT_S) as master:
        master.set("hello", b"world")
        thread.join(TEST_TIMEOUT_S)
    assert result == [b"world"]


def test_master_waits_for_workers() -> None:
    port = free_port()
    workers: list[TCPStore] = []

    def join_later() -> None:
        time.sleep(0.3)
        for _ in range(2):
            workers.append(TCPStore("127.0.0.1", port, world_size=3, timeout=TEST_TIMEOUT_S))

    thread = threading.Thread(target=join_later)
    thread.start()
    start = time.monotonic()
    master = TCPStore("127.0.0.1", port, world_size=3, is_master=True, timeout=TEST_TIMEOUT_S)
    assert time.monotonic() - start >= 0.25
    thread.join(TEST_TIMEOUT_S)
    assert len(workers) == 2
    assert master.num_keys() == 0  # the join bookkeeping keys are internal
    for store in [*workers, master]:
        store.close()


def test_master_times_out_when_workers_missing() -> None:
    with pytest.raises(StoreTimeoutError, match=r"only 1 of world_size=2 clients joined after"):
        TCPStore("127.0.0.1", 0, world_size=2, is_master=True, timeout=0.5)
    assert not _server_threads()  # the failed constructor stopped its server


def test_constructor_argument_errors() -> None:
    with pytest.raises(TypeError, match="port must be an int, got str"):
        TCPStore("127.0.0.1", "29500")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="port must be in 0..65535, got 70000"):
        TCPStore("127.0.0.1", 70000)
    with pytest.raises(ValueError, match="world_size must be >= 1 or None, got 0"):
        TCPStore("127.0.0.1", 1, world_size=0)
    with pytest.raises(ValueError, match="port 0"):
        TCPStore("127.0.0.1", 0)


def test_bind_error_names_address(master: TCPStore) -> None:
    with pytest.raises(NetworkError, match=rf"127\.0\.0\.1:{master.port}: cannot listen"):
        TCPStore("127.0.0.1", master.port, is_master=True, timeout=1)


def _other_local_ipv4() -> str | None:
    psutil = pytest.importorskip("psutil")
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family == socket.AF_INET and not addr.address.startswith("127."):
                return str(addr.address)
    return None


def test_binds_only_the_given_host(master: TCPStore) -> None:
    assert master.server is not None
    assert master.server.listener_address() == ("127.0.0.1", master.port)
    other = _other_local_ipv4()
    if other is None:
        pytest.skip("no non-loopback IPv4 address on this machine")
    with pytest.raises(OSError):
        socket.create_connection((other, master.port), timeout=2).close()


def test_large_value_round_trips(master: TCPStore) -> None:
    value = bytes(range(256)) * (32 * 1024)  # 8 MiB
    with _client(master) as client:
        client.set("big", value)
        assert master.get("big") == value


def test_oversized_key_is_rejected_client_side(master: TCPStore) -> None:
    with pytest.raises(ValueError, match="exceeds MAX_KEY_BYTES"):
        master.set("k" * (_wire.MAX_KEY_BYTES + 1), b"v")


def _raw_socket(master: TCPStore) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", master.port), timeout=10)
    return sock


def _assert_closed_by_server(sock: socket.socket) -> None:
    try:
        assert sock.recv(1024) == b""
    except ConnectionResetError:
        pass
    finally:
        sock.close()


BAD_FRAMES = {
    "garbage": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "huge-length": _wire.HEADER.pack(_wire.MAGIC, _wire.VERSION, _wire.Command.SET, 1 << 62),
    "bad-version": _wire.HEADER.pack(_wire.MAGIC, 99, _wire.Command.SET, 0),
    "unknown-command": _wire.encode_frame(200, []),
    "truncated-field": _wire.HEADER.pack(_wire.MAGIC, _wire.VERSION, _wire.Command.SET, 4)
    + struct.pack("!I", 100),
    "bad-int": _wire.encode_frame(_wire.Command.ADD, [b"k", b"123"]),
    "oversized-key": _wire.encode_frame(_wire.Command.SET, [b"k" * (_wire.MAX_KEY_BYTES + 1), b""]),
}


@pytest.mark.parametrize("name", sorted(BAD_FRAMES))
def test_server_drops_bad_client_and_keeps_serving(
    master: TCPStore, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    with _client(master) as good:
        good.set("before", b"1")
        idle = _raw_socket(master)  # a half-sent frame must not block anyone either
        idle.sendall(_wire.HEADER.pack(_wire.MAGIC, _wire.VERSION, _wire.Command.SET, 100))
        with caplog.at_level(logging.WARNING, logger="colls.store"):
            bad = _raw_socket(master)
            bad.sendall(BAD_FRAMES[name])
            _assert_closed_by_server(bad)
        good.set("after", b"2")
        assert good.multi_get(["before", "after"]) == [b"1", b"2"]
        idle.close()
    assert any("closing connection" in r.getMessage() for r in caplog.records)


def test_error_reply_keeps_connection(master: TCPStore) -> None:
    master.set("text", b"abc")
    with pytest.raises(StoreError, match=r"add\('text'\) found a value that is not a decimal"):
        master.add("text", 1)
    assert master.add("n", 1) == 1


@pytest.mark.parametrize("cap", [0, -3, 2.5])
def test_a_bad_cap_on_unauthenticated_connections_is_refused(cap: object) -> None:
    with pytest.raises(ValueError, match=r"StoreServer: max_unestablished must be a positive "
                       rf"int, got {cap!r}"):
        StoreServer("127.0.0.1", 0, max_unestablished=cap)  # type: ignore[arg-type]


def test_add_past_the_int64_range_is_an_error_reply(master: TCPStore) -> None:
    """Found by fuzzing: it used to cost the client its connection (an internal server error)."""
    biggest = (1 << 63) - 1
    assert master.add("big", biggest) == biggest
    with pytest.raises(StoreError, match=r"add\('big', 1\) would make the counter "
                       r"9223372036854775808, outside the signed 64-bit range"):
        master.add("big", 1)
    assert master.get("big") == str(biggest).encode()
    assert master.add("big", -biggest) == 0


def test_a_wait_of_the_longest_timeout_keeps_the_server_serving(master: TCPStore) -> None:
    """Found by fuzzing: a timeout of 2**63 - 1 ms overflowed select() and crashed the loop."""
    parked = _raw_socket(master)
    parked.sendall(_wire.encode_frame(_wire.Command.WAIT, [
        _wire.encode_int((1 << 63) - 1), b"never-set"]))
    time.sleep(0.2)  # the loop computes its next select() timeout from the parked deadline
    with _client(master) as other:
        other.set("after", b"yes")
        assert other.get("after") == b"yes"
    parked.close()


def test_many_clients_and_parked_waiters(master: TCPStore) -> None:
    clients = [_client(master) for _ in range(200)]
    try:
        for client in clients:
            client.add("count", 1)
        assert master.get("count") == b"200"
        results: list[bytes] = []
        lock = threading.Lock()

        def waiter(client: TCPStore) -> None:
            value = client.get("go")
            with lock:
                results.append(value)

        threads = [threading.Thread(target=waiter, args=(c,)) for c in clients[:100]]
        for thread in threads:
            thread.start()
        time.sleep(0.2)
        master.set("go", b"now")
        for thread in threads:
            thread.join(TEST_TIMEOUT_S)
        assert results == [b"now"] * 100
    finally:
        for client in clients:
            client.close()


def test_one_client_is_thread_safe(master: TCPStore) -> None:
    with _client(master) as client:
        def hammer() -> None:
            for _ in range(100):
                client.add("shared", 1)

        threads = [threading.Thread(target=hammer) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TEST_TIMEOUT_S)
        assert client.get("shared") == b"800"


def test_waiter_disconnecting_does_not_hurt_server(master: TCPStore) -> None:
    raw = _raw_socket(master)
    raw.sendall(_wire.encode_frame(_wire.Command.GET, [_wire.encode_timeout(None), b"never"]))
    time.sleep(0.1)
    raw.close()
    master.set("never", b"now set")  # answering a closed, parked waiter must not crash the loop
    assert master.get("never") == b"now set"


def test_close_stops_server_and_clients_get_network_error() -> None:
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=TEST_TIMEOUT_S)
    client = _client(master)
    assert len(_server_threads()) == 1
    master.close()
    assert not _server_threads()
    with pytest.raises(NetworkError, match=rf"127\.0\.0\.1:{master.port}"):
        client.get("anything")
    client.close()
    with pytest.raises(StoreError, match="closed"):
        master.set("k", b"v")


def test_a_client_whose_server_has_gone_fails_at_once_not_at_the_timeout() -> None:
    """Refused after it was reached, the server has exited: a new connection is not retried.

    The first request fails on its pooled connection; the second needs a new one. Retried,
    it would hold the caller for the store timeout (a rank whose store host died, waiting).
    """
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=TEST_TIMEOUT_S)
    client = TCPStore("127.0.0.1", master.port, timeout=60.0)
    master.close()
    for _ in range(2):
        start = time.monotonic()
        with pytest.raises(NetworkError, match=rf"127\.0\.0\.1:{master.port}"):
            client.get("anything")
        assert time.monotonic() - start < 5.0
    with pytest.raises(NetworkError, match="refused a new connection after serving this client"):
        client.set("k", b"v")
    client.close()


def test_ipv6_loopback() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        store = TCPStore("::1", 0, is_master=True, timeout=TEST_TIMEOUT_S)
    except NetworkError:
        pytest.skip("::1 is not available")
    with store:
        assert store.description == f"TCPStore [::1]:{store.port}"
        with TCPStore("::1", store.port, timeout=TEST_TIMEOUT_S) as client:
            client.set("v6", b"ok")
            assert store.get("v6") == b"ok"


_MANY_CLIENTS = """
import resource, sys
from colls.store import TCPStore
master = TCPStore("127.0.0.1", 0, world_size=600, is_master=True, wait_for_workers=False,
                  timeout=30)
clients = [TCPStore("127.0.0.1", master.port, timeout=30) for _ in range(150)]
for i, client in enumerate(clients):
    client.set(f"k{i}", str(i))
assert [master.get(f"k{i}") for i in range(150)] == [str(i).encode() for i in range(150)]
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


@pytest.mark.timeout(120)
def test_a_store_host_raises_its_open_file_limit_to_fit_its_clients() -> None:
    """One connection per rank: a thousand-rank job passes the common soft limit of 1024. Here a
    soft limit of 128 and 150 clients (300 descriptors: they run in the host's process)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 600 + _listener.DESCRIPTOR_HEADROOM
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"the hard limit on open files here is {hard}, under the {needed} tested")

    def low_soft_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))

    done = subprocess.run([sys.executable, "-c", _MANY_CLIENTS], preexec_fn=low_soft_limit,
                          capture_output=True, text=True, timeout=100, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) == needed
