"""Rank functions of the load tests (module level, so spawned processes can import them)."""

from __future__ import annotations

import os
import random
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
    """Run ``count`` small all_reduces; report memory and descriptors after warm-up and at end."""
    me = psutil.Process(os.getpid())
    data = np.ones(16, dtype=np.float32)
    for _ in range(warmup):
        colls.all_reduce(data)
        data[:] = 1
    colls.barrier()
    rss0, fds0 = me.memory_info().rss, me.num_fds()
    wrong = 0
    for i in range(count):
        data[:] = i % 7
        colls.all_reduce(data)
        wrong += data[0] != (i % 7) * world_size
    colls.barrier()
    return {"rss_growth": me.memory_info().rss - rss0, "fd_growth": me.num_fds() - fds0,
            "wrong": int(wrong)}
