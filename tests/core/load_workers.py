"""Rank functions of the load tests (module level, so spawned processes can import them)."""

from __future__ import annotations

import os
import random
import time
from typing import Any

import numpy as np
import psutil

import colls


def many_p2p(rank: int, world_size: int, per_peer: int) -> dict[str, Any]:
    """Post ``per_peer`` receives from every peer (shuffled tags), then the matching sends."""
    rng = random.Random(1000 + rank)
    peers = [p for p in range(world_size) if p != rank]
    recvs = []
    for peer in peers:
        tags = list(range(per_peer))
        rng.shuffle(tags)
        for tag in tags:
            buf = np.zeros(3, dtype=np.int64)
            recvs.append((peer, tag, buf, colls.irecv(buf, src=peer, tag=tag)))
    sends = []
    for peer in peers:
        tags = list(range(per_peer))
        rng.shuffle(tags)
        for tag in tags:
            sends.append(colls.isend(np.array([rank, peer, tag], dtype=np.int64), dst=peer,
                                     tag=tag))
    for work in sends:
        work.wait()
    wrong = 0
    for peer, tag, buf, work in recvs:
        work.wait()
        wrong += buf.tolist() != [peer, rank, tag]
    return {"received": len(recvs), "wrong": wrong}


GROUPS = [[0, 1, 2, 3], [0, 2], [1, 3], [0, 1, 2], [1, 2, 3]]


def many_async_collectives(rank: int, world_size: int, per_group: int) -> dict[str, Any]:
    """Issue ``per_group`` async all_reduces on each of several groups, interleaved; check all."""
    groups = [colls.new_group(members) for members in GROUPS]
    pending = []
    for i in range(per_group):
        for members, group in zip(GROUPS, groups, strict=True):
            if rank not in members:
                continue
            data = np.full(8 + i % 5, float(rank + i), dtype=np.float64)
            expected = sum(float(r + i) for r in members)
            pending.append((data, expected, colls.all_reduce(data, group=group, async_op=True)))
    for _, _, work in pending:
        work.wait()
    wrong = sum(1 for data, expected, _ in pending if not (data == expected).all())
    return {"issued": len(pending), "wrong": wrong}


def soak(rank: int, world_size: int, count: int, warmup: int) -> dict[str, Any]:
    """Run ``count`` small collectives of five kinds, each checked; report memory and descriptors.

    The kinds take turns: all_reduce, broadcast (the root moves), all_gather_into_tensor,
    reduce_scatter_tensor, and a barrier. Memory and descriptors are read after ``warmup``
    collectives and at the end.
    """
    me = psutil.Process(os.getpid())
    n = world_size
    data = np.empty(16, dtype=np.float32)
    gathered = np.empty(16 * n, dtype=np.float32)
    scattered = np.empty(16 // n or 1, dtype=np.float32)

    def step(i: int) -> bool:
        kind, value = i % 5, float(i % 7)
        if kind == 0:
            data[:] = value + rank
            colls.all_reduce(data)
            return bool((data == value * n + n * (n - 1) / 2).all())
        if kind == 1:
            root = i % n
            data[:] = value if rank == root else -1
            colls.broadcast(data, src=root)
            return bool((data == value).all())
        if kind == 2:
            data[:] = value + rank
            colls.all_gather_into_tensor(gathered, data)
            return bool((gathered == np.repeat(np.arange(n) + value, 16)).all())
        if kind == 3:
            source = np.full(scattered.size * n, value + rank, dtype=np.float32)
            colls.reduce_scatter_tensor(scattered, source)
            return bool((scattered == value * n + n * (n - 1) / 2).all())
        colls.barrier()
        return True

    for i in range(warmup):
        step(i)
    colls.barrier()
    rss0, fds0 = me.memory_info().rss, me.num_fds()
    start = time.perf_counter()
    wrong = sum(not step(i) for i in range(count))
    elapsed = time.perf_counter() - start
    colls.barrier()
    return {"rss_growth": me.memory_info().rss - rss0, "fd_growth": me.num_fds() - fds0,
            "wrong": int(wrong), "seconds": elapsed}
