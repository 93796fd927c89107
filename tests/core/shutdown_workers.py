"""Rank functions for test_clean_shutdown (run by colls.testing.spawn in real processes)."""

from __future__ import annotations

import time

import numpy as np

import colls


def store_host_leaves_first(rank: int, world_size: int) -> list[float] | str:
    """Rank 0 (the store host) sends and returns at once; the others receive a moment later."""
    if rank == 0:
        for dst in range(1, world_size):
            colls.send(np.arange(4.0) + dst, dst=dst)
        return "sent"
    time.sleep(1.0)  # rank 0 is already in destroy_process_group by now
    buf = np.zeros(4)
    colls.recv(buf, src=0)
    colls.all_reduce(np.ones(1), group=colls.new_group([r for r in range(1, world_size)]))
    return buf.tolist()
