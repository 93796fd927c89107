"""Failure behaviour of the tcp backend: dead peers, close(), idleness of the progress thread."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from colls.errors import BackendError, NetworkError

WAIT = 20.0


def _drop_connection(backend, peer):
    """Cut ``backend``'s connection to ``peer`` abruptly, as a crashed process would."""
    backend._engine._peers[peer].sock.shutdown(socket.SHUT_RDWR)


@pytest.mark.timeout(60)
def test_peer_lost_mid_receive_fails_with_network_error_naming_it(group):
    a, b, c = group(3)
    big = np.zeros(32 << 20, np.uint8)
    out_specific = np.zeros_like(big)
    out_any = np.zeros(4, np.int32)
    recv = b.irecv(out_specific, 0, 1)
    recv_any = b.irecv(out_any, None, 2)
    with a._engine._lock:  # rank 0's progress thread stalls at the first header it reads
        send = b.isend(np.zeros(32 << 20, np.uint8), 0, 3)  # stays queued on rank 1
        a.isend(big[: 1 << 20], 1, 99)  # some bytes in flight
        time.sleep(0.2)
        assert not send.is_completed()
        start = time.monotonic()
        _drop_connection(a, 1)
    for work in (recv, recv_any, send):
        with pytest.raises(NetworkError) as info:
            work.wait(WAIT)
        assert "tcp: connection to rank 0 (127.0.0.1:" in str(info.value)
        assert "lost" in str(info.value)
    assert time.monotonic() - start < 5.0
    # later operations with the dead peer fail at once; the others still work
    late = b.irecv(np.zeros(1), 0, 5)
    assert late.is_completed() and isinstance(late.exception(), NetworkError)
    late_send = b.isend(np.zeros(1), 0, 5)
    assert late_send.is_completed() and isinstance(late_send.exception(), NetworkError)
    late_any = b.irecv(np.zeros(1), None, 5)  # the group is broken: rank 0 may have sent it
    assert late_any.is_completed() and isinstance(late_any.exception(), NetworkError)
    out = np.zeros(2)
    work = b.irecv(out, 2, 8)
    c.isend(np.ones(2), 1, 8)
    assert work.result() == 2 and out.tolist() == [1.0, 1.0]


@pytest.mark.timeout(60)
def test_eof_message_says_the_peer_closed_the_connection(group):
    a, b = group(2)
    work = b.irecv(np.zeros(1), 0, 0)
    _drop_connection(a, 1)
    with pytest.raises(NetworkError, match=r"rank 0 \(127\.0\.0\.1:\d+\) lost: peer closed the "
                                            r"connection"):
        work.wait(WAIT)


@pytest.mark.timeout(60)
def test_orderly_close_fails_receives_from_that_peer_only(group):
    a, b, c = group(3)
    from_a = b.irecv(np.zeros(1), 0, 0)
    any_source = np.zeros(1)
    from_any = b.irecv(any_source, None, 1)
    a.close()
    with pytest.raises(NetworkError, match="rank 0 .* lost: peer closed its backend"):
        from_a.wait(WAIT)
    time.sleep(0.2)
    assert not from_any.is_completed()  # rank 2 may still send it
    c.isend(np.array([7.0]), 1, 1)
    assert from_any.result() == 2 and any_source[0] == 7.0


@pytest.mark.timeout(60)
def test_messages_that_arrived_before_the_peer_left_are_still_received(group):
    a, b = group(2)
    a.isend(np.arange(1000, dtype=np.int64), 1, 4).wait(WAIT)
    a.close()
    time.sleep(0.3)  # the goodbye has arrived: rank 0 is gone
    out = np.zeros(1000, np.int64)
    assert b.irecv(out, 0, 4).result() == 0
    assert (out == np.arange(1000)).all()
    with pytest.raises(NetworkError):
        b.irecv(np.zeros(1), 0, 4).wait(WAIT)


@pytest.mark.timeout(60)
def test_close_is_idempotent_fails_pending_work_and_stops_the_thread(group):
    a, b = group(2)
    thread = a._engine._thread
    pending_recv = a.irecv(np.zeros(4), 1, 0)
    pending_send = a.isend(np.zeros(64 << 20, np.uint8), 1, 0)  # larger than the kernel takes
    a.close()
    a.close()
    assert not thread.is_alive()
    for work in (pending_recv, pending_send):
        with pytest.raises(BackendError, match="tcp backend closed"):
            work.wait(1.0)
    after = a.isend(np.zeros(1), 1, 0)
    assert after.is_completed()
    with pytest.raises(BackendError, match="tcp backend closed"):
        after.wait()
    with pytest.raises(BackendError, match="tcp backend closed"):
        a.irecv(np.zeros(1), None, 0).wait()


#: CPU seconds per second the three engines may use while a receive waits. On sockets alone they
#: sleep in select (two wake-ups a second each). With shared memory, a posted receive that a ring
#: may complete makes the progress thread look at the rings every TICK_SECONDS (1 ms; a ring
#: entry wakes no one): about 45 ms per second here, the price of receiving a small message from
#: a host peer without a system call.
IDLE_CPU_BOUND = {"0": 0.02, "1": 0.15}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shm", ["0", "1"])
def test_idle_engine_uses_no_cpu(group, monkeypatch, shm):
    monkeypatch.setenv("COLLS_SHM", shm)
    backends = group(3)
    backends[0].isend(np.zeros(10), 1, 0)
    backends[1].irecv(np.zeros(10), 0, 0).wait(WAIT)
    pending = backends[2].irecv(np.zeros(1), None, 0)  # a receive waits the whole time
    time.sleep(0.2)
    engine_threads = [b._engine._thread for b in backends]
    assert all(t.is_alive() for t in engine_threads)
    start = time.process_time()  # CPU of the whole process, all threads
    time.sleep(1.0)
    assert time.process_time() - start < IDLE_CPU_BOUND[shm]
    assert not pending.is_completed()


@pytest.mark.timeout(60)
def test_progress_thread_failure_fails_pending_work(group, monkeypatch):
    monkeypatch.setenv("COLLS_SHM", "0")  # the message must reach the thread's socket reads
    a, b = group(2)
    pending = b.irecv(np.zeros(4), 0, 0)

    def explode(self, peer, tag, nbytes):
        raise RuntimeError("boom")

    monkeypatch.setattr(type(b._engine), "_start_body", explode)
    a.isend(np.zeros(4), 1, 0)
    with pytest.raises(BackendError, match="progress thread of rank 1 failed: RuntimeError"):
        pending.wait(WAIT)
    b._engine._thread.join(WAIT)
    assert not b._engine._thread.is_alive()
    with pytest.raises(BackendError, match="progress thread"):
        b.irecv(np.zeros(1), 0, 1).wait()


@pytest.mark.timeout(60)
def test_completion_callbacks_may_post_more_work(group):
    a, b = group(2)
    done = threading.Event()
    second = np.zeros(1)

    def chain(_work):
        b.irecv(second, 0, 2).add_done_callback(lambda _w: done.set())

    b.irecv(np.zeros(1), 0, 1).add_done_callback(chain)
    a.isend(np.ones(1), 1, 1)
    a.isend(np.full(1, 5.0), 1, 2)
    assert done.wait(WAIT) and second[0] == 5.0
