"""Large messages that arrive before their receive are held unread (tcp engine).

The receiver reads only the header and leaves the body in the socket until a receive is posted, so
a rank running ahead cannot make a slower one buffer whole messages; a receive for another tag or
from any source turns the held message into an ordinary unexpected one, so nothing is stuck
behind it. Two backends of one process talk over real loopback sockets.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from tcp_helpers import WAIT, settle, unexpected_bytes, wait_until

from colls.errors import BackendError
from colls.fingerprint import collective_tag
from colls_plugins.tcp._holds import HOLD_MIN_BYTES

#: Much more than the kernel's socket buffers hold, so an unread body stalls the sender.
BIG_BYTES = 64 << 20
COLLECTIVE = collective_tag(3, 0x1234)  # the tag of some collective (negative)


@pytest.mark.timeout(60)
def test_a_large_collective_message_waits_in_the_socket_for_its_receive(group):
    a, b = group(2)
    big = np.arange(BIG_BYTES // 8, dtype=np.int64)
    sent = a.isend(big, 1, COLLECTIVE)
    settle()
    assert unexpected_bytes(b) == 0  # not buffered on the receiver ...
    assert not sent.is_completed()  # ... so the sender's kernel buffer is full and it waits
    out = np.zeros_like(big)
    assert b.irecv(out, 0, COLLECTIVE).wait(WAIT)
    assert sent.wait(WAIT)
    np.testing.assert_array_equal(out, big)


@pytest.mark.timeout(60)
def test_small_messages_are_buffered_and_large_user_tagged_ones_held(group):
    a, b = group(2)
    user = np.full(HOLD_MIN_BYTES - 1, 5, np.uint8)
    small = np.full(HOLD_MIN_BYTES - 1, 7, np.uint8)
    assert a.isend(user, 1, 5).wait(WAIT)  # completes although no receive is posted
    assert a.isend(small, 1, COLLECTIVE).wait(WAIT)
    assert wait_until(lambda: unexpected_bytes(b) == user.nbytes + small.nbytes)
    big = np.arange(BIG_BYTES // 8, dtype=np.int64)
    sent = a.isend(big, 1, 6)  # a user tag, held like a collective message
    settle()
    assert unexpected_bytes(b) == user.nbytes + small.nbytes
    assert not sent.is_completed()
    got_small, got_user, got_big = np.zeros_like(small), np.zeros_like(user), np.zeros_like(big)
    assert b.irecv(got_small, 0, COLLECTIVE).wait(WAIT) and b.irecv(got_user, 0, 5).wait(WAIT)
    assert b.irecv(got_big, 0, 6).wait(WAIT) and sent.wait(WAIT)
    assert (got_small == 7).all() and (got_user == 5).all()
    np.testing.assert_array_equal(got_big, big)


@pytest.mark.timeout(60)
def test_a_receive_for_a_later_message_releases_the_held_one(group):
    a, b = group(2)
    big = np.full(BIG_BYTES, 3, np.uint8)
    first = a.isend(big, 1, COLLECTIVE)
    a.isend(np.arange(4, dtype=np.int32), 1, 9)  # behind the held body on the stream
    settle()
    later = np.zeros(4, np.int32)
    assert b.irecv(later, 0, 9).wait(WAIT)  # would hang if the stream stayed held
    assert later.tolist() == [0, 1, 2, 3]
    assert first.wait(WAIT)
    out = np.zeros_like(big)
    assert b.irecv(out, 0, COLLECTIVE).wait(WAIT)  # from the unexpected buffer now
    assert (out == 3).all()


@pytest.mark.timeout(60)
def test_an_any_source_receive_releases_held_messages(group):
    a, b, c = group(3)
    big = np.full(BIG_BYTES, 5, np.uint8)
    a.isend(big, 2, COLLECTIVE)
    a.isend(np.array([42], np.int64), 2, 11)
    settle()
    got = np.zeros(1, np.int64)
    work = c.irecv(got, None, 11)
    assert work.wait(WAIT) and work.result() == 0 and got[0] == 42
    out = np.zeros_like(big)
    work = c.irecv(out, None, COLLECTIVE)
    assert work.wait(WAIT) and work.result() == 0
    assert (out == 5).all()


@pytest.mark.timeout(60)
def test_an_any_source_receive_takes_a_held_message_with_its_tag(group):
    a, b = group(2)
    big = np.full(BIG_BYTES, 6, np.uint8)
    sent = a.isend(big, 1, COLLECTIVE)
    settle()
    out = np.zeros_like(big)
    work = b.irecv(out, None, COLLECTIVE)
    assert work.wait(WAIT) and work.result() == 0
    assert sent.wait(WAIT) and (out == 6).all()


@pytest.mark.timeout(60)
def test_a_held_message_of_the_wrong_size_fails_its_receive_and_keeps_the_stream(group):
    a, b = group(2)
    a.isend(np.ones(HOLD_MIN_BYTES * 2, np.uint8), 1, COLLECTIVE)
    settle()
    with pytest.raises(BackendError, match="has 131072 bytes but the receive buffer has 65536"):
        b.irecv(np.zeros(HOLD_MIN_BYTES, np.uint8), 0, COLLECTIVE).wait(WAIT)
    a.isend(np.arange(3, dtype=np.int16), 1, 4)
    out = np.zeros(3, np.int16)
    assert b.irecv(out, 0, 4).wait(WAIT) and out.tolist() == [0, 1, 2]


@pytest.mark.timeout(60)
def test_messages_stream_in_order_through_repeated_holds(group):
    a, b = group(2)
    count, size = 12, HOLD_MIN_BYTES * 3
    sends = [a.isend(np.full(size, i, np.uint8), 1, COLLECTIVE) for i in range(count)]
    for i in range(count):
        if i % 3 == 0:
            settle()  # let the next message be held before its receive comes
        out = np.zeros(size, np.uint8)
        assert b.irecv(out, 0, COLLECTIVE).wait(WAIT)
        assert (out == i).all(), f"message {i} out of order"
    for work in sends:
        assert work.wait(WAIT)
    assert unexpected_bytes(b) == 0


@pytest.mark.timeout(60)
def test_a_message_held_longer_than_the_keepalive_bound_still_arrives(group, monkeypatch):
    """A held body leaves the sender at a zero window; keepalive must not take that for a loss."""
    for name in ("COLLS_KEEPALIVE_IDLE", "COLLS_KEEPALIVE_INTERVAL", "COLLS_KEEPALIVE_COUNT"):
        monkeypatch.setenv(name, "1")  # connections of silent peers drop after 2 s
    a, b = group(2)
    big = np.arange(BIG_BYTES // 8, dtype=np.int64)
    sent = a.isend(big, 1, COLLECTIVE)
    time.sleep(5.0)  # the receiver is busy elsewhere, far past the bound
    assert not sent.is_completed()
    out = np.zeros_like(big)
    assert b.irecv(out, 0, COLLECTIVE).wait(WAIT) and sent.wait(WAIT)
    np.testing.assert_array_equal(out, big)
