"""What a peer can make a rank hold: headers are capped, unexpected messages are bounded.

A header announcing more than ``COLLS_MAX_MESSAGE_BYTES`` breaks that connection with a
NetworkError naming the peer (a hostile peer writes raw bytes into a real socket); the progress
thread keeps serving the other peers. A flood of sends that no receive matches fills at most
MAX_UNEXPECTED_BYTES on the receiver: then the stream waits in the socket and the sender's sends
stay pending, and every byte arrives intact once the receives are posted.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
from tcp_helpers import WAIT, settle, unexpected_bytes, wait_until

from colls.errors import NetworkError
from colls_plugins.tcp._frames import HEADER
from colls_plugins.tcp._holds import HOLD_MIN_BYTES
from colls_plugins.tcp._matching import MAX_UNEXPECTED_BYTES
from colls_plugins.tcp.connections import Connection
from colls_plugins.tcp.engine import Engine

#: A message size below the hold threshold: such messages are buffered while there is room.
SMALL = HOLD_MIN_BYTES // 2


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.fixture
def raw_peers():
    """An engine of rank 0 whose peers 1 and 2 are raw sockets the test writes into."""
    pairs = {rank: socket.socketpair() for rank in (1, 2)}
    connections = {r: Connection(r, mine, f"socketpair:{r}") for r, (mine, _) in pairs.items()}
    engine = Engine(0, connections, timeout=WAIT, name="limits")
    try:
        yield engine, {r: theirs for r, (_, theirs) in pairs.items()}
    finally:
        engine.close()
        for _, theirs in pairs.values():
            theirs.close()


@pytest.mark.timeout(60)
def test_a_header_above_the_limit_breaks_that_connection_only(raw_peers):
    engine, peers = raw_peers
    peers[1].sendall(HEADER.pack(5, 1 << 62))  # no receive is posted: nothing may be reserved
    assert wait_until(lambda: engine.peer_error(1) is not None)
    with pytest.raises(NetworkError, match=r"rank 1 \(socketpair:1\) lost: it announced a "
                       r"message of 4611686018427387904 bytes \(tag 5\), more than "
                       r"COLLS_MAX_MESSAGE_BYTES="):
        engine.irecv(np.zeros(8, np.uint8), 1, 5).wait(WAIT)
    payload = np.arange(8, dtype=np.uint8)
    peers[2].sendall(HEADER.pack(9, payload.nbytes) + payload.tobytes())
    got = np.zeros_like(payload)
    assert engine.irecv(got, 2, 9).wait(WAIT) and engine.peer_error(2) is None
    np.testing.assert_array_equal(got, payload)


def test_a_send_above_the_limit_is_refused_before_any_byte_moves(group, monkeypatch):
    monkeypatch.setenv("COLLS_MAX_MESSAGE_BYTES", "1024")
    a, b = group(2)
    with pytest.raises(ValueError, match=r"rank 0: send to rank 1: array has 1025 bytes, "
                       r"more than COLLS_MAX_MESSAGE_BYTES=1024"):
        a.isend(np.zeros(1025, np.uint8), 1, 3)
    sent, got = np.full(1024, 4, np.uint8), np.zeros(1024, np.uint8)
    work = b.irecv(got, 0, 3)
    assert a.isend(sent, 1, 3).wait(WAIT) and work.wait(WAIT)
    np.testing.assert_array_equal(got, sent)


@pytest.mark.timeout(120)
def test_a_flood_of_unreceived_sends_is_bounded_and_delivered_intact(group):
    a, b = group(2)
    count = 4 * MAX_UNEXPECTED_BYTES // SMALL  # four times what the receiver may buffer
    data = np.random.default_rng(7).integers(0, 256, (count, SMALL), dtype=np.uint8)
    received = np.zeros_like(data)  # allocated (and touched) before the baseline
    before = _rss_bytes()
    sends = [a.isend(data[i], 1, 5) for i in range(count)]
    assert wait_until(lambda: unexpected_bytes(b) > MAX_UNEXPECTED_BYTES // 2)
    settle()
    # Ring entries that a socket message follows are queued before it whatever the budget
    # (their order), so between ranks of one host one ring's bytes may come on top.
    channel = b._engine._channel_for(0)
    assert unexpected_bytes(b) <= MAX_UNEXPECTED_BYTES + (channel.ring_bytes if channel else 0)
    assert not sends[-1].is_completed()  # the stream waits in the sockets: the sender waits
    assert _rss_bytes() - before < data.nbytes // 2
    recvs = [b.irecv(received[i], 0, 5) for i in range(count)]
    assert all(w.wait(WAIT) for w in recvs) and all(w.wait(WAIT) for w in sends)
    np.testing.assert_array_equal(received, data)


@pytest.mark.timeout(60)
def test_a_posted_receive_is_reached_behind_a_flood_of_other_tags(group):
    a, b = group(2)
    later = np.arange(16, dtype=np.int64)
    got_later = np.zeros_like(later)
    waiting = b.irecv(got_later, 0, 7)  # posted first: its message comes after the flood
    count = 2 * MAX_UNEXPECTED_BYTES // SMALL
    flood = np.random.default_rng(8).integers(0, 256, (count, SMALL), dtype=np.uint8)
    sends = [a.isend(flood[i], 1, 5) for i in range(count)]
    sends.append(a.isend(later, 1, 7))
    assert waiting.wait(WAIT)
    np.testing.assert_array_equal(got_later, later)
    got = np.zeros_like(flood)
    assert all(b.irecv(got[i], 0, 5).wait(WAIT) for i in range(count))
    assert all(w.wait(WAIT) for w in sends)
    np.testing.assert_array_equal(got, flood)
