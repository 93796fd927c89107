"""Conformance checks of point-to-point, barriers and object collectives.

Point-to-point checks need at least two ranks and use a ring (rank r sends to r + 1 and receives
from r - 1) or pairs (2k, 2k + 1), so they hold at any world size. Barrier checks use wall-clock
time: every rank is on one host under :func:`colls.testing.spawn`, so ``time.time()`` is one clock.
"""

from __future__ import annotations

import time
from typing import Any, Final

import numpy as np

import colls
from colls import dtypes
from colls.testing._checks_common import Suite, expect, expect_equal

#: The last rank arrives at a barrier this much later than the others.
BARRIER_DELAY_S: Final = 0.1
#: Slack for comparing times taken in different processes (clock reads are not instantaneous).
CLOCK_SLACK_S: Final = 0.002
#: Seconds a check waits on a Work before calling the backend hung.
WAIT_S: Final = 30.0
#: Tags of the out-of-order point-to-point case: sent in this order, received sorted.
SEND_TAGS: Final = (3, 1, 2)
FIFO_TAG: Final = 5
FIFO_MESSAGES: Final = 3
ANY_SOURCE_TAG: Final = 7


def _message(src: int, tag: int, k: int = 0) -> np.ndarray:
    return np.array([src, tag, k, 1000 * src + 10 * tag + k], dtype=np.int64)


def _ring(s: Suite) -> tuple[int, int]:
    return (s.rank + 1) % s.world_size, (s.rank - 1) % s.world_size


def check_p2p(s: Suite) -> None:
    """isend/irecv by tag, FIFO per tag, blocking send/recv, any-source recv, batches."""
    if not s.peers:
        return
    i64 = dtypes.INT64
    right, left = _ring(s)
    with s.case("isend/irecv with several tags (sent out of order)"):
        recvs = {tag: s.lib.make(np.zeros(4, np.int64), i64) for tag in sorted(SEND_TAGS)}
        rworks = {tag: colls.irecv(arr, src=left, tag=tag) for tag, arr in recvs.items()}
        sworks = [colls.isend(s.lib.make(_message(s.rank, tag), i64), dst=right, tag=tag)
                  for tag in SEND_TAGS]
        for tag, work in rworks.items():
            expect(work.wait(timeout=WAIT_S) is True, f"irecv(tag={tag}).wait() is not True")
            expect(work.source_rank() == left, f"irecv source_rank {work.source_rank()} != {left}")
            expect_equal(s.lib.to_numpy(recvs[tag]), _message(left, tag), f"message tag {tag}")
        for work in sworks:
            work.wait(timeout=WAIT_S)
    with s.case("messages with one tag arrive in order", tag=FIFO_TAG):
        sworks = [colls.isend(s.lib.make(_message(s.rank, FIFO_TAG, k), i64), dst=right,
                              tag=FIFO_TAG) for k in range(FIFO_MESSAGES)]
        for k in range(FIFO_MESSAGES):
            arr = s.lib.make(np.zeros(4, np.int64), i64)
            expect(colls.recv(arr, src=left, tag=FIFO_TAG) == left, "recv returned another rank")
            expect_equal(s.lib.to_numpy(arr), _message(left, FIFO_TAG, k), f"message {k}")
        for work in sworks:
            work.wait(timeout=WAIT_S)
    with s.case("blocking send/recv in pairs"):
        _pairs(s)
    with s.case("recv from any source returns the sender", tag=ANY_SOURCE_TAG):
        _any_source(s)
    with s.case("batch_isend_irecv ring"):
        payload = s.lib.make(_message(s.rank, 9), i64)
        into = s.lib.make(np.zeros(4, np.int64), i64)
        ops = [colls.P2POp(colls.irecv, into, left, tag=9),
               colls.P2POp(colls.isend, payload, right, tag=9)]
        works = colls.batch_isend_irecv(ops)
        expect(len(works) == 2, f"batch_isend_irecv returned {len(works)} Works, expected 2")
        for work in works:
            work.wait(timeout=WAIT_S)
        expect_equal(s.lib.to_numpy(into), _message(left, 9), "received")


def _pairs(s: Suite) -> None:
    partner = s.rank ^ 1
    if partner >= s.world_size:
        return  # the last rank of an odd world has no partner
    i64 = dtypes.INT64
    mine = s.lib.make(_message(s.rank, 4), i64)
    into = s.lib.make(np.zeros(4, np.int64), i64)
    if s.rank % 2 == 0:
        colls.send(mine, dst=partner, tag=4)
        sender = colls.recv(into, src=partner, tag=4)
    else:
        sender = colls.recv(into, src=partner, tag=4)
        colls.send(mine, dst=partner, tag=4)
    expect(sender == partner, f"recv returned {sender}, expected {partner}")
    expect_equal(s.lib.to_numpy(into), _message(partner, 4), "received")


