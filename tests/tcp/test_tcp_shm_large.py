"""Large and strided point-to-point messages between ranks of one host.

Messages of up to half the ring go through the ring as one entry; larger ones are read by the
receiver straight from the sender's memory (colls_plugins.tcp.shm.remote) where it can, else
they take the socket; strided arrays are staged by the core. Real processes check the bytes
across every size limit, interleaved sizes and tags, and strided views against NumPy; ranks on
threads check the remote path's rules (acknowledgements, a sender that closes, sizes, the
fallback, where small entries go).
"""

from __future__ import annotations

import numpy as np
import pytest
import shm_large_workers as workers
from tcp_helpers import NEEDS_SHM, WAIT, make_group

from colls.errors import BackendError, NetworkError
from colls.testing.spawn import spawn
from colls_plugins.tcp.backend import TcpBackend
from colls_plugins.tcp.shm import remote as shm_remote
from colls_plugins.tcp.shm import setup as shm_setup
from colls_plugins.tcp.shm.p2p import INLINE_MAX_BYTES, SMALL_BYTES, SMALL_SPAN, entry_bytes
from colls_plugins.tcp.shm.segment import LARGE_RINGS_MAX_RANKS, P2P_RING_BYTES, P2P_RING_BYTES_MANY

pytestmark = NEEDS_SHM

MIB = 1 << 20
REMOTE = pytest.mark.skipif(not shm_remote.available(), reason="no process_vm_readv here")


# -- real processes ------------------------------------------------------------------------------

@pytest.mark.timeout(180)
@pytest.mark.parametrize("native", ["1", "0"])
def test_every_size_around_the_limits_round_trips_byte_exact(native):
    ways = spawn(workers.boundary_ping_pong, 2, args=(workers.BOUNDARY_SIZES, 3), timeout=150,
                 env={"COLLS_NATIVE": native})[0]
    assert ways["ring_bytes"] > 0  # up to half the ring: one entry each
    if shm_remote.available():
        assert ways["remote_messages"] > 0  # beyond: read from the sender's memory


@pytest.mark.timeout(180)
def test_interleaved_sizes_and_tags_keep_each_tags_order_across_every_way():
    sizes = (workers.BOUNDARY_SIZES + [8, 3000, 40_000] * 4) * 2
    ways = spawn(workers.interleaved_stream, 2, args=(sizes, 3), timeout=150)[0]
    assert ways["ring_bytes"] > 0 and ways["socket_messages"] + ways["remote_messages"] > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [SMALL_BYTES + 1, INLINE_MAX_BYTES, INLINE_MAX_BYTES + 1,
                                  3 * MIB])
def test_both_ranks_sending_first_completes(size):
    assert spawn(workers.both_send_first, 2, args=(size,), timeout=100) == [True, True]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", [(256, 9), (4096, 7), (600_001, 5)])
def test_strided_views_travel_into_strided_targets_as_numpy_says(shape):
    assert spawn(workers.strided_exchange, 2, args=shape, timeout=100) == [True, True]


# -- ranks on threads ----------------------------------------------------------------------------
@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch, shm_path: bool):
    """Return ``make(n=2)``: ``n`` backends on threads of this process, sharing memory."""
    made: list[TcpBackend] = []

    def make(n: int = 2) -> list[TcpBackend]:
        monkeypatch.setattr(shm_setup, "host_identity", lambda: "host0")
        made.extend(make_group(n, name="large"))
        return made[-n:]

    yield make
    for backend in made:
        backend.close()


def _channel(backend: TcpBackend, peer: int):  # noqa: ANN202 - the engine's Channel
    return backend._engine._channel_for(peer)


def _opened(a: TcpBackend, b: TcpBackend) -> None:
    """Make both channels, so each side has shown it can read the other (shm_remote)."""
    _channel(a, 1)
    _channel(b, 0)


