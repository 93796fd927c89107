"""The threaded test transport itself: matching, strictness, failure and hang reporting."""

from __future__ import annotations

import time

import numpy as np
import pytest
from threaded_world import ThreadedWorld, run_ranks

from colls.errors import BackendError

pytestmark = pytest.mark.timeout(60)


def test_fifo_per_pair_and_tag_and_any_source():
    def fn(comm):
        if comm.rank == 0:
            works = [comm.isend(np.full(2, value), 2, -1) for value in (1, 2)]
            works.append(comm.isend(np.full(2, 9), 2, -2))
            for work in works:
                work.wait(5)
        elif comm.rank == 1:
            comm.isend(np.full(2, 5), 2, -1).wait(5)
        else:
            by_tag = np.empty(2, dtype=np.int64)
            comm.irecv(by_tag, 0, -2).wait(5)  # tag -2 overtakes the tag -1 messages
            first, second = np.empty(2, dtype=np.int64), np.empty(2, dtype=np.int64)
            w1, w2 = comm.irecv(first, 0, -1), comm.irecv(second, 0, -1)
            anyone = np.empty(2, dtype=np.int64)
            source = comm.irecv(anyone, None, -1).source_rank()
            w1.wait(5)
            w2.wait(5)
            return by_tag[0], first[0], second[0], anyone[0], source

    assert run_ranks(3, fn)[2] == (9, 1, 2, 5, 1)


def test_size_mismatch_fails_both_sides():
    def fn(comm):
        if comm.rank == 0:
            comm.isend(np.zeros(3), 1, -1).wait(5)
        else:
            comm.irecv(np.zeros(4), 0, -1).wait(5)

    with pytest.raises(BackendError, match="sent 24 bytes of float64, receive buffer holds 32"):
        run_ranks(2, fn)


def test_send_completes_only_when_received():
    world = ThreadedWorld(2)
    work = world.comms[0].isend(np.ones(2), 1, -1)
    time.sleep(0.05)
    assert not work.is_completed()
    target = np.zeros(2)
    assert world.comms[1].irecv(target, 0, -1).result() == 0
    work.wait(5)
    assert target.tolist() == [1.0, 1.0]
    world.close()


def test_hang_is_reported():
    def fn(comm):
        if comm.rank == 0:
            comm.irecv(np.zeros(1), 1, -1).wait(30)

    with pytest.raises(pytest.fail.Exception, match=r"ranks \[0\] of 2 still running"):
        run_ranks(2, fn, timeout=0.3)


def test_unmatched_message_is_reported():
    with pytest.raises(pytest.fail.Exception, match="1 messages left unmatched"):
        run_ranks(2, lambda comm: comm.isend(np.ones(1), 1, -1) if comm.rank == 0 else None)


def test_send_buffer_changed_before_completion_is_caught():
    def fn(comm):
        if comm.rank == 0:
            data = np.ones(3)
            work = comm.isend(data, 1, -1)
            data[1] = 7.0  # too early: the send has not completed
            work.wait(5)
        else:
            time.sleep(0.05)
            comm.irecv(np.zeros(3), 0, -1).wait(5)

    with pytest.raises(BackendError, match="send buffer changed before the send completed"):
        run_ranks(2, fn)


def test_posted_receive_buffer_is_poisoned_until_delivery():
    world = ThreadedWorld(2)
    target = np.zeros(2, dtype=np.uint8)
    work = world.comms[1].irecv(target, 0, -1)
    assert target.tolist() == [0xA5, 0xA5]
    world.comms[0].isend(np.array([1, 2], dtype=np.uint8), 1, -1).wait(5)
    work.wait(5)
    assert target.tolist() == [1, 2]
    world.close()
