"""Ranks of tests/core/test_p2p_call_order.py (module-level, so spawned processes import them)."""

from __future__ import annotations

import threading

import numpy as np

import colls
from colls import dispatch


def p2p_behind_a_queued_collective(rank: int, world_size: int, asks: bool) -> list[str]:
    """Queue an async all_reduce behind a local job that blocks 0.3 s, then send/recv at once.

    Returns the order in which the all_reduce finished and the point-to-point call returned.
    """
    pg = dispatch.default_group()
    pg.backend.p2p_after_queued_collectives = asks
    release = threading.Event()
    pg.run(lambda: release.wait(10.0), op="blocker", async_op=True)
    reduced = colls.all_reduce(np.full(3, rank + 1.0), async_op=True)
    order: list[str] = []
    reduced.add_done_callback(lambda _w: order.append("all_reduce"))
    threading.Timer(0.3, release.set).start()
    if rank == 0:
        colls.isend(np.arange(2.0), dst=1).wait()
        order.append("p2p")
    else:
        got = np.zeros(2)
        work = colls.irecv(got, src=0)
        order.append("p2p")
        work.wait()
        assert got.tolist() == [0.0, 1.0]
    reduced.wait()
    return order
