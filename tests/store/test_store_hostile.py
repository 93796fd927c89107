"""The store server under a hostile client: bounded memory, no busy loop, honest clients served.

Each test starts a real StoreServer in a child process (``hostile_server.py``, on 127.0.0.1 and
an OS-chosen port) so that the resident memory and CPU time measured are the server's own, drives
one attack at it from raw sockets, and checks that an honest TCPStore client on another
connection still completes a set/get round trip meanwhile. The bounds are generous (a loaded
2-core machine) but far below what each attack cost before the server defended against it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from _support import on_threads

from colls.store import TCPStore, _wire
from colls.store._wire import Command, Status
from colls.store.tcp_server import StoreServer

SERVER_SCRIPT = Path(__file__).with_name("hostile_server.py")
#: An honest set/get round trip must complete within this while the attack runs.
HONEST_ROUND_TRIP_S = 10.0
#: How long the server's memory or CPU is watched once an attack is under way.
OBSERVE_S = 3.0
MIB = 1 << 20


class ServerProcess:
    """A StoreServer in a child process, with its port and a psutil handle on it."""

    def __init__(self, args: list[str], log: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k != "COLLS_AUTH_TOKEN"}
        self._log = log.open("wb")
        # stderr to a file: an unread pipe would fill up with log lines and stall the server.
        self.popen = subprocess.Popen(
            [sys.executable, str(SERVER_SCRIPT), *args], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, env=env,
        )
        line = self.popen.stdout.readline()
        assert line.strip().isdigit(), f"server did not start: {line!r}; log: {log.read_text()}"
        self.port = int(line)
        self.process = psutil.Process(self.popen.pid)
        self.log = log

    def rss(self) -> int:
        """Return the server's resident memory in bytes."""
        return int(self.process.memory_info().rss)

    def cpu_seconds(self) -> float:
        """Return the CPU time (user + system) the server has used."""
        times = self.process.cpu_times()
        return float(times.user + times.system)

    def fds(self) -> int:
        """Return how many file descriptors the server holds."""
        return int(self.process.num_fds())

    def stop(self) -> str:
        """Close the server's stdin (it stops), return its final report line."""
        try:
            out, _ = self.popen.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            out, _ = self.popen.communicate()
        self._log.close()
        return out.decode().strip()


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Return a factory of server processes; each is stopped at teardown."""
    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        server = ServerProcess(list(args), tmp_path / f"server{len(started)}.log")
        started.append(server)
        return server

    yield start
    for server in started:
        if server.popen.poll() is None:
            server.stop()


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(_wire.encode_frame(Command.PING, []))
    return sock


def _read_reply(sock: socket.socket) -> tuple[int, list[bytes]]:
    def exact(size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = sock.recv(size - len(data))
            assert chunk, "the server closed the connection before replying"
            data += chunk
        return data

    status, length = _wire.decode_header(exact(_wire.HEADER.size))
    return status, _wire.decode_fields(exact(length))


def _honest_round_trip(port: int, key: str, store: TCPStore | None = None) -> float:
    """Set and get ``key`` (on ``store``, or a new client); return the seconds it took."""
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        if store is None:
            store = stack.enter_context(
                TCPStore("127.0.0.1", port, timeout=HONEST_ROUND_TRIP_S))
        store.set(key, key.encode())
        assert store.get(key) == key.encode()
    elapsed = time.monotonic() - start
    assert elapsed < HONEST_ROUND_TRIP_S, f"honest round trip took {elapsed:.1f} s"
    return elapsed


def _peak_rss(server: ServerProcess, seconds: float = OBSERVE_S) -> int:
    peak = server.rss()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        peak = max(peak, server.rss())
        time.sleep(0.05)
    return peak


@pytest.mark.timeout(120)
def test_replies_a_client_never_reads_do_not_pile_up(start_server):
    """One 8 MiB value fetched by 40 pipelined GETs whose replies are never read."""
    server = start_server()
    before = server.rss()
    attacker = _connect(server.port)
    value = b"v" * (8 * MIB)
    attacker.sendall(_wire.encode_frame(Command.SET, [b"big", value]))
    get = _wire.encode_frame(Command.GET, [_wire.encode_timeout(None), b"big"])
    attacker.sendall(get * 40)  # 1,240 bytes asking for 320 MiB of replies
    _honest_round_trip(server.port, "honest-during-unread-replies")
    grown = _peak_rss(server) - before
    assert grown < 64 * MIB, f"server memory grew by {grown / MIB:.0f} MiB"
    # The server still owes the attacker its replies: they all arrive once it reads.
    attacker.settimeout(30)
    assert _read_reply(attacker) == (Status.OK, [])  # the PING
    assert _read_reply(attacker) == (Status.OK, [])  # the SET
    for _ in range(40):
        assert _read_reply(attacker) == (Status.OK, [value])
    attacker.close()


def _flood(sock: socket.socket, total: int, stall_s: float) -> int:
    """Send up to ``total`` garbage bytes; stop early once the server stops reading them."""
    chunk = b"\x00" * (256 * 1024)
    sock.settimeout(stall_s)
    sent = 0
    with contextlib.suppress(TimeoutError):
        while sent < total:
            sent += sock.send(chunk)
    return sent


@pytest.mark.timeout(120)
def test_input_behind_a_parked_request_is_not_buffered_without_limit(start_server):
    """64 MiB of garbage after a GET on a key that does not exist yet."""
    server = start_server()
    attacker = _connect(server.port)
    assert _read_reply(attacker) == (Status.OK, [])
    attacker.sendall(_wire.encode_frame(Command.GET, [_wire.encode_timeout(None), b"later"]))
    before = server.rss()
    _flood(attacker, 64 * MIB, stall_s=2.0)
    _honest_round_trip(server.port, "honest-during-parked-flood")
    grown = _peak_rss(server) - before
    assert grown < 24 * MIB, f"server memory grew by {grown / MIB:.0f} MiB"
    # The parked GET is still answered; then the garbage behind it is read and refused.
    with TCPStore("127.0.0.1", server.port, timeout=HONEST_ROUND_TRIP_S) as honest:
        honest.set("later", b"here")
    attacker.settimeout(30)
    assert _read_reply(attacker) == (Status.OK, [b"here"])
    with contextlib.suppress(ConnectionResetError):
        while attacker.recv(1 << 20):
            pass  # the rest of the garbage the kernel had accepted; then the close
    attacker.close()


@pytest.mark.timeout(120)
def test_a_frame_left_half_sent_behind_a_parked_request_times_out_once_answered(start_server):
    """The half-open deadline is re-armed when the parked request is answered."""
    handshake_s = 1.0
    server = start_server("--handshake", str(handshake_s))
    attacker = _connect(server.port)
    assert _read_reply(attacker) == (Status.OK, [])
    attacker.sendall(_wire.encode_frame(Command.GET, [_wire.encode_timeout(None), b"slow"]))
    attacker.sendall(_wire.HEADER.pack(_wire.MAGIC, _wire.VERSION, Command.SET, 100) + b"x")
    time.sleep(2 * handshake_s)  # parked: the server is waiting for the key, not for the client
    with TCPStore("127.0.0.1", server.port, timeout=HONEST_ROUND_TRIP_S) as honest:
        honest.set("slow", b"now")
    attacker.settimeout(handshake_s + 15.0)
    assert _read_reply(attacker) == (Status.OK, [b"now"])
    start = time.monotonic()
    try:
        closed = attacker.recv(1) == b""
    except TimeoutError:
        closed = False
    assert closed, (f"a half-sent frame was still held {time.monotonic() - start:.1f} s after "
                    "its parked request was answered")
    attacker.close()


@pytest.mark.timeout(120)
def test_running_out_of_file_descriptors_does_not_spin_the_loop(start_server):
    """More connections than the server has descriptors for: it idles, and serves its clients."""
    server = start_server("--fd-headroom", "24", "--handshake", "60")
    with TCPStore("127.0.0.1", server.port, timeout=HONEST_ROUND_TRIP_S) as early:
        attackers = [socket.create_connection(("127.0.0.1", server.port), timeout=10)
                     for _ in range(80)]
        try:
            time.sleep(0.5)  # the server has taken what it can and hit EMFILE
            cpu_before, wall_before = server.cpu_seconds(), time.monotonic()
            _honest_round_trip(server.port, "honest-during-emfile", store=early)
            time.sleep(OBSERVE_S)
            cpu = (server.cpu_seconds() - cpu_before) / (time.monotonic() - wall_before)
            assert cpu < 0.5, f"the server used {cpu:.0%} of a core while out of descriptors"
        finally:
            for sock in attackers:
                sock.close()
    # Once descriptors are free again, new clients are accepted.
    _honest_round_trip(server.port, "honest-after-emfile")
    assert "accept" in server.log.read_text()  # the server said why it stopped accepting


@pytest.mark.timeout(120)
def test_connections_that_never_authenticate_are_capped(start_server):
    """Idle connections beyond the cap evict the oldest; honest clients still get in."""
    cap = 8
    server = start_server("--max-unestablished", str(cap), "--handshake", "60")
    fds_before = server.fds()
    attackers = [socket.create_connection(("127.0.0.1", server.port), timeout=10)
                 for _ in range(40)]
    try:
        _honest_round_trip(server.port, "honest-during-idle-flood")
        time.sleep(0.5)
        held = server.fds() - fds_before
        assert held <= cap + 2, f"the server holds {held} more descriptors (cap {cap})"
    finally:
        for sock in attackers:
            sock.close()
    assert "waiting to authenticate" in server.log.read_text()


@pytest.mark.timeout(120)
def test_honest_clients_evicted_while_authenticating_try_again(caplog, monkeypatch):
    """A cap of 1: concurrent honest clients evict each other mid-handshake, and all get in."""
    monkeypatch.delenv("COLLS_AUTH_TOKEN", raising=False)
    caplog.set_level(logging.WARNING, logger="colls.store")
    token = "hostile-suite-token-0123456789"
    server = StoreServer("127.0.0.1", 0, auth_token=token.encode(), max_unestablished=1)
    server.start()
    try:
        def join(i: int) -> bytes:
            with TCPStore("127.0.0.1", server.port, timeout=30, auth_token=token) as client:
                client.set(f"client{i}", str(i).encode())
                return client.get(f"client{i}")

        results = on_threads(join, 16, timeout=60)
    finally:
        server.stop()
    assert results == [str(i).encode() for i in range(16)]
    assert "waiting to authenticate" in caplog.text  # the cap was met: clients were evicted