def _any_source(s: Suite) -> None:
    i64 = dtypes.INT64
    if s.rank != 0:
        colls.send(s.lib.make(_message(s.rank, ANY_SOURCE_TAG), i64), dst=0, tag=ANY_SOURCE_TAG)
    else:
        senders = []
        for _ in range(s.world_size - 1):
            into = s.lib.make(np.zeros(4, np.int64), i64)
            sender = colls.recv(into, tag=ANY_SOURCE_TAG)
            expect_equal(s.lib.to_numpy(into), _message(sender, ANY_SOURCE_TAG),
                         f"message that recv attributed to rank {sender}")
            senders.append(sender)
        expect(sorted(senders) == list(range(1, s.world_size)),
               f"recv from any source returned senders {senders}")
    # irecv from any source: the last rank receives one message from rank 0.
    last = s.world_size - 1
    if s.rank == last:
        into = s.lib.make(np.zeros(4, np.int64), i64)
        work = colls.irecv(into, tag=ANY_SOURCE_TAG + 1)
        expect(work.source_rank() == 0, f"irecv source_rank() {work.source_rank()}, expected 0")
        expect_equal(s.lib.to_numpy(into), _message(0, ANY_SOURCE_TAG + 1), "received")
    elif s.rank == 0:
        colls.send(s.lib.make(_message(0, ANY_SOURCE_TAG + 1), i64), dst=last,
                   tag=ANY_SOURCE_TAG + 1)


def _barrier_order(s: Suite, enter: Any) -> None:
    """Check that nobody left ``enter`` (a barrier call) before the last rank entered it."""
    if s.rank == s.world_size - 1:
        time.sleep(BARRIER_DELAY_S)
    entered = time.time()
    enter()
    left = time.time()
    times = np.zeros(s.world_size, dtype=np.float64)
    colls.all_gather_into_tensor(times, np.array([entered]))
    expect(left + CLOCK_SLACK_S >= times.max(),
           f"left the barrier at {left:.4f}, {times.max() - left:.4f} s before the last rank "
           f"(rank {int(times.argmax())}) entered it")


def check_barriers(s: Suite) -> None:
    """barrier and monitored_barrier release nobody before every rank arrived."""
    with s.case("barrier"):
        _barrier_order(s, lambda: expect(colls.barrier() is None, "barrier returned a value"))
    with s.case("barrier(async_op=True)"):
        _barrier_order(s, lambda: colls.barrier(async_op=True).wait(timeout=WAIT_S))
    for wait_all in (False, True):
        with s.case("monitored_barrier", wait_all_ranks=wait_all):
            _barrier_order(s, lambda w=wait_all: colls.monitored_barrier(
                timeout=WAIT_S, wait_all_ranks=w))


def _obj(rank: int) -> dict[str, Any]:
    return {"rank": rank, "text": "x" * (3 * rank), "list": list(range(rank)),
            "nested": ({"a": rank},)}


def check_objects(s: Suite) -> None:
    """The *_object collectives and send/recv_object_list."""
    ws = s.world_size
    with s.case("all_gather_object"):
        out: list[Any] = [None] * ws
        colls.all_gather_object(out, _obj(s.rank))
        expect(out == [_obj(r) for r in range(ws)], f"got {out}")
    for root in range(ws):
        with s.case("gather_object", root=root):
            gathered = [None] * ws if s.rank == root else None
            colls.gather_object(_obj(s.rank), gathered, dst=root)
            if s.rank == root:
                expect(gathered == [_obj(r) for r in range(ws)], f"got {gathered}")
    for root in {0, ws - 1}:
        with s.case("broadcast_object_list", root=root):
            objs = [_obj(root), "tail", 3.5] if s.rank == root else [None, None, None]
            colls.broadcast_object_list(objs, src=root)
            expect(objs == [_obj(root), "tail", 3.5], f"got {objs}")
        with s.case("scatter_object_list", root=root):
            out = [None]
            ins = [_obj(r) for r in range(ws)] if s.rank == root else None
            colls.scatter_object_list(out, ins, group_src=root)
            expect(out[0] == _obj(s.rank), f"got {out[0]}")
    if s.peers:
        with s.case("send_object_list/recv_object_list"):
            _object_pairs(s)


def _object_pairs(s: Suite) -> None:
    partner = s.rank ^ 1
    if partner >= s.world_size:
        return
    if s.rank % 2 == 0:
        colls.send_object_list([_obj(s.rank), "done"], dst=partner)
    else:
        got: list[Any] = [None, None]
        sender = colls.recv_object_list(got)
        expect(sender == partner, f"recv_object_list returned {sender}, expected {partner}")
        expect(got == [_obj(partner), "done"], f"got {got}")
