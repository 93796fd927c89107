"""Receives left to their waiters (colls_plugins.tcp._deferred): taken from the ring by the thread
that waits, never posted, and matched as if they had been posted when they were made.

Ranks on threads of one process share one host, so their messages go through the rings; every
test runs on the compiled ring steps and on the Python ones (``shm_path``).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import numpy as np
import pytest
from tcp_helpers import NEEDS_SHM, WAIT

from colls.errors import BackendError, CollsTimeoutError
from colls_plugins.tcp import _deferred
from colls_plugins.tcp.shm import p2p as shm_p2p
from colls_plugins.tcp.shm.p2p import INLINE_MAX_BYTES

pytestmark = [
    NEEDS_SHM,
    pytest.mark.timeout(60),
]



def _posted(backend) -> int:  # noqa: ANN001 - a TcpBackend
    with backend._engine._lock:
        return backend._engine._table.posted_count()


def _deferred_count(backend) -> int:  # noqa: ANN001
    return sum(len(queue) for queue in backend._engine._inbox.deferred.values())


def _ints(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def test_a_receive_made_before_its_message_is_taken_by_its_waiter_unposted(host_pair):
    a, b = host_pair
    out = np.zeros(2, np.int64)
    work = b.irecv(out, 0, 5)
    assert isinstance(work.get_future(), _deferred.DeferredReceive)
    assert _posted(b) == 0 and _deferred_count(b) == 1
    a.isend(_ints(7, 8), 1, 5)
    assert work.wait(WAIT) and work.result() == 0 and out.tolist() == [7, 8]
    assert _posted(b) == 0 and _deferred_count(b) == 0


def test_receives_taken_at_once_each_report_their_own_sender(group, shm_path):
    # Such receives share one completed Work per sender: a Work of another sender's would
    # name the wrong rank.
    receiver, *senders = group(3, name="taken")
    for round_ in range(3):
        for rank, sender in enumerate(senders, start=1):
            sender.isend(_ints(10 * rank + round_), 0, 4)
        for rank in (2, 1):
            out = np.zeros(1, np.int64)
            work = receiver.irecv(out, rank, 4)
            assert not isinstance(work.get_future(), _deferred.DeferredReceive)  # taken at once
            assert work.wait(WAIT) and work.result() == rank and work.is_success()
            assert out[0] == 10 * rank + round_


def test_receives_of_one_source_and_tag_match_in_the_order_made_whichever_is_waited_first(
        host_pair):
    a, b = host_pair
    first, second, third = (np.zeros(1, np.int64) for _ in range(3))
    works = [b.irecv(first, 0, 5), b.irecv(second, 0, 5), b.irecv(third, 0, 5)]
    for value in (1, 2, 3):
        a.isend(_ints(value), 1, 5)
    assert works[1].wait(WAIT)  # the second: the first is posted before it
    assert works[2].wait(WAIT) and works[0].wait(WAIT)
    assert [first[0], second[0], third[0]] == [1, 2, 3]


def test_a_blocking_recv_after_a_deferred_receive_takes_the_next_message(host_pair):
    a, b = host_pair
    early, late = np.zeros(1, np.int64), np.zeros(1, np.int64)
    work = b.irecv(early, 0, 5)
    a.isend(_ints(1), 1, 5)
    a.isend(_ints(2), 1, 5)
    assert b.recv(late, 0, 5) == 0
    assert work.wait(WAIT)
    assert (early[0], late[0]) == (1, 2)


def test_an_any_source_receive_posts_the_deferred_receives_of_its_tag_first(host_pair):
    a, b = host_pair
    specific, any_source, other_tag = (np.zeros(1, np.int64) for _ in range(3))
    first = b.irecv(specific, 0, 5)
    unrelated = b.irecv(other_tag, 0, 6)  # another tag: stays left to its waiter
    second = b.irecv(any_source, None, 5)
    assert _deferred_count(b) == 1 and _posted(b) == 2
    a.isend(_ints(1), 1, 5)
    a.isend(_ints(2), 1, 5)
    a.isend(_ints(3), 1, 6)
    assert second.result() == 0 and first.result() == 0 and unrelated.result() == 0
    assert (specific[0], any_source[0], other_tag[0]) == (1, 2, 3)


def test_a_receive_too_large_for_the_ring_is_posted_after_the_deferred_ones(host_pair):
    a, b = host_pair
    small = np.zeros(4, np.uint8)
    big = np.zeros(INLINE_MAX_BYTES + 8, np.uint8)
    first = b.irecv(small, 0, 5)
    second = b.irecv(big, 0, 5)
    assert _deferred_count(b) == 0 and _posted(b) == 2  # both posted, in their order
    sent_big = np.arange(big.size, dtype=np.int64).astype(np.uint8)
    a.isend(np.full(4, 9, np.uint8), 1, 5)
    send = a.isend(sent_big, 1, 5)
    assert second.wait(WAIT) and first.wait(WAIT) and send.wait(WAIT)
    assert small.tolist() == [9] * 4
    np.testing.assert_array_equal(big, sent_big)


def test_a_done_callback_or_futures_wait_sees_it_complete_without_a_waiter(host_pair):
    a, b = host_pair
    called = threading.Event()
    out, other = np.zeros(1, np.int64), np.zeros(1, np.int64)
    work = b.irecv(out, 0, 5)
    work.add_done_callback(lambda _work: called.set())  # posts it
    assert _deferred_count(b) == 0 and _posted(b) == 1
    watched = b.irecv(other, 0, 6)
    a.isend(_ints(4), 1, 5)
    a.isend(_ints(5), 1, 6)
    assert called.wait(WAIT) and out[0] == 4  # the progress thread completed it
    done, _ = concurrent.futures.wait([watched.get_future()], timeout=WAIT)
    assert done and other[0] == 5


def test_polling_is_completed_takes_the_message(host_pair):
    a, b = host_pair
    out = np.zeros(1, np.int64)
    work = b.irecv(out, 0, 5)
    assert not work.is_completed()
    a.isend(_ints(6), 1, 5)
    deadline = time.monotonic() + WAIT
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert work.is_completed() and out[0] == 6 and _posted(b) == 0


def test_a_wait_that_times_out_leaves_the_receive_posted_for_a_later_wait(host_pair):
    a, b = host_pair
    out = np.zeros(1, np.int64)
    work = b.irecv(out, 0, 5)
    started = time.monotonic()
    with pytest.raises(CollsTimeoutError, match="tcp recv from rank 0 tag 5"):
        work.wait(0.2)
    assert 0.2 <= time.monotonic() - started < 5.0
    assert _deferred_count(b) == 0 and _posted(b) == 1
    a.isend(_ints(3), 1, 5)
    assert work.wait(WAIT) and out[0] == 3


def test_a_deferred_receive_of_a_closed_engine_fails_naming_it(host_pair):
    _a, b = host_pair
    work = b.irecv(np.zeros(1, np.int64), 0, 5)
    b.close()
    with pytest.raises(BackendError, match="tcp backend closed"):
        work.wait(WAIT)
    assert work.is_completed()


def test_is_completed_never_waits_for_the_inbox_lock(host_pair):
    """A flight recorder dump asks is_completed() from a signal handler, whose thread may hold
    the lock: the look gives up instead of deadlocking."""
    a, b = host_pair
    out = np.zeros(1, np.int64)
    work = b.irecv(out, 0, 5)
    a.isend(_ints(2), 1, 5)
    with b._engine._inbox.lock:
        assert not work.is_completed()
    assert work.wait(WAIT) and out[0] == 2


def test_threads_each_receiving_their_own_tag_get_their_streams_in_order(host_pair):
    a, b = host_pair
    threads, count = 4, 200
    got = np.zeros((threads, count), np.int64)

    def receive(tag: int) -> None:
        for i in range(count):
            b.irecv(got[tag, i:i + 1], 0, tag).wait(WAIT)

    receivers = [threading.Thread(target=receive, args=(tag,)) for tag in range(threads)]
    for thread in receivers:
        thread.start()
    for i in range(count):
        for tag in range(threads):
            a.isend(_ints(tag * 1000 + i), 1, tag).wait(WAIT)
    for thread in receivers:
        thread.join(WAIT)
    expected = np.arange(threads)[:, None] * 1000 + np.arange(count)[None, :]
    np.testing.assert_array_equal(got, expected)
    assert _posted(b) == 0 and _deferred_count(b) == 0


def test_a_message_from_a_peer_with_a_deferred_receive_is_never_held_back(host_pair):
    """A large socket message nobody receives is held in the socket (its sender waits), and a
    ring entry waits in the ring when the unexpected budget is spent; neither may happen while
    a receive from that peer is left to its waiter, or two ranks that both wait on their sends
    first would wait for each other."""
    from colls_plugins.tcp._holds import HOLD_MIN_BYTES

    a, b = host_pair
    engine = b._engine
    with engine._inbox.lock:
        assert engine._holds.must_hold(0, HOLD_MIN_BYTES)
    work = b.irecv(np.zeros(4, np.uint8), 0, 5)
    with engine._inbox.lock:
        assert engine._inbox.awaits(0) and not engine._inbox.awaits(1)
        assert not engine._holds.must_hold(0, HOLD_MIN_BYTES)
    a.isend(np.ones(4, np.uint8), 1, 5)
    assert work.wait(WAIT)
    with engine._inbox.lock:
        assert engine._holds.must_hold(0, HOLD_MIN_BYTES)


@pytest.mark.parametrize("overflow", ["remote read", "socket"])
def test_ranks_that_wait_on_their_sends_before_their_receives_do_not_wait_for_each_other(
        host_pair, overflow, monkeypatch):
    """Three messages of 700 KiB each way overflow the 2 MiB rings: the third is read from the
    sender's memory (its send completes once the receiver has read it) or goes over the socket.
    Both ranks wait on their sends first, with their receives left to them; every message
    arrives, in order. (The rule that keeps a held socket message from stalling such a pair is
    checked directly above: the kernel's 4 MiB socket buffers take 700 KiB here anyway.)"""
    from _support import on_threads

    if overflow == "socket":
        monkeypatch.setattr(shm_p2p.Channel, "remote_ready", lambda _channel: False)
    backends = host_pair
    count, nbytes = 3, 700 << 10

    def exchange(rank: int) -> np.ndarray:
        me, peer = backends[rank], 1 - rank
        got = np.zeros((count, nbytes), np.uint8)
        sends = [me.isend(np.full(nbytes, 10 * rank + i, np.uint8), peer, 7)
                 for i in range(count)]
        receives = [me.irecv(got[i], peer, 7) for i in range(count)]
        for work in sends + receives:
            work.wait(WAIT)
        return got

    got = on_threads(exchange, 2, 60.0)
    for rank in (0, 1):
        sender = 1 - rank
        assert [int(row[0]) for row in got[rank]] == [10 * sender + i for i in range(count)]
        assert all((row == row[0]).all() for row in got[rank])


def test_a_receive_made_after_close_fails_naming_it(host_pair):
    _a, b = host_pair
    b.close()
    with pytest.raises(BackendError, match="tcp backend closed"):
        b.irecv(np.zeros(1, np.int64), 0, 5).wait(WAIT)


def test_a_send_to_a_host_peer_never_talked_to_after_close_fails_naming_it(host_pair):
    a, _b = host_pair
    a.close()
    with pytest.raises(BackendError, match="tcp backend closed"):
        a.isend(np.zeros(1, np.int64), 1, 5).wait(WAIT)


def test_a_blocking_recv_that_polled_in_vain_waits_posted(host_pair, monkeypatch):
    """A blocking recv whose message does not come within its polls waits as a posted receive
    (it sleeps; the engine posts it at once rather than have it poll again as a waiter), and
    gets the message when it comes."""
    a, b = host_pair
    polled_again: list[object] = []
    await_message = _deferred.Deferred.await_message
    monkeypatch.setattr(_deferred.Deferred, "await_message",
                        lambda self, receive, timeout: polled_again.append(receive)
                        or await_message(self, receive, timeout))
    out = np.zeros(1, np.int64)
    got: list[int] = []
    receiver = threading.Thread(target=lambda: got.append(b.recv(out, 0, 5)))
    receiver.start()
    deadline = time.monotonic() + WAIT
    while _posted(b) == 0 and time.monotonic() < deadline:
        time.sleep(0.002)
    assert _posted(b) == 1 and _deferred_count(b) == 0
    a.isend(_ints(9), 1, 5)
    receiver.join(WAIT)
    assert got == [0] and out[0] == 9
    assert polled_again == []
