"""Fuzz the TCPStore server and a tcp peer listener with generated malformed bytes (hypothesis).

A second store test speaks the protocol itself: well-formed frames of every command, with fields
that fit or nearly fit, pipelined on one or two connections at once, so that requests park on
keys another connection sets (or never sets), time out, or are cut off by a hang-up.

Each example opens a connection, sends garbage, truncated frames, huge length prefixes, wrong
magic or versions, or a valid prefix that stops, then goes away. Afterwards the server (and the
listener's mesh setup) must still serve well-formed clients, must not have crashed, must have
dropped every fuzzing connection and forgotten its state, and the process's resident memory
must not have grown beyond a bound (RSS, not tracemalloc: tracing makes hypothesis itself
several times slower; the per-connection state checks catch leaks precisely).
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import struct
import threading
import time

import numpy as np
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sec_helpers import backend

from colls.store import HashStore, TCPStore, _wire
from colls.store._wire import Command
from colls_plugins.tcp import _frames
from colls_plugins.tcp.connections import ADDRESS_KEY

#: Examples per test, under a fixed seed in CI. ``COLLS_FUZZ_EXAMPLES=N`` makes a longer run with
#: random seeds, made by hand (docs/reliability.md reports one).
EXAMPLES = int(os.environ.get("COLLS_FUZZ_EXAMPLES", "120"))
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                         derandomize="COLLS_FUZZ_EXAMPLES" not in os.environ,
                         suppress_health_check=[HealthCheck.too_slow,
                                                HealthCheck.function_scoped_fixture])
#: Resident memory the process may gain over all examples (hypothesis' own caches included;
#: one leaked frame buffer per example would exceed it only for large frames, hence also the
#: structural checks).
MEMORY_BOUND_BYTES = 16 << 20

_u8 = st.integers(0, 255)
_u64 = st.integers(0, (1 << 64) - 1)

store_garbage = st.one_of(
    st.binary(max_size=512),
    # a header with any command / length / version, then some payload
    st.builds(lambda cmd, ver, length, tail: _wire.HEADER.pack(_wire.MAGIC, ver, cmd, length)
              + tail, _u8, _u8, _u64, st.binary(max_size=64)),
    # a well-formed frame cut short, or followed by garbage
    st.builds(lambda cmd, fields, cut: _wire.encode_frame(cmd, fields)[:cut],
              _u8, st.lists(st.binary(max_size=32), max_size=4), st.integers(0, 200)),
    # valid framing, lying field lengths inside
    st.builds(lambda cmd, body: _wire.HEADER.pack(_wire.MAGIC, _wire.VERSION, cmd, len(body))
              + body, st.integers(1, 12), st.binary(max_size=128)),
    st.builds(lambda magic: magic + b"\x01\x01" + b"\xff" * 8, st.binary(min_size=2, max_size=2)),
)

listener_garbage = st.one_of(
    st.binary(max_size=256),
    st.builds(lambda ver, rank, size, glen, alen, tail:
              struct.pack("<4sHiiHH", _frames.MAGIC, ver, rank, size, glen, alen) + tail,
              st.integers(0, 65535), st.integers(-(1 << 31), (1 << 31) - 1),
              st.integers(-(1 << 31), (1 << 31) - 1), st.integers(0, 65535),
              st.integers(0, 65535), st.binary(max_size=64)),
    st.builds(lambda tail: b"CLTA" + tail, st.binary(max_size=80)),
)

# Well-formed frames: per command, fields that fit it (or miss by one field or one byte).
_key = st.sampled_from([b"a", b"b", b"c", b"counter", b""])
_value = st.one_of(st.binary(max_size=32), st.sampled_from([b"7", b"-3", b"x"]))
_timeout = st.sampled_from([-1, 0, 1, 30, 200]).map(_wire.encode_int)
_amount = st.one_of(st.integers(-(1 << 63), (1 << 63) - 1).map(_wire.encode_int),
                    st.binary(max_size=9))
_keys = st.lists(_key, max_size=3)
_fields_of = {
    Command.SET: st.tuples(_key, _value),
    Command.GET: st.tuples(_timeout, _key),
    Command.ADD: st.tuples(_key, _amount),
    Command.COMPARE_SET: st.tuples(_key, _value, _value),
    Command.WAIT: st.builds(lambda t, keys: [t, *keys], _timeout, _keys),
    Command.CHECK: _keys,
    Command.DELETE_KEY: st.tuples(_key),
    Command.NUM_KEYS: st.just(()),
    Command.MULTI_GET: st.builds(lambda t, keys: [t, *keys], _timeout, _keys),
    Command.MULTI_SET: st.lists(st.tuples(_key, _value), max_size=3).map(
        lambda pairs: [f for pair in pairs for f in pair]),
    Command.PING: st.just(()),
}
_well_formed = st.sampled_from(sorted(_fields_of)).flatmap(
    lambda cmd: _fields_of[cmd].map(lambda fields: _wire.encode_frame(cmd, list(fields))))
_near_miss = st.builds(lambda cmd, fields: _wire.encode_frame(cmd, fields),
                       st.sampled_from(sorted(Command)),  # AUTH too: this server has no token
                       st.lists(st.one_of(_key, _value, _timeout), max_size=4))
#: One or two connections, each a pipelined list of frames.
store_sessions = st.lists(st.lists(st.one_of(_well_formed, _well_formed, _well_formed,
                                             _near_miss),
                                   min_size=1, max_size=8), min_size=1, max_size=2)


def _converse(address: tuple[str, int], sessions: list[list[bytes]]) -> None:
    """Send each session's frames on its own connection, hang up, read until the server does."""
    socks = [socket.create_connection(address, timeout=5) for _ in sessions]
    try:
        for sock, frames in zip(socks, sessions, strict=True):
            try:
                sock.sendall(b"".join(frames))
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # dropped already for a bad frame
        for sock in socks:
            try:
                while sock.recv(65536):
                    pass
            except OSError:
                pass  # reset by the server: also an answer
    finally:
        for sock in socks:
            sock.close()