@pytest.mark.timeout(60)
def test_a_message_up_to_half_the_ring_is_one_entry_and_complete_at_once(pair):
    a, b = pair()
    message = np.arange(INLINE_MAX_BYTES, dtype=np.uint8)
    send = a.isend(message, 1, 4)
    assert send.is_completed()  # written: the receiver is not needed
    assert _channel(a, 1).head == entry_bytes(INLINE_MAX_BYTES)
    out = np.zeros_like(message)
    assert b.irecv(out, 0, 4).result() == 0 and (out == message).all()


@REMOTE
@pytest.mark.timeout(60)
def test_a_remote_send_completes_once_read_and_keeps_its_array_until_then(pair):
    a, b = pair()
    _opened(a, b)
    message = (np.arange(INLINE_MAX_BYTES + 100) % 251).astype(np.uint8)
    send = a.isend(message, 1, 4)
    assert _channel(a, 1).remote_sent == 1 and not send.is_completed()
    out = np.zeros_like(message)
    assert b.irecv(out, 0, 4).result() == 0 and (out == message).all()
    assert send.wait(WAIT)
    assert not _channel(a, 1).remote_sends  # nothing kept once read


@REMOTE
@pytest.mark.timeout(60)
def test_a_remote_message_of_the_wrong_size_fails_the_receive_and_the_sender_goes_on(pair):
    a, b = pair()
    _opened(a, b)
    send = a.isend(np.ones(INLINE_MAX_BYTES + 8, np.uint8), 1, 4)
    with pytest.raises(BackendError, match=rf"has {INLINE_MAX_BYTES + 8} bytes but the receive "
                                           rf"buffer has {INLINE_MAX_BYTES} bytes"):
        b.irecv(np.zeros(INLINE_MAX_BYTES, np.uint8), 0, 4).wait(WAIT)
    assert send.wait(WAIT)  # acknowledged all the same: the stream goes on
    out = np.zeros(3, np.int64)
    a.isend(np.array([1, 2, 3]), 1, 4).wait(WAIT)
    assert b.irecv(out, 0, 4).result() == 0 and out.tolist() == [1, 2, 3]


@REMOTE
@pytest.mark.timeout(60)
def test_a_sender_that_closes_before_its_remote_message_is_read_withdraws_it(pair):
    a, b = pair()
    _opened(a, b)
    send = a.isend(np.full(INLINE_MAX_BYTES + 8, 7, np.uint8), 1, 4)
    a.close()
    with pytest.raises(BackendError, match="closed"):
        send.wait(WAIT)
    with pytest.raises(NetworkError, match="rank 0"):
        b.irecv(np.zeros(INLINE_MAX_BYTES + 8, np.uint8), 0, 4).wait(WAIT)


@pytest.mark.timeout(60)
def test_without_remote_reads_large_messages_take_the_socket(pair, monkeypatch):
    monkeypatch.setattr(shm_remote, "can_read", lambda ctrl, magic: False)
    a, b = pair()
    _opened(a, b)
    assert not _channel(a, 1).remote_ready()
    message = np.arange(3 * MIB, dtype=np.uint8)
    out = np.zeros_like(message)
    recv = b.irecv(out, 0, 4)
    a.isend(message, 1, 4).wait(WAIT)
    assert recv.result() == 0 and (out == message).all()
    assert _channel(a, 1).sockets_sent == 1 and _channel(a, 1).remote_sent == 0


