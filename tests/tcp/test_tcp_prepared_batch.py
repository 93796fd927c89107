"""A batch prepared once on tcp (``batch_isend_irecv_init``): the engine's RingBatch.

Ranks on threads of one process share one host, so their messages go through the rings; every
test runs on the compiled ring steps and on the Python ones (``shm_path``).
"""

from __future__ import annotations

import numpy as np
import pytest
from tcp_helpers import NEEDS_SHM, WAIT

from colls.backend import RestartedBatch
from colls_plugins.tcp._ring_batch import RingBatch
from colls_plugins.tcp.shm.p2p import INLINE_MAX_BYTES

pytestmark = [
    NEEDS_SHM,
    pytest.mark.timeout(60),
]



def test_ring_messages_are_prepared_and_move_the_current_values_at_every_start(host_pair):
    a, b = host_pair
    out_a, in_a, out_b, in_b = (np.zeros(3) for _ in range(4))
    batch_a = a.batch_isend_irecv_init([("irecv", in_a, 1, 2), ("isend", out_a, 1, 3)])
    batch_b = b.batch_isend_irecv_init([("isend", out_b, 0, 2), ("irecv", in_b, 0, 3)])
    assert isinstance(batch_a, RingBatch) and isinstance(batch_b, RingBatch)
    for start in range(4):
        out_a[:] = 10 + start
        out_b[:] = 20 + start
        works = batch_a.start() + batch_b.start()
        assert [work.wait(WAIT) for work in works] == [True] * 4
        assert works[0].result() == 1 and works[3].result() == 0  # the senders
        assert in_a.tolist() == [20.0 + start] * 3 and in_b.tolist() == [10.0 + start] * 3


def test_sends_that_find_the_ring_full_still_arrive_in_order(host_pair):
    a, b = host_pair
    # Half a ring each, from batches of their own (a send's array stays untouched until its
    # Work completes): the ring and the receiver's unexpected queue, which its engine drains
    # the ring into, fill up within 24 sends, and the later ones take the other paths.
    starts = 24
    rows = [np.full(INLINE_MAX_BYTES // 8, float(start)) for start in range(starts)]
    works = []
    for row in rows:
        works += a.batch_isend_irecv_init([("isend", row, 1, 4)]).start()
    delivered = a._engine._delivered  # the one Work of every message written into the ring
    assert works[0] is delivered and works[-1] is not delivered  # the ring filled up
    got = np.zeros_like(rows[0])
    for start in range(starts):
        assert b.recv(got, 0, 4) == 0
        assert got[0] == start and got[-1] == start
    assert all(work.wait(WAIT) for work in works)


def test_a_message_larger_than_the_ring_takes_the_default_path(host_pair):
    a, b = host_pair
    big = np.arange(INLINE_MAX_BYTES // 8 + 1, dtype=np.float64)
    batch = a.batch_isend_irecv_init([("isend", big, 1, 5)])
    assert isinstance(batch, RestartedBatch)
    work = batch.start()[0]
    got = np.zeros_like(big)
    assert b.recv(got, 0, 5) == 0 and work.wait(WAIT)
    assert np.array_equal(got, big)