def _throw(address: tuple[str, int], data: bytes) -> None:
    with socket.create_connection(address, timeout=5) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may have dropped us already: that is the point


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _connections(server) -> int:
    return server.open_connections


def _settle(count, target: int, limit: float = 10.0) -> int:
    deadline = time.monotonic() + limit
    while count() > target and time.monotonic() < deadline:
        time.sleep(0.05)
    return count()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("token", [None, "fuzz-token-of-24-bytes!"])
def test_store_server_survives_malformed_bytes(token, monkeypatch):
    monkeypatch.delenv("COLLS_AUTH_TOKEN", raising=False)
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=10, auth_token=token)
    server = master.server
    assert server is not None
    address = ("127.0.0.1", master.port)
    try:
        master.set("canary", b"alive")
        baseline = _connections(server)
        gc.collect()
        before = _rss()

        @FUZZ_SETTINGS
        @given(data=store_garbage)
        def fuzz(data: bytes) -> None:
            _throw(address, data)

        fuzz()
        with TCPStore("127.0.0.1", master.port, timeout=10, auth_token=token) as client:
            client.set("after", b"fuzz")
            assert client.get("canary") == b"alive"
            assert client.add("counter", 3) == 3
        assert _settle(lambda: _connections(server), baseline) == baseline
        assert not server._waiting
        stale = [conn for _, _, conn in server._half_open]
        assert all(conn.closed and not conn.reader.has_partial() for conn in stale)
        gc.collect()
        grown = _rss() - before
        assert grown < MEMORY_BOUND_BYTES, f"process memory grew by {grown} bytes"
        assert server._thread is not None and server._thread.is_alive()
    finally:
        master.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("token", [None, "fuzz-token-of-24-bytes!"])
def test_peer_listener_survives_malformed_bytes(token, monkeypatch):
    monkeypatch.setenv("COLLS_SHM", "0")
    monkeypatch.delenv("COLLS_AUTH_TOKEN", raising=False)
    store = HashStore()
    me = psutil.Process()
    fds_before = me.num_fds()
    made: list = []
    rank0 = threading.Thread(target=lambda: made.append(backend(store, 0, 2, timeout=120,
                                                                token=token)), daemon=True)
    rank0.start()
    host, port = store.get("sec/" + ADDRESS_KEY.format(rank=0)).decode().rsplit(":", 1)
    address = (host, int(port))
    gc.collect()
    before = _rss()
    try:
        @FUZZ_SETTINGS
        @given(data=listener_garbage)
        def fuzz(data: bytes) -> None:
            _throw(address, data)

        fuzz()
        gc.collect()
        grown = _rss() - before
        assert grown < MEMORY_BOUND_BYTES, f"process memory grew by {grown} bytes"
        assert rank0.is_alive(), "rank 0's setup must still be waiting for its real peer"
        rank1 = backend(store, 1, 2, timeout=30, token=token)
        rank0.join(30)
        made.append(rank1)
        out = np.zeros(4)
        recv = rank1.irecv(out, 0, 1)
        made[0].isend(np.arange(4.0), 1, 1).wait(10)
        assert recv.result() == 0 and out.tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        for b in made:
            b.close()
    assert _settle(me.num_fds, fds_before + 2) <= fds_before + 2  # every fuzz socket closed


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_store_protocol_frames_leave_nothing_behind(monkeypatch, caplog):
    """Well-formed and nearly well-formed requests; afterwards no descriptor, thread or waiter.

    Nor any server error: a request the server cannot serve gets an ERROR reply or, if
    malformed, a closed connection, never an internal error.
    """
    monkeypatch.delenv("COLLS_AUTH_TOKEN", raising=False)
    caplog.set_level(logging.ERROR, logger="colls.store")
    me = psutil.Process()
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
    server = master.server
    assert server is not None
    address = ("127.0.0.1", master.port)
    try:
        master.set("canary", b"alive")
        baseline = server.open_connections
        fds_before, threads_before = me.num_fds(), threading.active_count()

        @settings(FUZZ_SETTINGS, max_examples=3 * EXAMPLES)
        @given(sessions=store_sessions)
        def fuzz(sessions: list[list[bytes]]) -> None:
            _converse(address, sessions)

        fuzz()
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, errors[:3]
        assert _settle(lambda: server.open_connections, baseline) == baseline
        assert not server._waiting and not server._unestablished
        assert _settle(me.num_fds, fds_before) == fds_before
        assert threading.active_count() == threads_before
        with TCPStore("127.0.0.1", master.port, timeout=10) as client:
            assert client.get("canary") == b"alive"
            client.set("after", b"frames")
            assert master.get("after") == b"frames"
        assert server._thread is not None and server._thread.is_alive()
    finally:
        master.close()