@pytest.mark.timeout(60)
def test_small_entries_stay_within_the_first_pages_of_the_ring(pair):
    """Pages of a ring are backed once written: small messages keep to its first SMALL_SPAN
    bytes, and a writer that finds the ring empty starts again at its beginning."""
    a, b = pair()
    out_channel = _channel(a, 1)
    positions = []
    out = np.zeros(SMALL_BYTES, np.uint8)
    for i in range(4 * P2P_RING_BYTES // SMALL_BYTES):
        before = out_channel.head
        a.isend(np.full(SMALL_BYTES, i % 251, np.uint8), 1, 2).wait(WAIT)
        size = entry_bytes(SMALL_BYTES)
        positions.append((out_channel.head - size) % P2P_RING_BYTES)
        assert out_channel.head - before >= size
        if i % 3 == 2:  # now and then the receiver catches up: the ring is empty
            for _ in range(3):
                assert b.irecv(out, 0, 2).result() == 0
    assert max(positions) + entry_bytes(SMALL_BYTES) <= SMALL_SPAN
    assert out_channel.sockets_sent == 0  # and none had to take the socket


@REMOTE
@pytest.mark.timeout(60)
def test_more_remote_sends_than_acknowledgement_words_take_the_socket_in_order(pair):
    a, b = pair()
    _opened(a, b)
    count, size = 3 * shm_remote.ACK_SLOTS, INLINE_MAX_BYTES + 24
    sends = [a.isend(workers._payload(i, size), 1, 2) for i in range(count)]  # b not looking
    channel = _channel(a, 1)
    # the fifth went over the socket; the receiver's engine, matching it, first read the four
    # remote messages before it (order), which freed their words for later ones
    assert channel.remote_sent >= shm_remote.ACK_SLOTS and channel.sockets_sent >= 1
    assert channel.remote_sent + channel.sockets_sent == count
    for i in range(count):
        out = np.empty(size, np.uint8)
        assert b.irecv(out, 0, 2).result() == 0
        assert (out == workers._payload(i, size)).all(), f"message {i} differs"
    assert all(send.wait(WAIT) for send in sends)


@pytest.mark.timeout(120)
def test_a_host_of_many_ranks_keeps_small_rings(pair):
    """Every pair of a large host may talk (an all_to_all) and a ring's pages stay backed once
    written: there rings stay at 64 KiB, and larger messages are read from the sender's memory
    (or take the socket)."""
    backends = pair(LARGE_RINGS_MAX_RANKS + 1)
    a, b = backends[0], backends[1]
    _opened(a, b)
    out_channel = _channel(a, 1)
    assert a._shm.segments[0].ring_bytes == P2P_RING_BYTES_MANY
    assert out_channel.inline_max == P2P_RING_BYTES_MANY // 2
    message = workers._payload(1, 100_000)
    out = np.zeros_like(message)
    recv = b.irecv(out, 0, 3)
    a.send(message, 1, 3)
    assert recv.result() == 0 and (out == message).all()
    if shm_remote.available():  # not in the ring: only a remote entry naming it
        assert out_channel.remote_sent == 1
        assert out_channel.head == entry_bytes(shm_remote.REMOTE.size)
    else:
        assert out_channel.sockets_sent == 1 and out_channel.head == 0
    small = np.arange(P2P_RING_BYTES_MANY // 2, dtype=np.uint8)
    before = out_channel.head
    a.send(small, 1, 4)
    assert out_channel.head - before == entry_bytes(small.nbytes)
    got = np.zeros_like(small)
    assert b.recv(got, 0, 4) == 0 and (got == small).all()


@pytest.mark.timeout(60)
def test_a_small_message_after_an_emptied_ring_leaves_room_for_the_next(pair):
    """A writer within the small span does not start again at the ring's beginning when it
    finds the ring empty: the rest of the ring would count as used until the reader passed the
    wrap, and the next message, sent before that, took the socket (a halo exchange's rows, one
    time in three)."""
    a, b = pair()
    out_channel = _channel(a, 1)
    row = np.arange(256, dtype=np.float64)
    out = np.zeros_like(row)
    for _ in range(50):
        a.send(row, 1, 5)
        assert b.recv(out, 0, 5) == 0  # the ring is empty again
        a.send(row, 1, 5)
        a.send(row, 1, 5)  # before the reader looked
        assert b.recv(out, 0, 5) == 0 and b.recv(out, 0, 5) == 0
    assert out_channel.sockets_sent == 0 and (out == row).all()
